"""A kernel policy measured per size, saved to and loaded from JSON."""

from __future__ import annotations

import json
import statistics
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import attrs

from npugraph.errors import PolicyError
from npugraph.files import FileError, read_json, write_text
from npugraph.ops import AttentionCall
from npugraph.policy.choice import KernelChoice
from npugraph.policy.static import DEFAULT_PA_SIZES, StaticPolicy, mla_choice, pa_blocker

__all__ = ["POLICY_SCHEMA", "MeasuredPolicy", "PolicySignature", "SizeMeasurement", "load_policy"]

POLICY_SCHEMA = "npugraph-policy/1"


@attrs.frozen(kw_only=True)
class PolicySignature:
    """What a measured policy is valid for; a file for other shapes is refused."""

    heads: int
    kv_heads: int
    head_size: int
    dtype: str
    block_size: int
    device: str

    @classmethod
    def of(cls, call: AttentionCall, device: str) -> PolicySignature:
        return cls(
            heads=call.num_heads,
            kv_heads=call.num_kv_heads,
            head_size=int(call.query.shape[-1]),
            dtype=str(call.query.dtype).replace("torch.", ""),
            block_size=call.block_size,
            device=device,
        )

    def differences(self, other: PolicySignature, *, ignore_device: bool = False) -> list[str]:
        diffs = []
        for f in attrs.fields(PolicySignature):
            if ignore_device and f.name == "device":
                continue
            a, b = getattr(self, f.name), getattr(other, f.name)
            if a != b:
                diffs.append(f"{f.name}: file has {a!r}, this model has {b!r}")
        return diffs


@attrs.frozen(kw_only=True)
class SizeMeasurement:
    """Device time of one captured attention layer at one size, per kernel."""

    pa_us: tuple[float, ...]
    fia_us: tuple[float, ...]

    @property
    def pa_median(self) -> float:
        return statistics.median(self.pa_us)

    @property
    def fia_median(self) -> float:
        return statistics.median(self.fia_us)


@attrs.frozen(kw_only=True)
class MeasuredPolicy:
    """The kernel measured fastest per size; sizes not measured fall back to ``default``."""

    signature: PolicySignature
    choices: Mapping[int, KernelChoice]
    measurements: Mapping[int, SizeMeasurement]
    margin: float
    default: StaticPolicy = attrs.field(factory=StaticPolicy)

    def check_device(self, device: str) -> None:
        """Refuse a file measured on another kind of device."""
        if device != self.signature.device:
            raise PolicyError(
                f"kernel policy was measured on device {self.signature.device!r}, this runtime runs on "
                f"{device!r}; measure it again here (npugraph policy measure)"
            )

    def check_shapes(self, *, heads: int, kv_heads: int, head_size: int, dtype: str, block_size: int) -> None:
        """Refuse, before any capture, a file measured for other attention shapes."""
        mine = PolicySignature(
            heads=heads,
            kv_heads=kv_heads,
            head_size=head_size,
            dtype=dtype.replace("torch.", ""),
            block_size=block_size,
            device=self.signature.device,
        )
        self._refuse_other(mine)

    def _refuse_other(self, mine: PolicySignature) -> None:
        diffs = self.signature.differences(mine)
        if diffs:
            raise PolicyError(
                "kernel policy file does not match this model: "
                + "; ".join(diffs)
                + ". Measure a policy for these shapes (npugraph policy measure)."
            )

    def choose(self, namespace: str, key: Hashable, tokens: int, calls: Sequence[AttentionCall]) -> KernelChoice:
        mla = mla_choice(calls)
        if mla is not None:
            return mla  # measured for GQA shapes; MLA has one kernel
        if calls:
            self._refuse_other(PolicySignature.of(calls[0], self.signature.device))
        reason = pa_blocker(calls)
        if reason is not None:
            return KernelChoice(kernel="fia", reason=reason)
        choice = self.choices.get(tokens)
        if choice is None:
            base = self.default.choose(namespace, key, tokens, calls)
            return KernelChoice(kernel=base.kernel, reason=f"not measured; {base.reason}")
        return choice

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": POLICY_SCHEMA,
            "signature": attrs.asdict(self.signature),
            "margin": self.margin,
            "default_pa_sizes": sorted(self.default.pa_sizes),
            "sizes": {
                str(t): {
                    "kernel": c.kernel,
                    "reason": c.reason,
                    "pa_us_median": self.measurements[t].pa_median if t in self.measurements else None,
                    "fia_us_median": self.measurements[t].fia_median if t in self.measurements else None,
                    "pa_us": list(self.measurements[t].pa_us) if t in self.measurements else [],
                    "fia_us": list(self.measurements[t].fia_us) if t in self.measurements else [],
                }
                for t, c in sorted(self.choices.items())
            },
        }

    def save(self, path: str) -> None:
        """Write the measurements and the choice to ``path`` (JSON; never through a symlink)."""
        write_text(path, json.dumps(self.to_json(), indent=1))


