"""``npugraph`` command line: demo, bench, dump tooling and kernel-policy measurement."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]


def _sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"sizes must be comma-separated integers, got {text!r}") from exc
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"sizes must be positive integers, got {text!r}")
    return sizes


def attention_shape_args(p: argparse.ArgumentParser) -> None:
    """Device, sizes and attention shapes: shared by ``demo`` and ``policy measure``."""
    p.add_argument("--device", default="sim", choices=["sim", "npu"], help="simulator (default) or a real Ascend NPU")
    p.add_argument("--sizes", type=_sizes, default=[1, 2, 4, 8, 16, 32], help="capture sizes (default 1,2,4,8,16,32)")
    p.add_argument("--heads", type=int, default=4, help="query heads (default 4)")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads, GQA (default 2)")
    p.add_argument("--head-size", type=int, default=64, help="head size; PA supports 64 and 128 (default 64)")
    p.add_argument("--block-size", type=int, default=16, help="KV-cache block size in tokens (default 16)")
    p.add_argument("--max-model-len", type=int, default=512, help="longest sequence (default 512)")


def _model_args(p: argparse.ArgumentParser) -> None:
    attention_shape_args(p)
    p.add_argument("--layers", type=int, default=8, help="decoder layers (default 8)")
    p.add_argument("--num-blocks", type=int, default=512, help="KV-cache blocks per layer (default 512)")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and workload (default 0)")
    p.add_argument(
        "--policy",
        default=None,
        help="kernel policy: a JSON file written by 'npugraph policy measure', or 'pa-sizes=1,2,3,4' "
        "(default: PA for sizes 1-4, FIA above)",
    )


def _policy(spec: str | None) -> Any:
    from npugraph.policy import StaticPolicy, load_policy

    if spec is None:
        return None
    if spec.startswith("pa-sizes="):
        listed = spec.partition("=")[2]
        return StaticPolicy(frozenset(_sizes(listed)) if listed else frozenset())  # type: ignore[arg-type]
    return load_policy(spec)


def _build(args: argparse.Namespace, runtime_kwargs: dict[str, Any]) -> tuple[Any, Any, Any]:
    import torch

    from npugraph import Runtime
    from npugraph.models import Decoder, DecoderConfig
    from npugraph.models.engine import DecodeEngine

    torch.manual_seed(args.seed)
    cfg = DecoderConfig(
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_size=args.head_size,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_model_len=args.max_model_len,
        seed=args.seed,
    )
    rt = Runtime(args.device, max_model_len=cfg.max_model_len, **runtime_kwargs)
    policy = _policy(args.policy)
    if policy is not None:
        rt.set_policy(policy)
    engine = DecodeEngine(rt, Decoder(cfg, rt), args.sizes)
    return cfg, rt, engine


def cmd_demo(args: argparse.Namespace) -> int:
    """Capture the decoder, decode under continuous batching, check every step against eager."""
    import torch

    from npugraph import sim
    from npugraph.models import Workload

    if args.device == "sim":
        sim.configure(adversarial_seed=args.adversarial)
    cfg, rt, engine = _build(
        args,
        {"order": args.order, "progress": not args.no_progress, "postmortem_dir": args.postmortem_dir},
    )
    t0 = time.perf_counter()
    engine.capture()
    capture_s = time.perf_counter() - t0
    upd: dict[int, list[float]] = {s: [] for s in engine.sizes}
    rep: dict[int, list[float]] = {s: [] for s in engine.sizes}
    mismatches = 0
    first_bad = None
    wl = Workload(cfg, engine.sizes, seed=args.seed, adversarial=args.adversarial is not None)
    for i, batch in enumerate(wl.steps(args.steps)):
        ref = engine.eager(batch).clone()
        inputs = {"input_ids": batch.input_ids, "positions": batch.positions, "slot_mapping": batch.slot_mapping}
        entry = rt.manager.entry("main", batch.size)
        rt.copy_inputs(entry, inputs)
        if args.order == "update-first":
            t1 = time.perf_counter()
            rt.update(batch.size, {"default": batch.meta})
            t2 = time.perf_counter()
            out = rt.replay(batch.size)
            rt.synchronize()
            t3 = time.perf_counter()
            upd[batch.size].append(t2 - t1)
            rep[batch.size].append(t3 - t2)
        else:
            t1 = time.perf_counter()
            out = rt.replay(batch.size)
            t2 = time.perf_counter()
            rt.update(batch.size, {"default": batch.meta})
            rt.synchronize()
            t3 = time.perf_counter()
            rep[batch.size].append(t2 - t1)
            upd[batch.size].append(t3 - t2)
        got = out[: batch.num_reqs]
        if not torch.equal(got, ref):
            mismatches += 1
            if first_bad is None:
                first_bad = i
        wl.feedback(batch.rids, got.argmax(-1).tolist())
    kernels = {e.key: e.choice.kernel for e in rt.manager.entries()}
    print(f"npugraph demo on {rt.device.name}: {cfg.layers} layers, sizes {engine.sizes}, captured in {capture_s:.2f}s")
    print(f"{'size':>5} {'kernel':>6} {'replays':>8} {'update us':>10} {'replay us':>10}  why")
    for e in sorted(rt.manager.entries(), key=lambda e: e.tokens):
        s = e.tokens
        u = f"{statistics.median(upd[s]) * 1e6:.0f}" if upd[s] else "-"
        r = f"{statistics.median(rep[s]) * 1e6:.0f}" if rep[s] else "-"
        print(f"{s:>5} {e.choice.kernel:>6} {e.replays:>8} {u:>10} {r:>10}  {e.choice.reason}")
    verdict = f"{args.steps} steps, {mismatches} mismatches"
    if first_bad is not None:
        verdict += f" (first at step {first_bad})"
    print(verdict)
    all_u = [x for v in upd.values() for x in v]
    all_r = [x for v in rep.values() for x in v]
    summary = {
        "device": rt.device.name,
        "layers": cfg.layers,
        "capture_sizes": engine.sizes,
        "steps": args.steps,
        "mismatches": mismatches,
        "kernel_by_size": {str(k): v for k, v in sorted(kernels.items())},
        "kernel_reason_by_size": {str(e.key): e.choice.reason for e in rt.manager.entries()},
        "update_us_median": statistics.median(all_u) * 1e6 if all_u else None,
        "replay_us_median": statistics.median(all_r) * 1e6 if all_r else None,
        "capture_seconds": capture_s,
        "order": args.order,
        "adversarial_seed": args.adversarial,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    if args.dump:
        rt.save_manifest(args.dump)
    return 1 if mismatches else 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Per-step update cost: npugraph vs baseline vs floor, cost model off and a2."""
    from npugraph import bench

    cms = {"off": [False], "a2": [True], "both": [False, True]}[args.cost_model]
    print(
        f"{'cost':>4} {'layers':>6} {'size':>4} {'kernel':>6} {'npugraph us':>12} {'baseline us':>12} "
        f"{'floor us':>10} {'vs base':>8} {'vs floor':>8}  calls n/b/f"
    )

    def show(r: dict[str, Any]) -> None:
        c = r["calls"]
        print(
            f"{r['cost_model']:>4} {r['layers']:>6} {r['size']:>4} {r['kernel']:>6} {r['npugraph_us']:>12.0f} "
            f"{r['baseline_us']:>12.0f} {r['floor_us']:>10.0f} {r['npugraph_us'] / r['baseline_us']:>8.2f} "
            f"{r['npugraph_us'] / r['floor_us']:>8.2f}  {c['npugraph']}/{c['baseline']}/{c['floor']}",
            flush=True,
        )

    result = bench.run_bench(layers=args.layers, sizes=args.sizes, cost_models=cms, repeats=args.repeats, progress=show)
    for cm, s in result["summary"].items():
        print(
            f"summary [{cm}] (32+ layers): npugraph/baseline {s['ratio_vs_baseline_median']:.2f}, "
            f"npugraph/floor {s['overhead_vs_floor_median']:.2f}"
        )
    if args.extra:
        result["capture"] = bench.bench_capture()
        for r in result["capture"]:
            print(
                f"capture {r['sizes']:>3} sizes x {r['layers']:>2} layers: {r['seconds']:.2f}s, "
                f"pool {r['pool_bytes'] / 2**20:.1f} MiB, workspaces {r['workspace_bytes'] / 2**20:.1f} MiB"
            )
        result["replay_vs_eager"] = bench.bench_replay_vs_eager()
        print(f"decoder step, replay / eager on the simulator: {result['replay_vs_eager']['replay_over_eager']:.2f}")
    import platform

    result["machine"] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "processor": platform.processor() or platform.machine(),
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def cmd_dump(args: argparse.Namespace) -> int:
    from npugraph.dump import cli as dump_cli

    return dump_cli.run(args)


