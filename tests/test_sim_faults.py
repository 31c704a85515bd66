"""Device faults injected into the simulator (``NPUGRAPH_SIM_FAULT``; npusim.runtime.faults):
a kernel that fails inside a replay and an ExternalEvent record the device loses.  Each is
named by the device's own error, whoever synchronizes (an engine does it itself), with the
graph and the layer npugraph gave it; npugraph's synchronize turns it into its typed error;
and the next good step is right.  The release check injects the same faults into a real
vLLM engine (release/faults.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import npusim as sim
from npugraph import Runtime
from npugraph.device import load_device
from npugraph.errors import GraphDeadlock, ReplayFailed
from npugraph.models import Decoder, DecoderConfig, Workload
from npugraph.models.engine import DecodeEngine

FIA = "npu_fused_infer_attention_score"


ORDERS = ["replay-first", "update-first"]


# The simulator's own adapter, and npugraph's Ascend adapter over the simulator installed as
# torch_npu (NPUGRAPH_SIM_TORCH_NPU=1: how the release check runs vLLM; the device's own
# reports must name npugraph's graphs there too, and its error types are hardware's: none).
ADAPTERS = ["sim", "npu"]


@pytest.fixture
def sim_as_torch_npu(monkeypatch):
    """``import torch_npu`` and ``torch.npu`` give the simulator in this process."""
    monkeypatch.setitem(sys.modules, "torch_npu", sim)
    monkeypatch.setattr(torch, "npu", sim.npu, raising=False)


def _engine(faults: str, order: str = "replay-first", adapter: str = "sim") -> tuple[Runtime, DecodeEngine, list]:
    """A 2-layer decoder captured at 4 (PA) and 8 (FIA, its lengths updated per layer, as on a
    device without the tiling-sink kernel: each layer a task group) on a device with
    ``faults`` injected; its steps of size 8, and their outputs on a device without faults."""
    cfg = DecoderConfig(layers=2, num_blocks=64, max_model_len=128)
    batches = [b for b in Workload(cfg, [4, 8], seed=3, max_batch=8).steps(40) if b.size == 8][:4]
    assert len(batches) == 4
    refs = []
    for plan in ("", faults):  # the same seeded weights on a healthy device, then on a faulty one
        sim.configure(faults=plan)
        torch.manual_seed(0)
        rt = Runtime(load_device(adapter), max_model_len=cfg.max_model_len, device_lengths=False, order=order)
        eng = DecodeEngine(rt, Decoder(cfg, rt), [4, 8])
        eng.capture()
        if not plan:
            refs = [eng.step(b).clone() for b in batches]
    return rt, eng, list(zip(batches, refs))


@pytest.fixture(autouse=True)
def healthy_device_after():
    yield
    sim.configure(faults="")


def test_a_slowed_kernel_gives_the_same_tokens_and_its_delay_is_all_the_devices_time():
    """``slow-kernel=NAME:MS``: each replayed execution of NAME takes MS longer, and the device
    (npusim.device_seconds) counts every bit of it: release/slowed.py's host-time figure (wall
    less the device's) rests on this.  A bound, not a timing: a sleep lasts at least its delay."""
    delay_ms = 20.0
    rt, eng, steps = _engine(f"slow-kernel={FIA}:{delay_ms}")
    device_before = sim.device_seconds()
    for batch, ref in steps:
        assert torch.equal(eng.step(batch), ref), "a slowed kernel computes what a fast one does"
    executions = sim.get_state().injected.slowed
    assert executions == 2 * len(steps), "each step replays the FIA of both layers"
    assert sim.device_seconds() - device_before >= executions * delay_ms / 1000


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_a_kernel_fault_in_a_replay_is_named_by_the_device_and_by_npugraph_and_the_next_step_is_right(
    adapter, sim_as_torch_npu
):
    rt, eng, steps = _engine(f"kernel={FIA}@2", adapter=adapter)  # the second FIA run: layer 1 of the first replay
    (b0, _), (b1, ref1) = steps[:2]
    rt.step(8, eng.metadata(b0.meta), inputs=_inputs(b0))
    # an engine synchronizes itself: the device's error names npugraph's graph, layer and op
    with pytest.raises(sim.ReplayFault) as raw:
        sim.npu.synchronize()
    text = str(raw.value)
    assert "[main/8]" in text and "[layer 'main.layers.1.attn']" in text and FIA in text, text
    assert "AI core exception" in text and "NPUGRAPH_SIM_FAULT" in text
    # the next step is right: the device cancelled only that replay
    assert torch.equal(eng.step(b1), ref1)


