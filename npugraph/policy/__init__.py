"""Which attention kernel each captured graph uses: PA for small batches, FIA above.

Two policies, both consulted once per ``(namespace, key)`` at capture:

* :class:`StaticPolicy` (the default) — PA for padded sizes in ``pa_sizes``
  (default ``{1, 2, 3, 4}``, vllm-ascend's ``pa_shape_list``), FIA otherwise;
* :class:`MeasuredPolicy` — the faster kernel per size, as timed by
  :func:`measure_policy` and saved to / loaded from a JSON file so that every rank
  (and the next start) makes the same choice without measuring.

Both pick FIA whenever PA cannot run the graph: more than one query token per
request (speculative verification), or a head size or dtype PA does not support.
"""

from __future__ import annotations

import json
import random
import statistics
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch

from npugraph.capture.manager import KernelChoice
from npugraph.errors import PolicyError
from npugraph.ops import PA, AttentionCall
from npugraph.policy.fixed import FixedPolicy

__all__ = [
    "DEFAULT_PA_SIZES",
    "FixedPolicy",
    "MeasuredPolicy",
    "PolicySignature",
    "StaticPolicy",
    "load_policy",
    "measure_policy",
]

DEFAULT_PA_SIZES = frozenset({1, 2, 3, 4})
POLICY_SCHEMA = "npugraph-policy/1"


def _pa_blocker(calls: Iterable[AttentionCall]) -> str | None:
    for call in calls:
        why = PA.unsupported(call)
        if why is not None:
            return f"FIA: {why}"
    return None


@attrs.frozen
class StaticPolicy:
    """PA for padded token counts in ``pa_sizes``, FIA otherwise (unless PA cannot run)."""

    pa_sizes: frozenset[int] = attrs.field(default=DEFAULT_PA_SIZES, converter=frozenset)

    def choose(self, namespace: str, key: Hashable, tokens: int, calls: Sequence[AttentionCall]) -> KernelChoice:
        """Pick the kernel for the graph of ``(namespace, key)`` with ``tokens`` tokens."""
        reason = _pa_blocker(calls)
        if reason is not None:
            return KernelChoice(kernel="fia", reason=reason)
        if tokens in self.pa_sizes:
            return KernelChoice(kernel="pa", reason=f"static: size {tokens} in pa_sizes {sorted(self.pa_sizes)}")
        return KernelChoice(kernel="fia", reason=f"static: size {tokens} not in pa_sizes {sorted(self.pa_sizes)}")


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
    default: StaticPolicy = StaticPolicy()

    def check_device(self, device: str) -> None:
        """Refuse a file measured on another kind of device."""
        if device != self.signature.device:
            raise PolicyError(
                f"kernel policy was measured on device {self.signature.device!r}, this runtime runs on "
                f"{device!r}; measure it again here (npugraph policy measure)"
            )

    def choose(self, namespace: str, key: Hashable, tokens: int, calls: Sequence[AttentionCall]) -> KernelChoice:
        if calls:
            mine = PolicySignature.of(calls[0], self.signature.device)
            diffs = self.signature.differences(mine)
            if diffs:
                raise PolicyError(
                    "kernel policy file does not match this model: "
                    + "; ".join(diffs)
                    + ". Measure a policy for these shapes (npugraph policy measure)."
                )
        reason = _pa_blocker(calls)
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
        """Write the measurements and the choice to ``path`` (JSON)."""
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)


