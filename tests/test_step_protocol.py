"""The step protocol as a property: a bad step never stops serving.

A hypothesis state machine drives one runtime through random sequences of good steps,
bad steps of each kind, half steps (replay without update, update without replay),
device faults (an update the device rejects, a replay that faults), synchronizes and a
capture in the middle of serving — in both orders, through ``Runtime.step``, through
manual ``update``/``replay``, and through the vLLM wrapper.  The simulator's deadlock
and race detection is the oracle for hangs and lost records; every good step must
succeed and equal, bitwise, the same step on a runtime that only ever saw good steps,
and the float64 reference.
"""

from __future__ import annotations

import os

import attrs
import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import npusim as sim
from npugraph import AttentionMetadata
from npugraph.errors import GraphDeadlock, MetadataError, NotReplayableError, ReplayFailed, UpdateFailed
from npugraph.replay import StepPhase
from tests.helpers import BLOCKS, MAX_LEN, Harness, query_for

SIZES = [8, 4]  # FIA at 8, PA at 4 (the default policy): both kernels' tasks
LATE = 2  # captured in the middle of serving
LAYERS = 2
PATHS = ["step", "manual", "vllm"]
ORDERS = ["replay-first", "update-first"]
# the machine checks serving after every step itself, over many short-lived devices
pytestmark = pytest.mark.no_serving_check("the state machine checks every good step itself")


def _bad(kind: str, meta: AttentionMetadata, size: int) -> dict[str, AttentionMetadata] | str:
    """Metadata refused before any device call, one kind of mistake each."""
    r = meta.num_reqs
    if kind == "too long":
        return {"default": attrs.evolve(meta, seq_lens=torch.full((r,), MAX_LEN + 1, dtype=torch.int32))}
    if kind == "block id":
        table = meta.block_table.clone()
        table[0, 0] = BLOCKS + 3
        return {"default": attrs.evolve(meta, block_table=table)}
    if kind == "int64 table":
        return {"default": attrs.evolve(meta, block_table=meta.block_table.long())}
    if kind == "meta device":
        return {"default": attrs.evolve(meta, block_table=meta.block_table.to("meta"))}
    if kind == "too many requests":
        lens = torch.ones(size + 1, dtype=torch.int32)
        table = torch.zeros(size + 1, meta.block_table.shape[1], dtype=torch.int32)
        return {"default": AttentionMetadata(seq_lens=lens, block_table=table)}
    if kind == "missing layer":
        return {"layer0": meta}
    if kind == "2-D lengths":
        return {"default": attrs.evolve(meta, seq_lens=meta.seq_lens.view(1, -1))}
    if kind == "wrong type":
        return "not metadata"
    raise AssertionError(kind)


BAD_KINDS = [
    "too long",
    "block id",
    "int64 table",
    "meta device",
    "too many requests",
    "missing layer",
    "2-D lengths",
    "wrong type",
]


class System:
    """One runtime under test and the path its steps take."""

    def __init__(self, order: str, path: str, event_group: int = 1, device_lengths: bool = True) -> None:
        self.order, self.path = order, path
        # with event groups, 4 layers: groups [0, 1], [2], [3]
        self.layers = LAYERS if event_group == 1 else 4
        self.h = Harness(
            SIZES,
            layers=self.layers,
            order=order,
            capture=path != "vllm",
            event_group=event_group,
            device_lengths=device_lengths,
        )
        self.rt = self.h.rt
        self.captured = set() if path == "vllm" else set(SIZES)
        if path == "vllm":
            self._vllm_setup()
            for size in SIZES:
                self.capture(size)

    # --- the vLLM wrapper path ------------------------------------------------------
    def _vllm_setup(self) -> None:
        from vllm.config import CUDAGraphMode, VllmConfig
        from vllm.forward_context import get_forward_context

        from npugraph.integrations import vllm as integ

        vc = VllmConfig()
        vc.compilation_config.cudagraph_mode = CUDAGraphMode.FULL
        integ.attach_runtime(vc, self.rt)
        h = self.h

        def model(query: torch.Tensor) -> torch.Tensor:
            return h.forward(query, [{"default": get_forward_context().attn_metadata["layer0"]}])

        self.vllm_config = vc
        self.wrapper = integ.NpuGraphWrapper(model, vc, CUDAGraphMode.FULL, runtime=self.rt)

    def _vllm_call(self, size: int, metadata: object) -> torch.Tensor:
        from vllm.config import CUDAGraphMode
        from vllm.forward_context import BatchDescriptor, set_forward_context

        bd = BatchDescriptor(num_tokens=size)
        per_layer = metadata
        if isinstance(metadata, dict) and "default" in metadata:
            per_layer = {n: metadata["default"] for n in self.h.names}
        with set_forward_context(
            per_layer, self.vllm_config, num_tokens=size, cudagraph_runtime_mode=CUDAGraphMode.FULL, batch_descriptor=bd
        ):
            return self.wrapper(self.h.query[:, :size])

    def _key(self, size: int) -> object:
        if self.path != "vllm":
            return size
        from vllm.forward_context import BatchDescriptor

        return BatchDescriptor(num_tokens=size)

    # --- operations -----------------------------------------------------------------
    def capture(self, size: int) -> None:
        if self.path == "vllm":
            table = self.h.tables["default"][0, :size]
            dummy = AttentionMetadata(seq_lens=torch.ones(size, dtype=torch.int32), block_table=table)
            self._vllm_call(size, {"default": dummy})
        else:
            self.h.capture([size])
        self.captured.add(size)

    def step(self, size: int, metadata: object, q: torch.Tensor) -> torch.Tensor:
        """One whole step (inputs, update and replay in the runtime's order); ``q`` [1, size, N, D]."""
        key = self._key(size)
        if self.path == "step":
            return self.rt.step(key, metadata, inputs={"query": q})  # type: ignore[arg-type]
        # as engines do (vLLM's pinned CpuGpuBuffer): a blocking copy, or one from pageable
        # memory, would wait for the stream, and hang behind a replay that waits for its update
        self.h.query[:, :size].copy_(self.rt.device.staged(q), non_blocking=True)
        if self.path == "vllm":
            return self._vllm_call(size, metadata)
        if self.order == "replay-first":
            self.rt.replay(key)
            self.rt.update(key, metadata)  # type: ignore[arg-type]
        else:
            self.rt.update(key, metadata)  # type: ignore[arg-type]
            self.rt.replay(key)
        return self.rt.entry(key).outputs

    def update_only(self, size: int, metadata: object) -> None:
        self.rt.update(self._key(size), metadata)  # type: ignore[arg-type]

    def replay_only(self, size: int) -> None:
        self.rt.replay(self._key(size))


