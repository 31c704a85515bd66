"""The simulator's own cost of a kernel re-issued inside a task-group update session.

``python -m npusim.bench [--runs N] [--steps N] [--layers N] [--reissues N] [--json PATH]``.
Two loops, each for PA (``_npu_paged_attention``, batch 4, its lengths a CPU int32 tensor, as
vllm-ascend and npugraph call it) and FIA (``npu_fused_infer_attention_score.out``, TND, paged,
batch 16, with its workspace and ``out`` pair: the 43 arguments both pass); 8 heads, 2 KV
heads, head size 128, blocks of 128:

* **engine** (the figure that counts): a decode graph of ``--layers`` layers, each an
  ExternalEvent wait and the kernel in a task group of its own.  Each step replays it, then
  re-issues every layer's kernel with that step's lengths inside
  ``graph_task_update_begin/end`` while the replay is pending, and records the layer's
  event, which lets the simulated device run that layer's kernel (real arithmetic on this
  CPU) before the next re-issue: what an engine's step does.
* **tight**: the same re-issue again and again, no replay pending, no device work between.

The figure is the host time of the re-issuing call alone (the caller's own argument list
included: the lengths' tensor for PA, as an engine builds it), not the session's begin, end
and record around it, nor the device work.  Per run the median over its re-issues; the
report gives the median of the runs' medians with their minimum and maximum.  These are
this machine's microseconds: compare runs of one machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import npusim
from npusim import npu

__all__ = ["measure", "main"]

_HEADS, _KV_HEADS, _HEAD_DIM, _BLOCK = 8, 2, 128, 128
_MAX_LEN = 1024  # the longest context a step draws: 8 blocks a request
_BATCH = {"pa": 4, "fia": 16}  # PA for small batches, FIA for larger ones (vllm-ascend #4765)
_FIA_GEOMETRY: dict[str, Any] = {
    "num_heads": _HEADS,
    "scale": _HEAD_DIM**-0.5,
    "input_layout": "TND",
    "num_key_value_heads": _KV_HEADS,
    "block_size": _BLOCK,
}


class _Kernel:
    """One kernel's arguments at its batch, and its call with a step's lengths."""

    def __init__(self, name: str) -> None:
        self.name, self.batch = name, _BATCH[name]
        b, cols = self.batch, _MAX_LEN // _BLOCK
        g = torch.Generator().manual_seed(0)
        blocks = b * cols + 1
        self.query = torch.randn(b, _HEADS, _HEAD_DIM, generator=g).to(torch.bfloat16).to("npu")
        k, v = (
            torch.randn(blocks, _BLOCK, _KV_HEADS, _HEAD_DIM, generator=g).to(torch.bfloat16).to("npu") for _ in "kv"
        )
        self.cache = (k, v)
        self.table = torch.randperm(blocks - 1, generator=g)[: b * cols].view(b, cols).to(torch.int32).to("npu")
        self.out = torch.empty_like(self.query)
        self.ends = list(range(1, b + 1))  # TND: one query token a request
        if name == "pa":
            self.workspace = npusim._npu_paged_attention_get_workspace(
                self.query, k, v, _KV_HEADS, _HEADS, _HEAD_DIM**-0.5, self.table, self._pa_lens(0), self.out
            )
            # a split-KV workspace for short lengths can outgrow the long one (numerics.py)
            short = npusim._npu_paged_attention_get_workspace(
                self.query,
                k,
                v,
                _KV_HEADS,
                _HEADS,
                _HEAD_DIM**-0.5,
                self.table,
                torch.ones(b, dtype=torch.int32),
                self.out,
            )
            if short.numel() > self.workspace.numel():
                self.workspace = short
        else:
            self.key, self.value = (c.view(blocks, _BLOCK, _KV_HEADS * _HEAD_DIM) for c in self.cache)
            self.lse = torch.empty(1, dtype=torch.float32, device="npu")
            self.workspace = npusim._npu_fused_infer_attention_score_get_max_workspace(
                self.query,
                self.key,
                self.value,
                actual_seq_lengths=self.ends,
                actual_seq_lengths_kv=[_MAX_LEN] * b,
                block_table=self.table,
                **_FIA_GEOMETRY,
            )

    def lengths(self, step: int) -> list[int]:
        return [1 + (step * 7 + 131 * i) % _MAX_LEN for i in range(self.batch)]

    def _pa_lens(self, step: int) -> torch.Tensor:
        return torch.tensor(self.lengths(step), dtype=torch.int32)

    def call(self, lens: list[int]) -> None:
        """The kernel as an engine's update issues it (the caller's own arguments built here)."""
        if self.name == "pa":
            k, v = self.cache
            npusim._npu_paged_attention(
                self.query,
                k,
                v,
                _KV_HEADS,
                _HEADS,
                _HEAD_DIM**-0.5,
                self.table,
                torch.tensor(lens, dtype=torch.int32),
                self.out,
                workspace=self.workspace,
            )
            return
        npusim.npu_fused_infer_attention_score.out(
            self.query,
            self.key,
            self.value,
            actual_seq_lengths=self.ends,
            actual_seq_lengths_kv=lens,
            block_table=self.table,
            **_FIA_GEOMETRY,
            softmax_lse_flag=False,
            sparse_mode=0,
            atten_mask=None,
            workspace=self.workspace,
            out=[self.out, self.lse],
        )


def _capture(kernel: _Kernel, layers: int) -> tuple[Any, list[Any], list[Any]]:
    """A decode graph: per layer an ExternalEvent wait and the kernel in its own task group."""
    graph, events, groups = npu.NPUGraph(), [npu.ExternalEvent() for _ in range(layers)], []
    with npu.graph(graph):
        capture = npu.current_stream()
        for event in events:
            event.wait(capture)
            npu.graph_task_group_begin(capture)
            kernel.call(kernel.lengths(0))
            groups.append(npu.graph_task_group_end(capture))
    return graph, events, groups


def _engine_run(
    kernel: _Kernel, graph: Any, events: list[Any], groups: list[Any], steps: int, first: int
) -> list[float]:
    updates, times = npu.Stream(), []
    for step in range(first, first + steps):
        lens = kernel.lengths(step)
        graph.replay()  # pending: it waits on each layer's event
        with npu.stream(updates):
            for group, event in zip(groups, events):
                npu.graph_task_update_begin(updates, group)
                t0 = time.perf_counter()
                kernel.call(lens)
                times.append(time.perf_counter() - t0)
                npu.graph_task_update_end(updates)
                event.record(updates)  # the device runs this layer now
        npu.synchronize()
    return times


def _tight_run(kernel: _Kernel, groups: list[Any], reissues: int, first: int) -> list[float]:
    updates, times = npu.Stream(), []
    with npu.stream(updates):
        for i in range(first, first + reissues):
            npu.graph_task_update_begin(updates, groups[0])
            t0 = time.perf_counter()
            kernel.call(kernel.lengths(i))
            times.append(time.perf_counter() - t0)
            npu.graph_task_update_end(updates)
    npu.synchronize()
    return times


def _summary(medians: list[float]) -> dict[str, Any]:
    us = [m * 1e6 for m in medians]
    return {
        "median_us": round(statistics.median(us), 1),
        "min_us": round(min(us), 1),
        "max_us": round(max(us), 1),
        "runs_us": [round(m, 1) for m in us],
    }


def measure(runs: int = 5, steps: int = 20, layers: int = 8, reissues: int = 200) -> dict[str, Any]:
    """Each kernel's re-issue cost in both loops, µs: ``{"engine": {"pa": {...}, "fia": {...}},
    "tight": {...}}``, each with the median of the runs' medians, its min and max, and each
    run's median.  A run's first step (and first re-issue) warms up and is not counted."""
    report: dict[str, Any] = {"engine": {}, "tight": {}}
    for name in ("pa", "fia"):
        kernel = _Kernel(name)
        graph, events, groups = _capture(kernel, layers)
        engine: list[float] = []
        tight: list[float] = []
        for run in range(runs):
            times = _engine_run(kernel, graph, events, groups, steps + 1, 1 + run * (steps + 1))
            engine.append(statistics.median(times[layers:]))
            tight.append(statistics.median(_tight_run(kernel, groups, reissues + 1, 1 + run * reissues)[1:]))
        graph.reset()
        report["engine"][name] = _summary(engine) | {"batch": kernel.batch}
        report["tight"][name] = _summary(tight) | {"batch": kernel.batch}
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m npusim.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="engine steps per run")
    parser.add_argument("--layers", type=int, default=8, help="layers of the engine loop's graph")
    parser.add_argument("--reissues", type=int, default=200, help="tight-loop re-issues per run")
    parser.add_argument("--json", type=Path, help="write the report here")
    args = parser.parse_args(argv)
    if min(args.runs, args.steps, args.layers, args.reissues) < 1:
        print("npusim.bench: --runs, --steps, --layers and --reissues must be at least 1", file=sys.stderr)
        return 2
    npusim.install_npu_device()
    report: dict[str, Any] = {
        "what": "host time of one kernel re-issued in a task-group update session, us",
        "runs": args.runs,
        "engine_steps_per_run": args.steps,
        "layers": args.layers,
        "reissues_per_run": args.reissues,
        "shape": {"heads": _HEADS, "kv_heads": _KV_HEADS, "head_size": _HEAD_DIM, "block_size": _BLOCK},
    }
    report |= measure(args.runs, args.steps, args.layers, args.reissues)
    for loop in ("engine", "tight"):
        for name in ("pa", "fia"):
            r = report[loop][name]
            print(
                f"re-issued {name:>3} (batch {r['batch']:>2}), {loop} loop: {r['median_us']:7.1f} us  "
                f"[{r['min_us']:.1f}, {r['max_us']:.1f}] over {args.runs} runs"
            )
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