def cmd_policy(args: argparse.Namespace) -> int:
    from npugraph.policy import cli as policy_cli

    return policy_cli.run(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="npugraph", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="capture a decoder and decode with replay, checked against eager")
    _model_args(d)
    d.add_argument("--steps", type=int, default=200, help="decode steps (default 200)")
    d.add_argument(
        "--order",
        choices=["update-first", "replay-first"],
        default="update-first",
        help="issue the update before or after enqueuing the replay",
    )
    d.add_argument(
        "--adversarial",
        type=int,
        default=None,
        metavar="SEED",
        help="simulator: defer and interleave streams in a seeded random order",
    )
    d.add_argument("--json", metavar="PATH", help="write a machine-readable summary")
    d.add_argument("--dump", metavar="PATH", help="write the capture manifest")
    d.add_argument("--postmortem-dir", default=None, help="write a post-mortem here when a step fails")
    d.add_argument("--no-progress", action="store_true", help="no progress bar while capturing")
    d.set_defaults(func=cmd_demo)

    b = sub.add_parser("bench", help="per-step update cost: npugraph vs baseline vs floor")
    b.add_argument("--layers", type=_sizes, default=[8, 32, 64], help="layer counts (default 8,32,64)")
    b.add_argument("--sizes", type=_sizes, default=[1, 8, 32], help="batch sizes (default 1,8,32)")
    b.add_argument(
        "--cost-model", choices=["off", "a2", "both"], default="both", help="simulator host-cost model (default both)"
    )
    b.add_argument("--repeats", type=int, default=15, help="measured steps per method (default 15)")
    b.add_argument("--extra", action="store_true", help="also measure capture cost and replay vs eager")
    b.add_argument("--json", metavar="PATH", help="write rows and summary as JSON")
    b.set_defaults(func=cmd_bench)

    from npugraph.dump.cli import add_parser as add_dump
    from npugraph.policy.cli import add_parser as add_policy

    add_dump(sub)
    add_policy(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``npugraph`` command line; return its exit status."""
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