@pytest.mark.parametrize("order", ORDERS)
def test_npugraphs_synchronize_turns_the_kernel_fault_into_replay_failed_naming_the_layer(order):
    rt, eng, steps = _engine(f"kernel={FIA}@2", order)
    (b0, _), (b1, ref1) = steps[:2]
    with pytest.raises(ReplayFailed, match=r"replay of main/8 failed in layer 'main\.layers\.1\.attn' \(task 1, fia"):
        eng.step(b0)
    assert torch.equal(eng.step(b1), ref1)


@pytest.mark.no_serving_check("npugraph's Ascend adapter knows no hang error: on hardware the lost record is a timeout")
def test_with_the_simulator_as_torch_npu_a_lost_record_is_a_hang_the_device_names_by_npugraphs_names(sim_as_torch_npu):
    rt, eng, steps = _engine("lost-record@1", adapter="npu")
    assert rt.device.name == "npu" and rt.device.deadlock_errors == ()
    rt.step(8, eng.metadata(steps[0][0].meta), inputs=_inputs(steps[0][0]))
    with pytest.raises(sim.DeadlockError) as raw:
        sim.npu.synchronize()
    text = str(raw.value)
    assert "[main/8]" in text and "[main/8/main.layers.0.attn], which is never recorded" in text, text


@pytest.mark.parametrize("order", ORDERS)
def test_a_lost_event_record_is_a_hang_the_device_names_and_npugraph_recovers_from(order):
    rt, eng, steps = _engine("lost-record@1", order)  # the first step's first record never lands
    (b0, _), (b1, ref1), (b2, ref2) = steps[:3]
    rt.step(8, eng.metadata(b0.meta), inputs=_inputs(b0))
    with pytest.raises(sim.DeadlockError, match=r"main/8/main\.layers\.0\.attn") as raw:
        sim.npu.synchronize()
    assert "never recorded" in str(raw.value)
    # npugraph's synchronize drains what the lost record left waiting and says which graph
    with pytest.raises(GraphDeadlock, match=r"main/8"):
        rt.synchronize()
    assert torch.equal(eng.step(b1), ref1)
    assert torch.equal(eng.step(b2), ref2)


def test_a_bad_fault_setting_is_named():
    with pytest.raises(ValueError, match=r"NPUGRAPH_SIM_FAULT='kernel=@0': 'kernel=@0' needs a count >= 1"):
        sim.configure(faults="kernel=@0")
    for bad in ("slow-kernel=:5", f"slow-kernel={FIA}", f"slow-kernel={FIA}:-1", f"slow-kernel={FIA}:fast"):
        with pytest.raises(ValueError, match=r"needs 'slow-kernel=NAME:MS' with MS >= 0 milliseconds"):
            sim.configure(faults=bad)
    with pytest.raises(ValueError, match=r"'melt' is not a fault the simulator injects"):
        sim.configure(faults="melt")
    env = {**os.environ, "NPUGRAPH_SIM_FAULT": "lost-record@x"}
    code = "import npusim as sim; sim.npu.synchronize()"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode != 0 and "NPUGRAPH_SIM_FAULT='lost-record@x'" in done.stderr


def _inputs(b) -> dict:
    return {"input_ids": b.input_ids, "positions": b.positions, "slot_mapping": b.slot_mapping}


@pytest.mark.parametrize("order", ORDERS)
def test_a_lost_record_with_the_next_step_already_queued_behind_it_still_drains(order):
    # the next step's update is ordered after the stuck replay: what releases it must not be
    rt, eng, steps = _engine("lost-record@1", order)
    (b0, _), (b1, _), (b2, ref2), (b3, ref3) = steps[:4]
    rt.step(8, eng.metadata(b0.meta), inputs=_inputs(b0))
    rt.step(8, eng.metadata(b1.meta), inputs=_inputs(b1))
    with pytest.raises(GraphDeadlock, match=r"so the device drained"):
        rt.synchronize()
    assert torch.equal(eng.step(b2), ref2)
    assert torch.equal(eng.step(b3), ref3)
