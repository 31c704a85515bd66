"""Bad input names itself, before any device call, and leaves the runtime usable.

Every case goes through the public API (runtime, metadata, policy and manifest files)
and asserts the error type, that the message names the culprit, and that a valid step
afterwards equals, bitwise, the same step run before the bad input.  The CLI's cases
are in ``test_bad_cli.py``.
"""

from __future__ import annotations

import json
import os
import stat

import attrs
import pytest
import torch

import npusim as sim
from npugraph import AttentionMetadata, DecodeAttention, Runtime
from npugraph.dump.manifest import ManifestError, load_manifest, save_manifest
from npugraph.dump.postmortem import MAX_POSTMORTEMS
from npugraph.errors import (
    CaptureFailed,
    ConfigError,
    DeviceUnavailable,
    GraphDeadlock,
    MetadataError,
    NotReplayableError,
    PolicyError,
    UnknownKeyError,
    UpdateFailed,
)
from npugraph.files import FileError
from npugraph.models import Decoder, DecoderConfig, Workload
from npugraph.models.engine import DecodeEngine
from npugraph.policy import KernelChoice, MeasuredPolicy, PolicySignature, load_policy
from npugraph.replay import StepPhase


@pytest.fixture(autouse=True)
def fresh_device():
    """One simulated device for the whole module: a bad input must not break it for the next."""
    yield


@attrs.define
class World:
    cfg: DecoderConfig
    rt: Runtime
    model: Decoder
    eng: DecodeEngine
    steps: dict[int, object]  # size -> a valid step
    refs: dict[int, torch.Tensor]  # size -> its output before any bad input

    def meta(self, size: int, **changes: object) -> AttentionMetadata:
        return attrs.evolve(self.steps[size].meta, **changes)  # type: ignore[attr-defined]

    def still_usable(self) -> None:
        for size, b in self.steps.items():
            got = self.eng.step(b)
            assert torch.equal(got, self.refs[size]), f"size {size} differs after the bad input"


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    sim.configure()
    cfg = DecoderConfig(layers=2, num_blocks=64, max_model_len=128)
    rt = Runtime("sim", max_model_len=cfg.max_model_len, postmortem_dir=str(tmp_path_factory.mktemp("pm")))
    model = Decoder(cfg, rt)
    eng = DecodeEngine(rt, model, [4, 8])
    eng.capture()
    steps: dict[int, object] = {}
    for b in Workload(cfg, [4, 8], seed=11, max_batch=8).steps(40):
        if b.size not in steps and b.num_reqs >= 2:
            steps[b.size] = b
    refs = {size: eng.step(b).clone() for size, b in steps.items()}
    assert set(refs) == {4, 8} and rt.manager.entry("main", 4).choice.kernel == "pa"
    return World(cfg=cfg, rt=rt, model=model, eng=eng, steps=steps, refs=refs)


def _i32(*v: int) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.int32)


def _n(w: World, size: int) -> int:
    return w.steps[size].num_reqs  # type: ignore[attr-defined]