def _need(cond: bool, path: str, what: str) -> None:
    if not cond:
        raise PolicyError(f"kernel policy {path!r}: {what}; write it with 'npugraph policy measure'")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _us_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)


def load_policy(path: str) -> MeasuredPolicy:
    """Load a policy written by :meth:`MeasuredPolicy.save`; no measuring happens.

    The file is size-capped and checked field by field: anything else is a
    :class:`~npugraph.errors.PolicyError` naming what is wrong.
    """
    try:
        doc = read_json(path, "kernel policy")
    except FileError as exc:
        raise PolicyError(str(exc)) from exc
    _need(isinstance(doc, dict), path, f"the document is a JSON {type(doc).__name__}, not an object")
    _need(
        doc.get("schema") == POLICY_SCHEMA,
        path,
        f"schema is {doc.get('schema')!r}, expected {POLICY_SCHEMA!r} (not a kernel policy file)",
    )
    sig = doc.get("signature")
    _need(isinstance(sig, dict), path, "'signature' must be an object")
    for f in attrs.fields(PolicySignature):
        want = str if f.name in ("dtype", "device") else int
        v = sig.get(f.name)
        ok = isinstance(v, str) if want is str else _is_int(v)
        _need(ok, path, f"signature.{f.name} must be {'a string' if want is str else 'an integer'}, got {v!r}")
    margin = doc.get("margin")
    _need(
        isinstance(margin, (int, float)) and not isinstance(margin, bool),
        path,
        f"'margin' must be a number, got {margin!r}",
    )
    default_sizes = doc.get("default_pa_sizes", sorted(DEFAULT_PA_SIZES))
    _need(
        isinstance(default_sizes, list) and all(_is_int(x) for x in default_sizes),
        path,
        "'default_pa_sizes' must be a list of integers",
    )
    sizes = doc.get("sizes")
    _need(isinstance(sizes, dict), path, "'sizes' must be an object keyed by token count")
    choices, meas = {}, {}
    for t, row in sizes.items():
        _need(t.isdigit() and int(t) >= 1, path, f"size {t!r} is not a positive token count")
        _need(isinstance(row, dict), path, f"sizes[{t}] must be an object")
        kernel, reason = row.get("kernel"), row.get("reason")
        _need(kernel in ("pa", "fia"), path, f"sizes[{t}].kernel is {kernel!r}; expected 'pa' or 'fia'")
        _need(isinstance(reason, str), path, f"sizes[{t}].reason must be a string")
        choices[int(t)] = KernelChoice(kernel=kernel, reason=reason)
        pa_us, fia_us = row.get("pa_us", []), row.get("fia_us", [])
        _need(_us_list(pa_us) and _us_list(fia_us), path, f"sizes[{t}].pa_us / fia_us must be lists of numbers")
        if pa_us and fia_us:
            meas[int(t)] = SizeMeasurement(pa_us=tuple(pa_us), fia_us=tuple(fia_us))
    return MeasuredPolicy(
        signature=PolicySignature(**{f.name: sig[f.name] for f in attrs.fields(PolicySignature)}),
        choices=choices,
        measurements=meas,
        margin=float(margin),
        default=StaticPolicy(default_sizes),
    )