class StepProtocol(RuleBasedStateMachine):
    order = "replay-first"
    path = "step"
    event_group = 1
    device_lengths = True  # FIA graphs take the tiling-sink path (the default)

    @initialize(adversarial=st.sampled_from([None, 3, 8]))
    def setup(self, adversarial):
        sim.configure(adversarial_seed=adversarial)
        self.sys = System(self.order, self.path, self.event_group, self.device_lengths)
        # a runtime that only ever sees good steps: the "fresh runtime" every good step must equal
        self.fresh = Harness(
            [*SIZES, LATE], layers=self.sys.layers, order=self.order, device_lengths=self.device_lengths
        )
        self.goods = 0

    def _meta(self, size: int, nreq: int, seed: int) -> AttentionMetadata:
        self.sys.h.rng.seed(seed)
        return self.sys.h.random_meta(nreq)

    sizes = st.sampled_from([*SIZES, LATE])

    @rule(size=sizes, data=st.data(), seed=st.integers(0, 1 << 20), per_layer=st.booleans())
    def good_step(self, size, data, seed, per_layer):
        if size not in self.sys.captured:
            return
        nreq = data.draw(st.integers(0, size), label="requests")
        meta = self._meta(size, nreq, seed)
        metadata = dict.fromkeys(self.sys.h.names, meta) if per_layer else {"default": meta}
        q = query_for(self.sys.h, size, seed)
        self.sys.step(size, metadata, q)
        self.sys.rt.synchronize()
        out = self.sys.rt.entry(self.sys._key(size)).outputs.clone()
        ref = self.fresh.step(size, {"default": meta}, q).clone()
        assert torch.equal(out, ref), f"good step {self.goods} (size {size}) differs from a fresh runtime's"
        self.sys.h.check(out, q, dict.fromkeys(self.sys.h.names, meta))
        self.goods += 1

    @rule(size=sizes, kind=st.sampled_from(BAD_KINDS), seed=st.integers(0, 1 << 20))
    def bad_step(self, size, kind, seed):
        if size not in self.sys.captured:
            return
        meta = self._meta(size, max(1, size // 2), seed)
        with pytest.raises(MetadataError):
            self.sys.step(size, _bad(kind, meta, size), query_for(self.sys.h, size, seed))

    @rule(size=sizes, seed=st.integers(0, 1 << 20))
    def device_rejects_the_update(self, size, seed):
        """Unvalidated lengths the kernel refuses at the update, at the second layer."""
        if size not in self.sys.captured:
            return
        good = self._meta(size, max(1, size // 2), seed)
        bad = attrs.evolve(good, seq_lens=torch.full((good.num_reqs,), 10**6, dtype=torch.int32))
        if self.sys.rt.entry(self.sys._key(size)).lens_groups:
            self._sink_kernel_rejects(size, bad, seed)
            return
        self.sys.rt.updater.validate = False
        try:
            with pytest.raises(UpdateFailed, match="layer 'layer1'"):
                metadata = {n: (bad if n == "layer1" else good) for n in self.sys.h.names}
                self.sys.step(size, metadata, query_for(self.sys.h, size, seed))
        finally:
            self.sys.rt.updater.validate = True

    def _sink_kernel_rejects(self, size, bad, seed):
        """A tiling-sink graph has no update for the device to reject: the unvalidated
        lengths go to device memory, and its kernel refuses them inside the replay."""
        self.sys.rt.updater.validate = False
        try:
            self.sys.step(size, {"default": bad}, query_for(self.sys.h, size, seed))
        finally:
            self.sys.rt.updater.validate = True
        with pytest.raises(ReplayFailed, match=r"replay of main/.*actual_seq_lengths_kv"):
            self.sys.rt.synchronize()

    @rule(size=sizes, seed=st.integers(0, 1 << 20))
    def replay_faults(self, size, seed):
        """An unvalidated block id the kernel meets inside the replay: reported at synchronize."""
        if size not in self.sys.captured:
            return
        good = self._meta(size, max(1, size // 2), seed)
        table = good.block_table.clone()
        table[0, 0] = 10_000
        self.sys.rt.updater.validate = False
        try:
            self.sys.step(size, {"default": attrs.evolve(good, block_table=table)}, query_for(self.sys.h, size, seed))
        finally:
            self.sys.rt.updater.validate = True
        with pytest.raises(ReplayFailed, match=r"replay of main/.*block id 10000"):
            self.sys.rt.synchronize()  # reported even where another graph's replay waited too

    @rule(size=sizes)
    def replay_without_update(self, size):
        if size not in self.sys.captured:
            return
        try:
            self.sys.replay_only(size)
        except NotReplayableError:
            assert self.order == "update-first", "replay-first order always lets a replay wait for its update"

    @rule(size=sizes, seed=st.integers(0, 1 << 20))
    def update_without_replay(self, size, seed):
        if size not in self.sys.captured:
            return
        self.sys.update_only(size, {"default": self._meta(size, max(1, size // 2), seed)})

    @rule()
    def synchronize(self):
        waiting = self.sys.rt.updater.waiting()
        try:
            self.sys.rt.synchronize()
        except GraphDeadlock:
            assert waiting, "a hang only where a replay waits for an update that never came"
        else:
            assert not waiting
        assert not self.sys.rt.updater.waiting(), "a synchronize leaves nothing waiting"

    @precondition(lambda self: LATE not in self.sys.captured)
    @rule()
    def capture_mid_serving(self):
        waiting = self.sys.rt.updater.waiting()
        try:
            self.sys.capture(LATE)
        except GraphDeadlock:
            assert waiting, "capture synchronizes: only a replay left waiting stops it"

    @invariant()
    def nothing_half_registered(self):
        keys = {k if isinstance(k, int) else k.num_tokens for k in self.sys.rt.manager.keys()}  # noqa: SIM118
        assert keys == self.sys.captured

    @invariant()
    def broken_only_after_a_failure(self):
        for e in self.sys.rt.entries():
            assert self.sys.rt.updater.state(e).phase in StepPhase


def _machine(order: str, path: str, event_group: int = 1, device_lengths: bool = True) -> type[StepProtocol]:
    name = f"StepProtocol_{order}_{path}_g{event_group}" + ("" if device_lengths else "_per_layer")
    attrs_ = {"order": order, "path": path, "event_group": event_group, "device_lengths": device_lengths}
    return type(name, (StepProtocol,), attrs_)


_SETTINGS = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.filter_too_much],
    # NPUGRAPH_NO_SHRINK=1 reports the first failing sequence as found (shrinking it is slow)
    "phases": [p for p in Phase if p is not Phase.shrink or not os.environ.get("NPUGRAPH_NO_SHRINK")],
}


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.vllm) if p == "vllm" else p for p in PATHS])
def test_a_bad_step_never_stops_serving(order, path):
    if path == "vllm" and not os.environ.get("NPUGRAPH_REQUIRE_VLLM"):
        pytest.importorskip("vllm")
    machine = _machine(order, path)
    machine.TestCase.settings = settings(max_examples=15, stateful_step_count=14, **_SETTINGS)
    machine.TestCase().runTest()


@pytest.mark.parametrize("order", ORDERS)
def test_a_bad_step_never_stops_serving_with_fia_updated_per_layer(order):
    """FIA with host lengths (a device without the tiling-sink kernel): updated per layer."""
    machine = _machine(order, "manual" if order == "update-first" else "step", device_lengths=False)
    machine.TestCase.settings = settings(max_examples=10, stateful_step_count=14, **_SETTINGS)
    machine.TestCase().runTest()


@pytest.mark.parametrize("order", ORDERS)
def test_a_bad_step_never_stops_serving_with_event_groups(order):
    machine = _machine(order, "manual" if order == "update-first" else "step", event_group=2)
    machine.TestCase.settings = settings(max_examples=10, stateful_step_count=14, **_SETTINGS)
    machine.TestCase().runTest()


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("NPUGRAPH_LONG"), reason="the long run: make test-long (about 10 minutes)")
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("path", ["step", "manual"])
@pytest.mark.parametrize("event_group", [1, 2])
def test_a_bad_step_never_stops_serving_long(order, path, event_group):
    machine = _machine(order, path, event_group)
    machine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, **_SETTINGS)
    machine.TestCase().runTest()