# (id, error type, regex the message must match, the bad call)
METADATA_CASES = [
    (
        "seq_lens float",
        MetadataError,
        r"layer 'main\.layers\.0\.attn'.*seq_lens must be an int32 tensor, got torch\.float32",
        lambda w: w.rt.update(8, {"default": w.meta(8, seq_lens=w.steps[8].meta.seq_lens.float())}),
    ),
    (
        "seq_lens bool",
        MetadataError,
        r"seq_lens must be an int32 tensor, got torch\.bool",
        lambda w: w.rt.update(8, {"default": w.meta(8, seq_lens=w.steps[8].meta.seq_lens.bool())}),
    ),
    (
        "seq_lens 2-D",
        MetadataError,
        r"seq_lens must be 1-D, got shape \[1, ",
        lambda w: w.rt.update(8, {"default": w.meta(8, seq_lens=w.steps[8].meta.seq_lens[None])}),
    ),
    (
        "seq_lens 0-d",
        MetadataError,
        r"seq_lens must be 1-D, got shape \[\]",
        lambda w: w.rt.update(8, {"default": w.meta(8, seq_lens=_i32(3)[0])}),
    ),
    (
        "seq_lens on meta",
        MetadataError,
        r"seq_lens must be on the host \(CPU\), got a tensor on meta",
        lambda w: w.rt.update(8, {"default": w.meta(8, seq_lens=w.steps[8].meta.seq_lens.to("meta"))}),
    ),
    (
        "seq_lens list",
        MetadataError,
        r"seq_lens must be a CPU int32 tensor, got list",
        lambda w: w.rt.update(8, {"default": w.meta(8, seq_lens=[3, 4])}),
    ),
    (
        "metadata value dict",
        MetadataError,
        r"metadata must be an npugraph\.AttentionMetadata, got dict",
        lambda w: w.rt.update(8, {"default": {"seq_lens": _i32(3)}}),
    ),
    (
        "AttentionMetadata for the mapping",
        MetadataError,
        r"main/8: step metadata must map .* got AttentionMetadata",
        lambda w: w.rt.update(8, w.steps[8].meta),
    ),
    ("metadata a string", MetadataError, r"step metadata must map .* got str", lambda w: w.rt.update(8, "default")),
    (
        "metadata None value",
        MetadataError,
        r"no entry for layer 'main\.layers\.0\.attn' nor for its KV-cache group 'default'",
        lambda w: w.rt.update(8, {"default": None}),
    ),
    (
        "missing group",
        MetadataError,
        r"no entry for layer 'main\.layers\.0\.attn'.*\['decode'\]",
        lambda w: w.rt.update(8, {"decode": w.steps[8].meta}),
    ),
    (
        "one layer missing",
        MetadataError,
        r"no entry for layer 'main\.layers\.1\.attn'",
        lambda w: w.rt.update(8, {"main.layers.0.attn": w.steps[8].meta}),
    ),
    (
        "empty micro-batch list",
        MetadataError,
        r"main/8: the graph has 1 micro-batches but the step's metadata lists 0",
        lambda w: w.rt.update(8, []),
    ),
    (
        "micro-batch not a mapping",
        MetadataError,
        r"micro-batch 0 of the step's metadata is a AttentionMetadata",
        lambda w: w.rt.update(8, [w.steps[8].meta]),
    ),
    (
        "query_start_loc decreasing",
        MetadataError,
        r"query_start_loc must be non-decreasing, got \[0, 2, 1",
        lambda w: w.rt.update(8, {"default": w.meta(8, query_start_loc=_i32(0, 2, 1, *range(3, _n(w, 8) + 1)))}),
    ),
    (
        "query_start_loc length",
        MetadataError,
        r"query_start_loc must have R\+1=\d+ entries starting at 0",
        lambda w: w.rt.update(8, {"default": w.meta(8, query_start_loc=_i32(0, 1))}),
    ),
    (
        "query_start_loc start",
        MetadataError,
        r"query_start_loc must have R\+1=\d+ entries starting at 0, got \[1,",
        lambda w: w.rt.update(8, {"default": w.meta(8, query_start_loc=_i32(*range(1, _n(w, 8) + 2)))}),
    ),
    (
        "query_start_loc float",
        MetadataError,
        r"query_start_loc must be an int32 tensor, got torch\.float32",
        lambda w: w.rt.update(8, {"default": w.meta(8, query_start_loc=torch.arange(_n(w, 8) + 1).float())}),
    ),
    (
        "more query tokens than keys",
        MetadataError,
        r"request 0 has 2 query tokens but seq_lens\[0\] = 1",
        lambda w: w.rt.update(
            8,
            {
                "default": AttentionMetadata(
                    seq_lens=_i32(1, 5), block_table=w.steps[8].meta.block_table[:2], query_start_loc=_i32(0, 2, 3)
                )
            },
        ),
    ),
    (
        "too many requests",
        MetadataError,
        r"main/4 layer 'main\.layers\.0\.attn': 8 requests do not fit the captured batch of 4",
        lambda w: w.rt.update(
            4,
            {
                "default": AttentionMetadata(
                    seq_lens=torch.ones(8, dtype=torch.int32), block_table=torch.ones(8, 8, dtype=torch.int32)
                )
            },
        ),
    ),
    (
        "too many query tokens",
        MetadataError,
        r"9 query tokens do not fit the captured 8",
        lambda w: w.rt.update(
            8,
            {
                "default": AttentionMetadata(
                    seq_lens=_i32(20, 20),
                    block_table=torch.ones(2, 8, dtype=torch.int32),
                    query_start_loc=_i32(0, 4, 9),
                )
            },
        ),
    ),
    (
        "spare tokens with every row real",
        MetadataError,
        r"all 4 captured request rows are real but the step has 3 of 4 query tokens",
        lambda w: w.rt.update(
            4,
            {
                "default": AttentionMetadata(
                    seq_lens=_i32(5, 5, 5, 5),
                    block_table=torch.ones(4, 8, dtype=torch.int32),
                    query_start_loc=_i32(0, 1, 2, 3, 3),
                )
            },
        ),
    ),
    (
        "a decode request of length 0 before a real one",
        MetadataError,
        r"request 0 has 1 query token\(s\) but seq_lens\[0\] = 0; the key length counts this step's tokens too",
        lambda w: w.rt.update(
            8, {"default": AttentionMetadata(seq_lens=_i32(0, 5), block_table=torch.ones(2, 8, dtype=torch.int32))}
        ),
    ),
    (
        "negative length",
        MetadataError,
        r"seq_lens has a negative entry \(-3\)",
        lambda w: w.rt.update(
            8, {"default": AttentionMetadata(seq_lens=_i32(4, -3), block_table=torch.ones(2, 8, dtype=torch.int32))}
        ),
    ),
    (
        "length over max_model_len",
        MetadataError,
        r"seq_lens\[1\] = 129 exceeds max_model_len=128",
        lambda w: w.rt.update(
            8, {"default": AttentionMetadata(seq_lens=_i32(4, 129), block_table=torch.ones(2, 8, dtype=torch.int32))}
        ),
    ),
    (
        "length past the table",
        MetadataError,
        r"seq_lens\[0\] = 40 needs more than the 2 blocks of 16 tokens",
        lambda w: w.rt.update(
            8, {"default": AttentionMetadata(seq_lens=_i32(40), block_table=torch.ones(1, 2, dtype=torch.int32))}
        ),
    ),
    (
        "block id past the cache",
        MetadataError,
        r"block_table\[1, 0\] = 9999 is not a block id of the KV cache \(0 <= id < 64\)",
        lambda w: w.rt.update(
            8,
            {
                "default": AttentionMetadata(
                    seq_lens=_i32(3, 3), block_table=torch.tensor([[1, 0], [9999, 0]], dtype=torch.int32)
                )
            },
        ),
    ),
    (
        "negative block id",
        MetadataError,
        r"block_table\[0, 1\] = -1 is not a block id",
        lambda w: w.rt.update(
            8, {"default": AttentionMetadata(seq_lens=_i32(20), block_table=torch.tensor([[1, -1]], dtype=torch.int32))}
        ),
    ),
    (
        "block table int64",
        MetadataError,
        r"block_table must be int32, got torch\.int64",
        lambda w: w.rt.update(8, {"default": w.meta(8, block_table=w.steps[8].meta.block_table.long())}),
    ),
    (
        "block table 1-D",
        MetadataError,
        r"block_table must be an int32 tensor \[R=\d+, cols\], got \[",
        lambda w: w.rt.update(8, {"default": w.meta(8, block_table=w.steps[8].meta.block_table[0])}),
    ),
    (
        "block table short",
        MetadataError,
        r"block_table must be an int32 tensor \[R=\d+, cols\], got \[1,",
        lambda w: w.rt.update(8, {"default": w.meta(8, block_table=w.steps[8].meta.block_table[:1])}),
    ),
    (
        "block table a list",
        MetadataError,
        r"block_table must be an int32 tensor .* got list",
        lambda w: w.rt.update(8, {"default": w.meta(8, block_table=[[1, 2]])}),
    ),
    (
        "layers with other tables on one buffer",
        MetadataError,
        r"layer 'main\.layers\.1\.attn': its metadata has another block table than layer 'main\.layers\.0\.attn'",
        lambda w: w.rt.update(
            8,
            {
                "main.layers.0.attn": w.steps[8].meta,
                "main.layers.1.attn": w.meta(8, block_table=w.steps[8].meta.block_table.flip(0).contiguous()),
            },
        ),
    ),
    (
        "input wider than captured",
        MetadataError,
        r"main/8: input 'input_ids' has shape \[8, 2\]; the captured buffer is \[8\]",
        lambda w: w.rt.step(
            8, {"default": w.steps[8].meta}, inputs={"input_ids": torch.zeros(8, 2, dtype=torch.int64)}
        ),
    ),
    (
        "0-d input",
        MetadataError,
        r"input 'positions' must be a tensor of rows, got a 0-d tensor",
        lambda w: w.rt.step(8, {"default": w.steps[8].meta}, inputs={"positions": torch.tensor(3)}),
    ),
    (
        "input a list",
        MetadataError,
        r"input 'positions' must be a tensor of rows, got list",
        lambda w: w.rt.step(8, {"default": w.steps[8].meta}, inputs={"positions": [1, 2]}),
    ),
    (
        "unknown input",
        MetadataError,
        r"no static input named 'ids' was registered at capture \(have \['input_ids'",
        lambda w: w.rt.step(8, {"default": w.steps[8].meta}, inputs={"ids": torch.zeros(8, dtype=torch.int64)}),
    ),
    (
        "input too long",
        MetadataError,
        r"input 'slot_mapping' has 9 rows, the captured buffer 8",
        lambda w: w.rt.step(
            8, {"default": w.steps[8].meta}, inputs={"slot_mapping": torch.zeros(9, dtype=torch.int64)}
        ),
    ),
    (
        "unknown key",
        UnknownKeyError,
        r"no graph captured for key 5 in namespace 'main'; captured keys: \[4, 8\]",
        lambda w: w.rt.update(5, {"default": w.steps[8].meta}),
    ),
    (
        "unhashable key",
        UnknownKeyError,
        r"no graph captured for key \[8\]",
        lambda w: w.rt.step([8], {"default": w.steps[8].meta}),
    ),
    ("unknown namespace", UnknownKeyError, r"key 8 in namespace 'draft'", lambda w: w.rt.replay(8, namespace="draft")),
]

