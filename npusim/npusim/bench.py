"""The simulator's own cost of a kernel re-issued inside a task-group update session.

``python -m npusim.bench [--runs N] [--reissues N] [--json PATH]``: a graph is captured with
one PA task (``_npu_paged_attention``, as vllm-ascend and npugraph call it) and one FIA task
(``npu_fused_infer_attention_score.out``, TND, paged, with its workspace and ``out`` pair: the
43 arguments both pass), each in its own task group; then each kernel is re-issued inside
``graph_task_update_begin/end`` with new lengths, again and again, as an engine's update does
every step.  The figure is the host time of the re-issuing call alone (its argument binding,
placement and shape checks, the comparison with the captured task, the non-owning aliases
and the queued rewrite), not the session's begin, end and event record around it.  Per run the
median over its re-issues; the report gives the median of the runs' medians with their
minimum and maximum.  These are this machine's microseconds: compare runs of one machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import npusim
from npusim import npu

__all__ = ["measure", "main"]

_TOKENS, _HEADS, _KV_HEADS, _HEAD_DIM, _BLOCK, _BLOCKS = 8, 8, 2, 64, 128, 64


def _pa(args: dict[str, Any], lens: torch.Tensor) -> None:
    npusim._npu_paged_attention(
        args["query"],
        args["key_cache"],
        args["value_cache"],
        _KV_HEADS,
        _HEADS,
        _HEAD_DIM**-0.5,
        args["block_table"],
        lens,
        args["out"],
        workspace=args["workspace"],
    )


def _fia(args: dict[str, Any], lens: list[int]) -> None:
    npusim.npu_fused_infer_attention_score.out(
        args["query"],
        args["key"],
        args["value"],
        actual_seq_lengths=list(range(1, _TOKENS + 1)),
        actual_seq_lengths_kv=lens,
        block_table=args["block_table"],
        num_heads=_HEADS,
        scale=_HEAD_DIM**-0.5,
        input_layout="TND",
        num_key_value_heads=_KV_HEADS,
        block_size=_BLOCK,
        softmax_lse_flag=False,
        sparse_mode=0,
        atten_mask=None,
        workspace=args["workspace"],
        out=[args["out"], args["lse"]],
    )


def _arguments() -> tuple[dict[str, Any], dict[str, Any]]:
    dev = "npu"
    g = torch.Generator().manual_seed(0)
    query = torch.randn(_TOKENS, _HEADS, _HEAD_DIM, generator=g).to(torch.bfloat16).to(dev)
    cache = [
        torch.randn(_BLOCKS, _BLOCK, _KV_HEADS, _HEAD_DIM, generator=g).to(torch.bfloat16).to(dev) for _ in range(2)
    ]
    table = torch.randint(0, _BLOCKS, (_TOKENS, 8), generator=g, dtype=torch.int32).to(dev)
    pa = {"query": query, "key_cache": cache[0], "value_cache": cache[1], "block_table": table}
    pa["out"] = torch.empty_like(query)
    pa["workspace"] = npusim._npu_paged_attention_get_workspace(
        query,
        cache[0],
        cache[1],
        _KV_HEADS,
        _HEADS,
        _HEAD_DIM**-0.5,
        table,
        torch.full((_TOKENS,), 1024, dtype=torch.int32),
        pa["out"],
    )
    fia = {"query": query, "block_table": table, "out": torch.empty_like(query)}
    fia["key"], fia["value"] = (c.view(_BLOCKS, _BLOCK, _KV_HEADS * _HEAD_DIM) for c in cache)
    fia["lse"] = torch.empty(1, dtype=torch.float32, device=dev)
    fia["workspace"] = npusim._npu_fused_infer_attention_score_get_max_workspace(
        query,
        fia["key"],
        fia["value"],
        actual_seq_lengths=list(range(1, _TOKENS + 1)),
        actual_seq_lengths_kv=[1024] * _TOKENS,
        block_table=table,
        num_heads=_HEADS,
        scale=_HEAD_DIM**-0.5,
        input_layout="TND",
        num_key_value_heads=_KV_HEADS,
        block_size=_BLOCK,
    )
    return pa, fia


def _lengths(step: int) -> list[int]:
    return [1 + (step * 7 + 13 * i) % 1000 for i in range(_TOKENS)]


def measure(runs: int = 5, reissues: int = 200) -> dict[str, Any]:
    """Each kernel's re-issue cost, µs: ``{"pa": {...}, "fia": {...}}`` with the median of the
    runs' medians, its min and max, and each run's median."""
    pa, fia = _arguments()
    calls: dict[str, Callable[[int], None]] = {
        "pa": lambda step: _pa(pa, torch.tensor(_lengths(step), dtype=torch.int32)),
        "fia": lambda step: _fia(fia, _lengths(step)),
    }
    graph, stream, updates = npu.NPUGraph(), npu.Stream(), npu.Stream()
    groups = {}
    with npu.graph(graph):
        capture = npu.current_stream()
        for name, call in calls.items():
            npu.graph_task_group_begin(capture)
            call(0)
            groups[name] = npu.graph_task_group_end(capture)
    del stream
    report: dict[str, Any] = {}
    for name, call in calls.items():
        medians = []
        for run in range(runs):
            times = []
            for i in range(reissues):
                with npu.stream(updates):
                    npu.graph_task_update_begin(updates, groups[name])
                    t0 = time.perf_counter()
                    call(run * reissues + i + 1)
                    times.append(time.perf_counter() - t0)
                    npu.graph_task_update_end(updates)
            npu.synchronize()
            medians.append(statistics.median(times) * 1e6)
        report[name] = {
            "median_us": round(statistics.median(medians), 1),
            "min_us": round(min(medians), 1),
            "max_us": round(max(medians), 1),
            "runs_us": [round(m, 1) for m in medians],
        }
    graph.reset()
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m npusim.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--reissues", type=int, default=200, help="re-issues per run")
    parser.add_argument("--json", type=Path, help="write the report here")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.reissues < 1:
        print("npusim.bench: --runs and --reissues must be at least 1", file=sys.stderr)
        return 2
    npusim.install_npu_device()
    report = {"what": "host time of one kernel re-issued in a task-group update session, us", "runs": args.runs}
    report["reissues_per_run"] = args.reissues
    report |= measure(args.runs, args.reissues)
    for name in ("pa", "fia"):
        r = report[name]
        print(
            f"re-issued {name:>3}: {r['median_us']:7.1f} us  [{r['min_us']:.1f}, {r['max_us']:.1f}] over {args.runs} runs"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
