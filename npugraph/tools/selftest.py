"""``npugraph selftest``: the device behaviours npugraph relies on, checked in under a minute.

Run it first on every new Ascend host (``npugraph selftest --device npu``): each check
captures small attention graphs through npugraph and compares every replay with the
same step run eagerly *and* with an independent float64 reference
(:mod:`npugraph.reference`), so a device, driver or CANN that breaks one of npugraph's
assumptions shows up here rather than as wrong tokens.
"""

from __future__ import annotations

import functools
import importlib.metadata
import random
import time
from collections.abc import Callable
from typing import Any

import attrs
import torch

from npugraph.device import Device, load_device
from npugraph.errors import NpuGraphError
from npugraph.metadata import AttentionMetadata, pad_lens
from npugraph.models.stack import AttentionStack
from npugraph.policy import FixedPolicy
from npugraph.reference import paged_attention_reference
from npugraph.runtime import Runtime

__all__ = ["CheckResult", "calibrate_costs", "run_selftest", "versions"]

_HEADS, _KV_HEADS, _HEAD, _BLOCK, _BLOCKS, _MAX_LEN = 8, 2, 128, 128, 48, 1024
_TOL = {torch.float16: 2e-2, torch.bfloat16: 8e-2}


@attrs.frozen(kw_only=True)
class CheckResult:
    """One self-test check: its name, whether it passed, and what it saw."""

    name: str
    passed: bool
    detail: str
    seconds: float