RUNTIME_CASES = [
    (
        "max_model_len a string",
        ConfigError,
        r"max_model_len must be an int >= 1, got '512'",
        lambda w: Runtime("sim", max_model_len="512"),
    ),
    (
        "max_model_len zero",
        ConfigError,
        r"max_model_len must be an int >= 1, got 0",
        lambda w: Runtime("sim", max_model_len=0),
    ),
    ("max_model_len a bool", ConfigError, r"got True", lambda w: Runtime("sim", max_model_len=True)),
    (
        "unknown order",
        ConfigError,
        r"order must be 'replay-first' or 'update-first', got 'sideways'",
        lambda w: Runtime("sim", max_model_len=8, order="sideways"),
    ),
    (
        "unknown device",
        DeviceUnavailable,
        r"unknown device 'gpu': expected 'sim' \(the built-in simulator\), 'npu' \(the current Ascend NPU\) or 'npu:N'",
        lambda w: Runtime("gpu", max_model_len=8),
    ),
    (
        "a second simulated device",
        DeviceUnavailable,
        r"device 'sim:1': the simulator has one device, 'sim' \(or 'sim:0'\)",
        lambda w: Runtime("sim:1", max_model_len=8),
    ),
    (
        "a device index that is no number",
        DeviceUnavailable,
        r"device 'npu:x': the index after ':' must be a number, e.g. 'npu:0'",
        lambda w: Runtime("npu:x", max_model_len=8),
    ),
    (
        "npu:0 without torch_npu",
        DeviceUnavailable,
        r"device='npu' needs torch_npu and the CANN toolkit",
        lambda w: Runtime("npu:0", max_model_len=8),
    ),
    (
        "npu without torch_npu",
        DeviceUnavailable,
        r"device='npu' needs torch_npu and the CANN toolkit",
        lambda w: Runtime("npu", max_model_len=8),
    ),
    (
        "capture a captured key",
        CaptureFailed,
        r"main/8 is already captured; call Runtime\.reset\('main', 8\)",
        lambda w: w.rt.capture(lambda: None, key=8),
    ),
    (
        "unhashable capture key",
        CaptureFailed,
        r"graph key \[1\] is not hashable",
        lambda w: w.rt.capture(lambda: None, key=[1]),
    ),
    (
        "key without tokens",
        CaptureFailed,
        r"capture of main/'x': the key is not a token count; pass tokens=",
        lambda w: w.rt.capture(lambda: None, key="x"),
    ),
    (
        "callable raises",
        CaptureFailed,
        r"capture of main/'boom' failed at .*test_bad_inputs\.py:\d+ in _boom: RuntimeError: boom\. Nothing was registered",
        lambda w: w.rt.capture(_boom, key="boom", tokens=2),
    ),
    (
        "no attention",
        CaptureFailed,
        r"capture of main/'plain': the callable made no attention call",
        lambda w: w.rt.capture(lambda: torch.ones(2, device="cpu") * 2, key="plain", tokens=2),
    ),
    (
        "a layer called twice",
        CaptureFailed,
        r"layer 'twice' was called twice in micro-batch 0 of one forward",
        lambda w: w.rt.capture(_twice(w), key="twice", tokens=2),
    ),
    (
        "policy of another device",
        PolicyError,
        r"kernel policy was measured on device 'npu', this runtime runs on 'sim'",
        lambda w: w.rt.set_policy(_policy_on("npu")),
    ),
    (
        "policy of another model",
        CaptureFailed,
        r"kernel policy file does not match this model: heads: file has 32",
        lambda w: w.rt.capture(_twice(w, policy=_policy_on("sim", heads=32)), key="pol", tokens=2),
    ),
]


