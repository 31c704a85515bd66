"""The decoder under continuous batching: every replayed step bitwise equal to eager."""

from __future__ import annotations

import pytest
import torch

import npusim as sim
from npugraph.models import Workload

from .helpers import SIZES, build, run


@pytest.mark.slow
@pytest.mark.parametrize("order", ["update-first", "replay-first"])
def test_300_steps_bitwise_equal_to_eager(order):
    cfg, rt, _, eng = build(order=order)
    assert sorted(rt.manager.keys()) == SIZES
    assert run(eng, cfg, 300, seed=1) == 0
    kernels = {e.key: e.choice.kernel for e in rt.manager.entries()}
    assert kernels == {1: "pa", 2: "pa", 4: "pa", 8: "fia_sink", 16: "fia_sink"}  # FIA: lengths on the device
    assert sum(rt.updater.state(e).replays for e in rt.manager.entries()) == 300
    assert len({e.key for e in rt.manager.entries() if rt.updater.state(e).replays}) >= 3, (
        "the workload visits several sizes"
    )


def test_fused_4_in_1_update_path_is_bitwise_equal():
    cfg, rt, _, eng = build(sizes=[1, 8, 16], fused_update=True, device_lengths=False)  # FIA updated per layer
    assert rt.updater.plan(rt.manager.entry("main", 8)).tasks[0].fused, "FIA tasks use the 4-in-1"
    assert not rt.updater.plan(rt.manager.entry("main", 1)).tasks[0].fused, "PA has no 4-in-1"
    assert run(eng, cfg, 60, seed=6) == 0


@pytest.mark.slow
@pytest.mark.parametrize("seed", [3, 4])
def test_adversarial_scheduling_stays_bitwise_equal(seed):
    sim.configure(adversarial_seed=seed)
    cfg, rt, _, eng = build(order="replay-first" if seed % 2 else "update-first")
    assert run(eng, cfg, 120, seed=seed, adversarial=True) == 0


def test_skipping_the_update_gives_wrong_logits():
    """Record the events but skip the rewrite: stale lengths must give wrong logits."""
    cfg, rt, _, eng = build(sizes=[8])
    it = Workload(cfg, [8], seed=5).steps(10)
    first = next(it)
    eng.eager(first)
    eng.step(first)
    b = next(it)
    ref = eng.eager(b).clone()
    entry = rt.manager.entry("main", 8)
    for name in ("input_ids", "positions", "slot_mapping"):
        eng.buffers[name].copy_(getattr(b, name))
    recorders = {id(t.event): t.event for t in entry.tasks if t.records}  # once each (tiling-sink tasks share one)
    for event in recorders.values():  # what a forgotten update looks like: events only
        event.record(rt.updater.stream)
    entry.graph.replay()
    rt.synchronize()
    stale = entry.outputs[: b.num_reqs].clone()
    assert not torch.equal(stale, ref), "the test must detect stale lengths"
    assert torch.equal(eng.step(b), ref), "with the update the same step is right"
