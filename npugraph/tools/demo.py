"""``npugraph demo``'s decode loop: capture a decoder, decode a workload under continuous
batching, check every step against eager and, every few steps, against the float64
reference; then its table and its JSON summary."""

from __future__ import annotations

import statistics
import time
from typing import Any

import attrs
import torch
from tqdm import tqdm

from npugraph.models import Workload
from npugraph.models.engine import DecodeEngine

__all__ = ["DemoRun", "decode", "report"]

REF_TOL = {"float32": 1e-3, "float16": 2e-2, "bfloat16": 6e-2}  # relative to the largest logit


@attrs.define(kw_only=True)
class DemoRun:
    """What a demo decode saw: per captured size, the host time of each half of the step
    without the device's work, the device's work (on the simulator it runs on the CPU, inside
    whichever host call unblocks it), and the whole step with its synchronize."""

    capture_s: float
    times: dict[Any, dict[str, list[float]]]  # per graph key (a size, or a size at a width)
    steps: int = 0
    mismatches: int = 0
    first_mismatch: int | None = None
    reference_checks: int = 0
    reference_failures: int = 0
    reference_worst: float = 0.0


def decode(
    engine: DecodeEngine, wl: Workload, *, steps: int, reference_every: int, dtype: str, progress: bool
) -> DemoRun:
    """Capture ``engine``'s graphs, then decode ``steps`` steps of ``wl`` through them."""
    rt = engine.runtime
    t0 = time.perf_counter()
    engine.capture()
    run = DemoRun(capture_s=time.perf_counter() - t0, times={})
    for i, batch in enumerate(tqdm(wl.steps(steps), total=steps, desc="decoding", unit="step", disable=not progress)):
        ref = engine.eager(batch).clone()
        inputs = {"input_ids": batch.input_ids, "positions": batch.positions, "slot_mapping": batch.slot_mapping}
        metadata = engine.metadata(batch.meta)
        entry = rt.graph_for(batch.size, metadata)  # Runtime.step's pick: a width's graph, or the size's
        assert entry is not None  # every size was captured
        t = run.times.setdefault(entry.key, {"update": [], "replay": [], "device": [], "total": []})
        t1, d1 = time.perf_counter(), rt.device.device_seconds()
        out = rt.step_graph(entry, metadata, inputs)
        rt.synchronize()
        t["total"].append(time.perf_counter() - t1)
        t["device"].append(rt.device.device_seconds() - d1)
        state = rt.graph_state(entry.key)
        t["update"].append(state.last_update_s)
        t["replay"].append(state.last_replay_s)
        got = out[: batch.num_reqs]
        run.steps += 1
        if not torch.equal(got, ref):
            run.mismatches += 1
            if run.first_mismatch is None:
                run.first_mismatch = i
        if i % reference_every == 0:  # and against the float64-attention reference
            _check_reference(run, engine, batch, got, REF_TOL[dtype])
        wl.feedback(batch.rids, got.argmax(-1).tolist())
    return run


def _check_reference(run: DemoRun, engine: DecodeEngine, batch: Any, got: torch.Tensor, tol: float) -> None:
    lens = batch.meta.seq_lens.tolist()
    ind = engine.model.reference_logits(
        batch.input_ids, batch.positions, batch.slot_mapping, lens, [1] * len(lens), batch.meta.block_table
    )
    err = float((got.float() - ind).abs().max()) if lens else 0.0
    scale = max(1.0, float(ind.abs().max()) if lens else 1.0)
    run.reference_worst = max(run.reference_worst, err / scale)
    run.reference_checks += 1
    if err > tol * scale:
        run.reference_failures += 1


def _ordered(entries: list[Any]) -> list[Any]:
    """Graphs by size, each size's update-free widths before its updated graph."""
    return sorted(entries, key=lambda e: (e.tokens, e.width if e.width is not None else 1 << 62))


def _median_us(xs: list[float]) -> float | None:
    return statistics.median(xs) * 1e6 if xs else None


def report(run: DemoRun, engine: DecodeEngine, *, model: str, layers: int, settings: dict[str, Any]) -> dict[str, Any]:
    """Print the demo's table and verdicts; the JSON summary (``settings`` joins it as given)."""
    rt = engine.runtime

    def med(xs: list[float]) -> str:
        us = _median_us(xs)
        return "-" if us is None else f"{us:.0f}"

    print(
        f"npugraph demo ({model}) on {rt.device.name}: {layers} layers, sizes {engine.sizes}, "
        f"captured in {run.capture_s:.2f}s"
    )
    device_col = "sim dev us" if rt.device.is_sim else "device us"
    widths = any(e.width is not None for e in rt.entries())
    sw, kw = (8, 10) if widths else (5, 8)  # columns wide enough for "32@w1024" and "fia_frozen"
    print(
        f"{'size':>{sw}} {'kernel':>{kw}} {'replays':>8} {'update us':>10} {'replay us':>10} {device_col:>10} "
        f"{'total us':>10}  why"
    )
    idle = 0
    for e in _ordered(rt.entries()):
        t = run.times.get(e.key, {"update": [], "replay": [], "device": [], "total": []})
        if e.width is not None and not t["total"]:
            idle += 1  # an update-free graph no step needed: counted, not listed
            continue
        dev_cell = med(t["device"]) if rt.device.is_sim else "-"
        size = e.size_label
        print(
            f"{size:>{sw}} {e.choice.kernel:>{kw}} {rt.graph_state(e.key).replays:>8} {med(t['update']):>10} "
            f"{med(t['replay']):>10} {dev_cell:>10} {med(t['total']):>10}  {e.choice.reason}"
        )
    if idle:
        print(f"({idle} update-free graphs at widths no step needed are not listed)")
    verdict = f"{run.steps} steps, {run.mismatches} mismatches"
    if run.first_mismatch is not None:
        verdict += f" (first at step {run.first_mismatch})"
    print(verdict)
    print(
        f"{run.reference_checks} steps against the float64 reference: {run.reference_failures} beyond tolerance "
        f"(worst relative error {run.reference_worst:.2g})"
    )
    every = {k: [x for t in run.times.values() for x in t[k]] for k in ("update", "replay", "device")}
    return {
        "model": model,
        "device": rt.device.name,
        "layers": layers,
        "capture_sizes": engine.sizes,
        "steps": run.steps,
        "mismatches": run.mismatches,
        "kernel_by_size": {repr(e.key): e.choice.kernel for e in _ordered(rt.entries())},
        "kernel_reason_by_size": {repr(e.key): e.choice.reason for e in _ordered(rt.entries())},
        "update_us_median": _median_us(every["update"]),
        "replay_us_median": _median_us(every["replay"]),
        # the simulator's device work per step (it runs on the CPU); None on hardware
        "sim_device_us_median": _median_us(every["device"]) if rt.device.is_sim else None,
        "timing_note": "update/replay: host time without the simulated device's work",
        "capture_seconds": run.capture_s,
        **settings,
        "reference_checks": run.reference_checks,
        "reference_failures": run.reference_failures,
        "reference_worst_relative_error": run.reference_worst,
    }