def _boom() -> None:
    raise RuntimeError("boom")


def _twice(w: World, policy=None):
    layer = w.model.layers[0]
    attn = DecodeAttention(w.rt, "twice", num_heads=w.cfg.heads, num_kv_heads=w.cfg.kv_heads, head_size=w.cfg.head_size)
    dev = w.rt.device.memory
    q = torch.zeros(2, w.cfg.heads, w.cfg.head_size, dtype=w.cfg.dtype, device=dev)
    meta = AttentionMetadata(seq_lens=_i32(1, 1), block_table=torch.zeros(2, 8, dtype=torch.int32, device=dev))

    def fn():
        old = w.rt.manager.policy
        if policy is not None:
            w.rt.manager.policy = policy
        try:
            attn(q, layer.k_cache, layer.v_cache, meta)
            attn(q, layer.k_cache, layer.v_cache, meta)
        finally:
            w.rt.manager.policy = old

    return fn


def _policy_on(device: str, heads: int = 4) -> MeasuredPolicy:
    sig = PolicySignature(heads=heads, kv_heads=2, head_size=64, dtype="bfloat16", block_size=16, device=device)
    return MeasuredPolicy(
        signature=sig, choices={2: KernelChoice(kernel="fia", reason="test")}, measurements={}, margin=0.05
    )