def versions(device: Device) -> dict[str, str]:
    """torch, torch_npu and CANN versions (``-`` where absent)."""

    def dist(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "-"

    cann = "-"
    if not device.is_sim:
        cann = str(getattr(getattr(device.ops, "version", None), "cann", "-"))
    return {"torch": torch.__version__, "torch_npu": dist("torch-npu"), "cann": cann, "device": device.name}


@attrs.define
class _Bench:
    """One runtime with an attention-only graph at ``size``, and a step generator."""

    rt: Runtime
    stack: AttentionStack
    query: torch.Tensor
    table: torch.Tensor
    rng: random.Random

    def step_meta(self, size: int) -> tuple[AttentionMetadata, AttentionMetadata, list[int]]:
        """A step of graph ``size``: R <= size requests of random lengths, shuffled blocks."""
        r = self.rng.randint(1, size)
        lens = [self.rng.choice([1, 2, self.rng.randint(1, _MAX_LEN)]) for _ in range(r)]
        cols = _MAX_LEN // _BLOCK
        blocks = list(range(_BLOCKS))
        table = torch.zeros(r, cols, dtype=torch.int32, device="cpu")
        for i, n in enumerate(lens):
            self.rng.shuffle(blocks)
            used = -(-n // _BLOCK)
            table[i, :used] = torch.tensor(blocks[:used], dtype=torch.int32, device="cpu")
        padded_lens = torch.zeros(size, dtype=torch.int32, device="cpu")
        padded_lens[:r] = torch.tensor(lens, dtype=torch.int32, device="cpu")
        padded_table = torch.zeros(size, cols, dtype=torch.int32, device="cpu")
        padded_table[:r] = table
        dev = self.rt.device.memory
        meta = AttentionMetadata(seq_lens=padded_lens[:r].clone(), block_table=table.to(dev))
        padded = AttentionMetadata(seq_lens=padded_lens, block_table=padded_table.to(dev))
        return meta, padded, lens

    def reference(self, q: torch.Tensor, lens: list[int], meta: AttentionMetadata) -> torch.Tensor:
        """The stack's output for the real requests, layer by layer in float64 (cast between layers)."""
        x = q[: len(lens)]
        for (k, v), attn in zip(self.stack.caches, self.stack.attn):
            ref = paged_attention_reference(x, k, v, meta.block_table, lens, attn.scale)
            x = ref.to(q.dtype).to(q.device)
        return ref


def _make(device: Device, kernel: str, sizes: tuple[int, ...], *, fused: bool | None = None, seed: int = 0) -> _Bench:
    rt = Runtime(device, max_model_len=_MAX_LEN, policy=FixedPolicy(kernel), fused_update=fused)
    stack = AttentionStack(
        rt,
        layers=2,
        heads=_HEADS,
        kv_heads=_KV_HEADS,
        head_size=_HEAD,
        block_size=_BLOCK,
        num_blocks=_BLOCKS,
        dtype=torch.float16,
        seed=seed,
    )
    n = max(sizes)
    dev = device.memory
    query = torch.zeros(n, _HEADS, _HEAD, dtype=torch.float16, device=dev)
    table = torch.zeros(n, _MAX_LEN // _BLOCK, dtype=torch.int32, device=dev)
    for s in sorted(sizes, reverse=True):  # largest first: smaller graphs reuse the pool
        meta = AttentionMetadata(seq_lens=torch.ones(s, dtype=torch.int32, device="cpu"), block_table=table[:s])
        rt.capture(stack, query[:s], meta, key=s, static_inputs={"query": query[:s]})
    return _Bench(rt=rt, stack=stack, query=query, table=table, rng=random.Random(seed))


def _run_steps(b: _Bench, size: int, steps: int, order: str) -> str:
    """Update + replay ``steps`` steps; compare with eager (bitwise) and the reference."""
    b.rt.order = order
    worst = 0.0
    for _ in range(steps):
        meta, padded, lens = b.step_meta(size)
        gen = torch.Generator().manual_seed(b.rng.randrange(1 << 30))
        q = torch.randn(size, _HEADS, _HEAD, generator=gen, device="cpu")
        q = q.to(dtype=torch.float16, device=b.rt.device.memory)
        out = b.rt.step(size, {"default": meta}, inputs={"query": q})
        b.rt.synchronize()
        got = out[: len(lens)].clone()
        eager = b.stack(q, padded)
        b.rt.synchronize()
        if not torch.equal(got, eager[: len(lens)]):
            raise AssertionError(f"size {size}: replay differs from the same step run eagerly")
        if torch.count_nonzero(out[len(lens) :]).item():
            raise AssertionError(f"size {size}: padding rows are not zero")
        ref = b.reference(q, lens, meta)
        err = float((got.double().cpu() - ref).abs().max())
        worst = max(worst, err)
        if err > _TOL[torch.float16] * max(1.0, float(ref.abs().max())):
            raise AssertionError(f"size {size}: max |replay - float64 reference| = {err:.3g}")
    return f"max |replay - float64| {worst:.2g}"


def _check_kernel(device: Device, kernel: str, size: int) -> Callable[[], str]:
    def run() -> str:
        b = _make(device, kernel, (size,))
        a = _run_steps(b, size, 3, "update-first")
        _run_steps(b, size, 3, "replay-first")
        return f"{kernel} at size {size}, both orders: {a}"

    return run


def _check_alias_liveness(device: Device) -> str:
    b = _make(device, "fia", (4,))
    entry = b.rt.entry(4)
    q2 = entry.tasks[1].tensor("query")  # layer 2's query: an intermediate nobody holds
    assert q2 is not None
    _run_steps(b, 4, 2, "update-first")
    return f"graph intermediates reached through non-owning aliases after capture (layer 2 query @ {q2.data_ptr():#x})"


def _check_shared_pool(device: Device) -> str:
    b = _make(device, "fia", (8, 2))
    _run_steps(b, 8, 1, "update-first")
    kept = b.rt.entry(8).outputs.clone()
    _run_steps(b, 2, 1, "update-first")
    _run_steps(b, 8, 1, "update-first")
    changed = not torch.equal(kept, b.rt.entry(8).outputs)
    return f"sizes 8 and 2 in one pool replay correctly in turn (size-8 output {'changed' if changed else 'kept'})"


def _check_fused(device: Device) -> str:
    if device.fused_fia_update is None:
        return "n/a: this torch_npu has no _npu_fused_infer_attention_score_out_graph"
    b = _make(device, "fia", (8,), fused=True)
    assert b.rt.updater.plan(b.rt.entry(8)).tasks[0].fused
    return "4-in-1 FIA update: " + _run_steps(b, 8, 3, "update-first")


def _check_sink(device: Device, size: int) -> str:
    if device.device_length_ops is None:
        return "n/a: no tiling-sink FIA here (torch.ops._C_ascend without vllm-ascend PRs #15215/#15336)"
    b = _make(device, "fia_sink", (size,))
    entry = b.rt.entry(size)
    if any(t.handle is not None for t in entry.tasks) or len(entry.lens_groups) != 1:
        raise AssertionError(f"size {size}: captured with task groups or several length buffers: {entry.choice}")
    a = _run_steps(b, size, 3, "update-first")
    _run_steps(b, size, 3, "replay-first")
    return f"lengths and plan in device memory, no per-layer update, both orders: {a}"


def _check_pa_workspace(device: Device) -> str:
    b = _make(device, "pa", (4,))
    entry = b.rt.entry(4)
    task = entry.tasks[0]
    kw = {k: v for k, v in task.kwargs().items() if k != "workspace"}
    worst = 0
    for length in (1, 2, 17, 128, 129, 512, 1000, _MAX_LEN):
        for lens in ([length] * 4, [length, 1, 1, 1]):
            kw["context_lens"] = torch.tensor(lens, dtype=torch.int32, device="cpu")
            ws = device.ops._npu_paged_attention_get_workspace(**kw)
            worst = max(worst, ws.numel() * ws.element_size())
    if entry.workspace_bytes < worst:
        raise AssertionError(f"workspace {entry.workspace_bytes} B < {worst} B needed at some length")
    return f"workspace {entry.workspace_bytes} B covers every probed length (max need {worst} B)"


def _check_placement(device: Device) -> str:
    seen = 0
    for kernel in ("pa", "fia"):
        b = _make(device, kernel, (2,))
        for t in b.rt.entry(2).tasks:
            q = t.tensor("query")
            assert q is not None
            for name, v in t.args.items():
                tensors = v if isinstance(v, list) else [v]
                for x in tensors:
                    if not isinstance(x, torch.Tensor):
                        continue
                    want = torch.device("cpu") if name in t.spec.host_args else q.device
                    if x.device != want:
                        raise AssertionError(f"{kernel} {t.layer}: argument {name!r} is on {x.device}, expected {want}")
                    seen += 1
    return f"{seen} tensor arguments: device ones on the query's device, host ones on the CPU"


def run_selftest(
    kind: str | Device = "sim", progress: Callable[[CheckResult], None] | None = None
) -> list[CheckResult]:
    """Run every check on ``kind``; a failing check never stops the others."""
    device = load_device(kind)
    checks: list[tuple[str, Callable[[], str]]] = [
        ("pa capture+update, size 1", _check_kernel(device, "pa", 1)),
        ("pa capture+update, size 8", _check_kernel(device, "pa", 8)),
        ("fia capture+update, size 1", _check_kernel(device, "fia", 1)),
        ("fia capture+update, size 8", _check_kernel(device, "fia", 8)),
        ("weak aliases after capture", lambda: _check_alias_liveness(device)),
        ("two graphs, one pool", lambda: _check_shared_pool(device)),
        ("fused 4-in-1 update", lambda: _check_fused(device)),
        ("fia tiling sink, size 8", lambda: _check_sink(device, 8)),
        ("pa workspace over lengths", lambda: _check_pa_workspace(device)),
        ("argument placement", lambda: _check_placement(device)),
    ]
    results = []
    for name, fn in checks:
        t0 = time.perf_counter()
        try:
            detail, ok = fn(), True
        except (AssertionError, NpuGraphError, RuntimeError, ValueError) as exc:
            detail, ok = f"{type(exc).__name__}: {' '.join(str(exc).split())}", False
        r = CheckResult(name=name, passed=ok, detail=detail, seconds=time.perf_counter() - t0)
        results.append(r)
        if progress is not None:
            progress(r)
    return results


def calibrate_costs(kind: str | Device = "sim", repeats: int = 20) -> dict[str, Any]:
    """Measure, on this device, the host µs of each device-API call the timeline model
    charges (``npugraph bench --costs FILE`` runs the model on them): a task update's
    begin, op and end for PA and FIA, an event record, a replay, a synchronize and a PA
    workspace query.  Each figure is the median over ``repeats`` calls, the graphs replayed
    between updates (untimed) so that every update lands on an executed task."""
    device = load_device(kind)
    npu = device.npu
    timed: dict[str, list[float]] = {}

    def clock(name: str, call: Callable[[], Any]) -> None:
        t0 = time.perf_counter()
        call()
        timed.setdefault(name, []).append((time.perf_counter() - t0) * 1e6)

    for kernel in ("pa", "fia"):
        b = _make(device, kernel, (4,))
        entry = b.rt.entry(4)
        plan = b.rt.updater.plan(entry)
        update_stream = b.rt.updater.stream
        host = plan.tasks[0].spec.host_values(pad_lens([_MAX_LEN // 2] * 4, None, 4, 4))
        for _ in range(repeats):
            npu.synchronize()
            with npu.stream(update_stream):
                for t in plan.tasks:
                    kw = {**t.kwargs, **host}
                    args = t.qkv or ()
                    clock(
                        f"{kernel}_update_begin",
                        functools.partial(npu.graph_task_update_begin, update_stream, t.handle),
                    )
                    clock(f"{kernel}_op_launch", functools.partial(t.kernel, *args, **kw))
                    clock(f"{kernel}_update_end", functools.partial(npu.graph_task_update_end, update_stream))
                    clock("event_record", functools.partial(t.event.record, update_stream))
            clock("replay", entry.graph.replay)
            clock("synchronize", npu.synchronize)
            if kernel == "pa":
                kw = {k: v for k, v in plan.tasks[0].kwargs.items() if k != "workspace"}
                ws_query = device.ops._npu_paged_attention_get_workspace
                clock("workspace_query", functools.partial(ws_query, **{**kw, **host}))
        b.rt.reset()
    if device.device_length_ops is not None:  # the tiling-sink step: the length copy and the metadata op
        b = _make(device, "fia_sink", (4,))
        plan = b.rt.updater.plan(b.rt.entry(4))
        host = plan.tasks[0].spec.host_values(pad_lens([_MAX_LEN // 2] * 4, None, 4, 4))
        write = plan.lens_writes[0]
        for _ in range(repeats):
            npu.synchronize()
            with npu.stream(b.rt.updater.stream):
                clock("metadata_launch", functools.partial(write.write, host))
        npu.synchronize()
        b.rt.reset()
    med = {k: sorted(v)[len(v) // 2] for k, v in timed.items()}
    return {
        "device": device.name,
        "replay": med["replay"],
        "event_record": med["event_record"],
        "workspace_query": med["workspace_query"],
        "synchronize": med["synchronize"],
        "update_begin": med["fia_update_begin"],
        "update_end": med["fia_update_end"],
        "op_launch_fia": med["fia_op_launch"],
        "op_launch_pa": med["pa_op_launch"],
        "pa_update_begin": med["pa_update_begin"],
        "pa_update_end": med["pa_update_end"],
        **({"metadata_launch": med["metadata_launch"]} if "metadata_launch" in med else {}),
    }