def load_policy(path: str) -> MeasuredPolicy:
    """Load a policy written by :meth:`MeasuredPolicy.save`; no measuring happens."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as exc:
        raise PolicyError(f"cannot read kernel policy {path!r}: {exc}") from exc
    if doc.get("schema") != POLICY_SCHEMA:
        raise PolicyError(
            f"{path!r} is not a kernel policy file (schema {doc.get('schema')!r}, expected {POLICY_SCHEMA})"
        )
    sig = PolicySignature(**doc["signature"])
    choices, meas = {}, {}
    for t, row in doc["sizes"].items():
        choices[int(t)] = KernelChoice(kernel=row["kernel"], reason=row["reason"])
        if row.get("pa_us") and row.get("fia_us"):
            meas[int(t)] = SizeMeasurement(pa_us=tuple(row["pa_us"]), fia_us=tuple(row["fia_us"]))
    return MeasuredPolicy(
        signature=sig,
        choices=choices,
        measurements=meas,
        margin=float(doc["margin"]),
        default=StaticPolicy(doc.get("default_pa_sizes", sorted(DEFAULT_PA_SIZES))),
    )


def _time_kernel(
    device: str, kernel: str, size: int, cfg: Mapping[str, Any], lengths: Sequence[Sequence[int]], warmup: int
) -> list[float]:
    """Device time (us) of replays of a one-layer graph using ``kernel`` at ``size``."""
    from npugraph.models.stack import AttentionStack
    from npugraph.replay.lens import AttentionMetadata
    from npugraph.runtime import Runtime

    rt = Runtime(device, max_model_len=cfg["max_model_len"], policy=FixedPolicy(kernel))
    stack = AttentionStack(
        rt,
        layers=1,
        heads=cfg["heads"],
        kv_heads=cfg["kv_heads"],
        head_size=cfg["head_size"],
        block_size=cfg["block_size"],
        num_blocks=cfg["num_blocks"],
        dtype=cfg["dtype"],
    )
    cols = -(-cfg["max_model_len"] // cfg["block_size"])
    gen = torch.Generator().manual_seed(size)
    table = torch.randint(0, cfg["num_blocks"], (size, cols), dtype=torch.int32, generator=gen)
    q = torch.randn(size, cfg["heads"], cfg["head_size"], generator=gen).to(cfg["dtype"])
    rt.capture(stack, q, AttentionMetadata(seq_lens=torch.ones(size, dtype=torch.int32), block_table=table), key=size)
    npu = rt.device.npu
    start, end = npu.Event(enable_timing=True), npu.Event(enable_timing=True)
    out = []
    for i, lens in enumerate(lengths):
        rt.update(
            size, {"default": AttentionMetadata(seq_lens=torch.tensor(lens, dtype=torch.int32), block_table=table)}
        )
        start.record(npu.current_stream())
        rt.replay(size)
        end.record(npu.current_stream())
        rt.synchronize()
        if i >= warmup:
            out.append(start.elapsed_time(end) * 1e3)  # ms → us
    rt.manager.reset()
    return out


def measure_policy(
    sizes: Sequence[int],
    *,
    device: str = "sim",
    heads: int,
    kv_heads: int,
    head_size: int,
    block_size: int,
    max_model_len: int,
    dtype: torch.dtype = torch.float16,
    num_blocks: int | None = None,
    repeats: int = 7,
    warmup: int = 2,
    margin: float = 0.05,
    default: StaticPolicy | None = None,
    seed: int = 0,
    progress: Callable[[int, SizeMeasurement], None] | None = None,
) -> MeasuredPolicy:
    """Time one captured attention layer with PA and with FIA at each size; keep the faster.

    Lengths are drawn (seeded) over ``[1, max_model_len]``, the same for both kernels;
    each kernel's time is the median of ``repeats`` replays, read from device events.
    When the two are within ``margin`` (relative), the default policy's choice stands.
    """
    default = default or StaticPolicy()
    cfg = {
        "heads": heads,
        "kv_heads": kv_heads,
        "head_size": head_size,
        "block_size": block_size,
        "max_model_len": max_model_len,
        "dtype": dtype,
        "num_blocks": num_blocks or 64,
    }
    rng = random.Random(seed)
    choices: dict[int, KernelChoice] = {}
    meas: dict[int, SizeMeasurement] = {}
    for size in sorted(set(sizes)):
        lengths = [[rng.randint(1, max_model_len) for _ in range(size)] for _ in range(warmup + repeats)]
        m = SizeMeasurement(
            pa_us=tuple(_time_kernel(device, "pa", size, cfg, lengths, warmup)),
            fia_us=tuple(_time_kernel(device, "fia", size, cfg, lengths, warmup)),
        )
        meas[size] = m
        pa, fia = m.pa_median, m.fia_median
        if abs(pa - fia) <= margin * min(pa, fia):
            base = default.choose("", size, size, [])
            choices[size] = KernelChoice(
                kernel=base.kernel,
                reason=f"measured: PA {pa:.1f}us vs FIA {fia:.1f}us within {margin:.0%}; default keeps {base.kernel}",
            )
        else:
            k = "pa" if pa < fia else "fia"
            choices[size] = KernelChoice(kernel=k, reason=f"measured: PA {pa:.1f}us vs FIA {fia:.1f}us")
        if progress is not None:
            progress(size, m)
    from npugraph.device import load_device

    sig = PolicySignature(
        heads=heads,
        kv_heads=kv_heads,
        head_size=head_size,
        dtype=str(dtype).replace("torch.", ""),
        block_size=block_size,
        device=load_device(device).name,
    )
    return MeasuredPolicy(signature=sig, choices=choices, measurements=meas, margin=margin, default=default)