@pytest.mark.parametrize(
    ("exc", "match", "call"),
    [c[1:] for c in METADATA_CASES + RUNTIME_CASES],
    ids=[c[0] for c in METADATA_CASES + RUNTIME_CASES],
)
def test_bad_input_names_itself_and_the_runtime_stays_usable(world, exc, match, call):
    with pytest.raises(exc, match=match):
        call(world)
    world.rt.synchronize()
    world.still_usable()
    assert world.rt.manager.keys() == [8, 4], "nothing half-registered"


def test_a_second_replay_before_the_update_releases_the_first(world):
    world.rt.replay(8)  # replay-first: it waits on the device for the update that follows
    world.rt.replay(8)  # the first is abandoned: it runs empty, this one waits
    assert world.rt.graph_state(8).phase is StepPhase.REPLAY_QUEUED
    world.rt.update(8, {"default": world.steps[8].meta})  # the update the second replay waits for
    world.rt.synchronize()
    world.still_usable()


def test_a_graph_that_would_hang_recovers_with_a_complete_update(world):
    world.rt.replay(8)  # replay-first order, but the update never comes
    with pytest.raises(
        GraphDeadlock, match=r"the replay of main/8 \(first layer 'main\.layers\.0\.attn'\) waited on the device"
    ):
        world.rt.synchronize()
    world.rt.update(8, {"default": world.steps[8].meta})  # the complete update the replay waits for
    world.rt.synchronize()
    world.still_usable()


def _another_runtime(world: World, **kwargs: object) -> tuple[Runtime, DecodeEngine]:
    rt = Runtime("sim", max_model_len=world.cfg.max_model_len, **kwargs)
    eng = DecodeEngine(rt, Decoder(world.cfg, rt), [8])
    eng.capture()
    return rt, eng


@pytest.mark.parametrize("order", ["update-first", "replay-first"])
def test_half_way_update_failure_names_the_layer_and_a_full_update_recovers(world, order):
    # FIA updated per layer (a device without the tiling-sink kernel): the device refuses layer 1's update
    rt, eng = _another_runtime(world, validate=False, order=order, device_lengths=False)
    b = world.steps[8]
    ref = eng.step(b).clone()
    bad = AttentionMetadata(seq_lens=torch.full((b.num_reqs,), 9999, dtype=torch.int32), block_table=b.meta.block_table)
    with pytest.raises(
        UpdateFailed, match=r"failed at layer 'main\.layers\.1\.attn' \(task 1\): ValueError: .*actual_seq_lengths_kv"
    ):
        rt.update(8, {"main.layers.0.attn": b.meta, "main.layers.1.attn": bad})
    assert rt.graph_state(8).phase is StepPhase.BROKEN
    if order == "update-first":
        with pytest.raises(NotReplayableError, match=r"main/8 is not replayable: its last update or replay failed"):
            rt.replay(8)
    assert torch.equal(eng.step(b), ref)
    world.still_usable()


def test_bad_block_id_in_a_device_table_is_reported_at_synchronize(world):
    # as for tables on the NPU; update-first, so that the next step's update replaces the bad one
    rt, eng = _another_runtime(world, defer_block_check=True, order="update-first")
    b = world.steps[8]
    ref = eng.step(b).clone()
    table = b.meta.block_table.clone()
    table[1, 0] = 4096
    rt.update(8, {"default": attrs.evolve(b.meta, block_table=table)})  # no host read of the table here
    with pytest.raises(
        MetadataError,
        match=r"step \d+ of main/8 layer 'main\.layers\.0\.attn': a block id in use in its device-resident block table",
    ):
        rt.synchronize()
    rt.synchronize()  # reported once
    assert torch.equal(eng.step(b), ref)
    world.still_usable()


# --- files ----------------------------------------------------------------------------------


def _write(path, doc) -> str:
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(path)


def _good_policy(tmp_path) -> dict:
    p = _policy_on("sim")
    p.save(str(tmp_path / "good.json"))
    return json.loads((tmp_path / "good.json").read_text())


POLICY_FILES = [
    ("missing", None, r"cannot read kernel policy .*No such file"),
    ("not JSON", "{nope", r"is not valid JSON"),
    ("a list", [1, 2], r"the document is a JSON list, not an object"),
    ("other schema", {"schema": "x"}, r"schema is 'x', expected 'npugraph-policy/1'"),
    ("no signature", lambda d: d.pop("signature"), r"'signature' must be an object"),
    ("heads a string", lambda d: d["signature"].update(heads="4"), r"signature\.heads must be an integer, got '4'"),
    ("no margin", lambda d: d.pop("margin"), r"'margin' must be a number, got None"),
    (
        "unknown kernel",
        lambda d: d["sizes"]["2"].update(kernel="gpu"),
        r"sizes\[2\]\.kernel is 'gpu'; expected 'pa' or 'fia'",
    ),
    ("bad size", lambda d: d["sizes"].update({"two": d["sizes"]["2"]}), r"size 'two' is not a positive token count"),
    (
        "timings not numbers",
        lambda d: d["sizes"]["2"].update(pa_us=["x"]),
        r"sizes\[2\]\.pa_us / fia_us must be lists of numbers",
    ),
    ("deeply nested", "[" * 200000 + "]" * 200000, r"nested too deeply"),
]


@pytest.mark.parametrize(("doc", "match"), [c[1:] for c in POLICY_FILES], ids=[c[0] for c in POLICY_FILES])
def test_a_bad_policy_file_is_a_policy_error(world, tmp_path, doc, match):
    path = tmp_path / "p.json"
    if callable(doc):
        d = _good_policy(tmp_path)
        doc(d)
        doc = d
    if doc is not None:
        _write(path, doc)
    with pytest.raises(PolicyError, match=match):
        load_policy(str(path))
    world.still_usable()


def test_an_endless_or_huge_policy_file_is_refused(world, tmp_path):
    with pytest.raises(PolicyError, match=r"/dev/zero': it is not a regular file"):
        load_policy("/dev/zero")
    huge = tmp_path / "huge.json"
    with open(huge, "wb") as f:
        f.truncate(65 * 2**20)  # sparse: cheap to make, larger than the cap
    with pytest.raises(PolicyError, match=r"huge.json' is larger than \d+ bytes"):
        load_policy(str(huge))
    world.still_usable()


def test_a_policy_behind_a_symlink_is_not_read(world, tmp_path):
    real = _write(tmp_path / "real.json", _good_policy(tmp_path))
    link = tmp_path / "link.json"
    link.symlink_to(real)
    with pytest.raises(PolicyError, match=r"cannot read kernel policy .*link\.json"):
        load_policy(str(link))
    world.still_usable()


MANIFESTS = [
    ("only a version", {"schema_version": 1}, r"not a capture manifest: 'device' is missing or not a str"),
    (
        "newer version",
        {"schema_version": 7},
        r"written by a newer npugraph \(schema_version 7; this one reads 1\); upgrade",
    ),
    ("other version", {"schema_version": "1"}, r"schema_version is .1., expected 1"),
    ("a list", [], r"the document is a JSON list"),
    (
        "key without fields",
        {
            "schema_version": 1,
            "device": "sim",
            "max_model_len": 8,
            "totals": {},
            "namespaces": {"main": {"keys": [{"key": "1"}]}},
        },
        r"namespaces\['main'\]\.keys\[0\]\.tokens is missing or not a int",
    ),
    (
        "namespace without keys",
        {"schema_version": 1, "device": "sim", "max_model_len": 8, "totals": {}, "namespaces": {"main": 3}},
        r"namespaces\['main'\] has no list of 'keys'",
    ),
]


@pytest.mark.parametrize(("doc", "match"), [c[1:] for c in MANIFESTS], ids=[c[0] for c in MANIFESTS])
def test_a_bad_manifest_is_a_manifest_error(world, tmp_path, doc, match):
    with pytest.raises(ManifestError, match=match):
        load_manifest(_write(tmp_path / "m.json", doc))
    world.still_usable()


def test_writing_a_manifest_never_follows_a_symlink(world, tmp_path):
    target = tmp_path / "victim.txt"
    target.write_text("keep me")
    link = tmp_path / "m.json"
    link.symlink_to(target)
    with pytest.raises(FileError, match=r"m\.json: cannot write"):
        save_manifest(world.rt.manifest(), str(link))
    assert target.read_text() == "keep me"
    world.still_usable()


def _negative(rt: Runtime) -> None:
    rt.update(8, {"default": AttentionMetadata(seq_lens=_i32(-1), block_table=torch.ones(1, 8, dtype=torch.int32))})


def test_a_planted_postmortem_symlink_is_not_followed_and_the_error_stays(world, tmp_path):
    folder = tmp_path / "pm"
    rt, eng = _another_runtime(world, postmortem_dir=str(folder))
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    folder.mkdir(mode=0o700)
    os.symlink(victim, folder / f"npugraph-postmortem-{os.getpid()}-1.json")
    with pytest.raises(
        MetadataError, match=r"seq_lens has a negative entry.*\[post-mortem not written: FileExistsError"
    ):
        _negative(rt)
    assert victim.read_text() == "keep me"
    with pytest.raises(MetadataError, match=r"\[post-mortem written to .*-2\.json\]"):
        _negative(rt)
    world.still_usable()


def test_postmortems_go_to_a_private_folder_and_are_capped(world, tmp_path):
    folder = tmp_path / "pm"
    rt, eng = _another_runtime(world, postmortem_dir=str(folder))
    for _ in range(MAX_POSTMORTEMS + 3):
        with pytest.raises(MetadataError):
            _negative(rt)
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    assert len(os.listdir(folder)) == MAX_POSTMORTEMS
    world.still_usable()
