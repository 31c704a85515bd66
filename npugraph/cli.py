"""``npugraph`` command line: demo, selftest, bench, dump tooling and kernel-policy measurement.

Every npugraph error ends the command with one line on stderr and exit status 2;
``demo`` exits 1 on a mismatch, ``selftest`` on a failed check.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from npugraph._version import __version__
from npugraph.device import load_device
from npugraph.dump import cli as dump_cli
from npugraph.errors import NpuGraphError
from npugraph.files import FileError, check_writable, read_json, write_text
from npugraph.models import Decoder, DecoderConfig, MLADecoder, Workload
from npugraph.models.engine import DecodeEngine
from npugraph.policy import KernelPolicy, MeasuredPolicy, StaticPolicy, default_widths, load_policy
from npugraph.runtime import Runtime
from npugraph.tools import demo
from npugraph.tools.measure import measure_policy
from npugraph.tools.selftest import CheckResult, calibrate_costs, run_selftest, versions

__all__ = ["main", "build_parser"]

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_DEFAULT_DTYPE = "bfloat16"  # the demo decoder's; `policy measure` defaults to it too
_MODELS = {"gqa": Decoder, "mla": MLADecoder, "gemma-like": Decoder}


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from exc
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n


def _fraction(text: str) -> float:
    try:
        x = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from exc
    if not 0 <= x < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {x}")
    return x


def _sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"sizes must be comma-separated integers, got {text!r}") from exc
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"sizes must be positive integers, got {text!r}")
    return sizes


def _out_path(text: str) -> str:
    """An output file: checked before minutes of work, never a symlink."""
    try:
        return check_writable(text)
    except FileError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _in_file(text: str) -> str:
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    return text


def attention_shape_args(p: argparse.ArgumentParser) -> None:
    """Device, sizes and attention shapes: shared by ``demo`` and ``policy measure``."""
    p.add_argument("--device", default="sim", choices=["sim", "npu"], help="simulator (default) or a real Ascend NPU")
    p.add_argument("--sizes", type=_sizes, default=[1, 2, 4, 8, 16, 32], help="capture sizes (default 1,2,4,8,16,32)")
    p.add_argument("--heads", type=_positive, default=4, help="query heads (default 4)")
    p.add_argument("--kv-heads", type=_positive, default=2, help="key/value heads, GQA (default 2)")
    p.add_argument("--head-size", type=_positive, default=64, help="head size; PA supports 64 and 128 (default 64)")
    p.add_argument("--block-size", type=_positive, default=16, help="KV-cache block size in tokens (default 16)")
    p.add_argument("--max-model-len", type=_positive, default=512, help="longest sequence (default 512)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=_DEFAULT_DTYPE, help=f"(default {_DEFAULT_DTYPE})")


def _model_args(p: argparse.ArgumentParser) -> None:
    attention_shape_args(p)
    p.add_argument("--layers", type=_positive, default=8, help="decoder layers (default 8)")
    p.add_argument("--num-blocks", type=_positive, default=512, help="KV-cache blocks per layer (default 512)")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and workload (default 0)")
    p.add_argument(
        "--policy",
        default=None,
        help="kernel policy: a JSON file written by 'npugraph policy measure', or 'pa-sizes=1,2,3,4' "
        "(default: PA for sizes 1-4, FIA above)",
    )


def _policy(spec: str | None) -> KernelPolicy | None:
    if spec is None:
        return None
    if spec.startswith("pa-sizes="):
        listed = spec.partition("=")[2]
        try:
            return StaticPolicy(_sizes(listed) if listed else [])
        except argparse.ArgumentTypeError as exc:
            raise NpuGraphError(f"--policy {spec!r}: {exc}") from exc
    return load_policy(spec)


def cmd_demo(args: argparse.Namespace) -> int:
    """Capture the decoder, decode under continuous batching, check every step against eager."""
    if args.device == "sim":
        load_device("sim").ops.configure(adversarial_seed=args.adversarial)
    torch.manual_seed(args.seed)
    cfg = DecoderConfig(
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_size=args.head_size,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_model_len=args.max_model_len,
        dtype=_DTYPES[args.dtype],
        seed=args.seed,
        window=args.window if args.model == "gemma-like" else None,
    )
    need = Workload.blocks_per_request(cfg)
    if cfg.num_blocks < need:
        raise NpuGraphError(
            f"--num-blocks {cfg.num_blocks} holds no request: one request of this demo takes up to {need} blocks of "
            f"{cfg.block_size} tokens (--max-model-len {cfg.max_model_len}); give at least {need}, and about "
            f"{need * max(args.sizes)} to fill the largest size"
        )
    if max(args.sizes) > cfg.num_blocks:
        # the demo decodes one token per request, and every request holds a block at least
        raise NpuGraphError(
            f"--sizes {max(args.sizes)} exceeds --num-blocks {cfg.num_blocks}: each request of this demo takes "
            f"a token of the graph and at least one block, so at most {cfg.num_blocks} of its rows could ever "
            f"hold a request; give sizes up to {cfg.num_blocks}, or more blocks"
        )
    rt = Runtime(
        args.device,
        max_model_len=cfg.max_model_len,
        order=args.order,
        progress=not args.no_progress,
        postmortem_dir=args.postmortem_dir,
    )
    policy = _policy(args.policy)
    if policy is not None:
        if isinstance(policy, MeasuredPolicy) and args.model != "mla":  # MLA has one kernel
            policy.check_shapes(
                heads=cfg.heads,
                kv_heads=cfg.kv_heads,
                head_size=cfg.head_size,
                dtype=str(cfg.dtype),
                block_size=cfg.block_size,
            )
        rt.set_policy(policy)
    widths = default_widths(cfg.block_size, cfg.max_model_len) if args.update_free else ()
    engine = DecodeEngine(rt, _MODELS[args.model](cfg, rt), args.sizes, widths=widths)
    # made before the capture, so that a workload this config cannot run is refused first
    wl = Workload(cfg, engine.sizes, seed=args.seed, adversarial=args.adversarial is not None, device=rt.device.memory)
    run = demo.decode(
        engine,
        wl,
        steps=args.steps,
        reference_every=args.reference_every,
        dtype=args.dtype,
        progress=not args.no_progress,
    )
    settings = {"order": args.order, "dtype": args.dtype, "adversarial_seed": args.adversarial, "widths": list(widths)}
    summary = demo.report(run, engine, model=args.model, layers=cfg.layers, settings=settings)
    if args.json:
        write_text(args.json, json.dumps(summary, indent=1))
    if args.dump:
        rt.save_manifest(args.dump)
    return 1 if run.mismatches or run.reference_failures else 0


def cmd_selftest(args: argparse.Namespace) -> int:
    """Check the device behaviours npugraph relies on; exit 0 only if all pass."""
    if args.device == "sim":
        load_device("sim").ops.configure()
    info = versions(load_device(args.device))
    print(
        f"npugraph {__version__} selftest on {info['device']}: torch {info['torch']}, torch_npu {info['torch_npu']}, CANN {info['cann']}"
    )
    print(f"{'check':<28} {'result':<6} {'s':>5}  detail")

    def show(r: CheckResult) -> None:
        print(f"{r.name:<28} {'pass' if r.passed else 'FAIL':<6} {r.seconds:>5.1f}  {r.detail}", flush=True)

    results = run_selftest(args.device, progress=show)
    failed = [r for r in results if not r.passed]
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    if args.calibrate:
        costs = calibrate_costs(args.device)
        write_text(args.calibrate, json.dumps(costs, indent=1))
        note = " (the simulator's own costs: plumbing only, not a device's)" if args.device == "sim" else ""
        print(
            f"host costs per call written to {args.calibrate}{note}: "
            + ", ".join(f"{k} {v:.1f} us" for k, v in costs.items() if k != "device")
        )
    if args.json:
        doc = {
            "versions": info,
            "checks": [{"name": r.name, "passed": r.passed, "detail": r.detail, "seconds": r.seconds} for r in results],
        }
        write_text(args.json, json.dumps(doc, indent=1))
    return 1 if failed else 0


def cmd_bench(args: argparse.Namespace) -> int:
    """The modeled timeline (npugraph vs UpdatableGraph vs the older loop), then the measured
    host cost of the update path against the floor, and validation's share."""
    # the benchmarks run on the simulator (npusim): imported by this command alone
    from npugraph.bench import plot, report

    if args.plot:
        plot.require_matplotlib()  # refused before minutes of work, not after
    if args.from_json:
        if not args.plot or args.json or args.timeline:
            raise NpuGraphError("--from-json FILE runs no benchmark, it draws FILE's chart: give --plot PATH alone")
        plot.plot_bench(read_json(args.from_json, "bench result"), args.plot, what=args.from_json)
        print(f"chart of {args.from_json}: {args.plot}")
        return 0
    host_costs = None
    if args.costs:
        host_costs = read_json(args.costs, "host-cost calibration")
        if not isinstance(host_costs, dict):
            raise NpuGraphError(f"{args.costs}: a calibration is a JSON object (npugraph selftest --calibrate FILE)")
    result = report.run(
        seeds=args.seeds,
        host_costs=host_costs,
        costs_path=args.costs,
        timeline=args.timeline,
        cost_models={"off": [False], "a2": [True], "both": [False, True]}[args.cost_model],
        layers=args.layers,
        sizes=args.sizes,
        repeats=args.repeats,
        extra=args.extra,
    )
    if args.json:
        write_text(args.json, json.dumps(result, indent=1))
    if args.plot:
        plot.plot_bench(result, args.plot)
        print(f"chart: {args.plot}")
    return 0


def cmd_policy(args: argparse.Namespace) -> int:
    """Measure a kernel policy and write it, or show one."""
    if args.policy_command == "measure":
        if args.device == "sim":
            print(
                "npugraph: measuring on the simulator: these are CPU timings of the simulated kernels, not an "
                "NPU's, and they choose by CPU noise; the file says device 'sim' and an NPU runtime refuses it. "
                "Measure on an Ascend host with --device npu.",
                file=sys.stderr,
            )
        repeats = 3 if args.quick else args.repeats
        print(
            f"timing PA and FIA at {len(args.sizes)} sizes, {repeats} replays each (on the simulator the time "
            "grows with the size: sizes 1-32 at 32 heads x 128 x 4096 take about 40 s with --quick, twice that "
            "without)",
            file=sys.stderr,
            flush=True,
        )
        started = time.perf_counter()

        def show(size: int, m: Any) -> None:
            print(
                f"size {size:>4}: PA {m.pa_median:>9.1f} us  FIA {m.fia_median:>9.1f} us  "
                f"({time.perf_counter() - started:.0f} s so far)",
                flush=True,
            )

        policy = measure_policy(
            args.sizes,
            device=args.device,
            heads=args.heads,
            kv_heads=args.kv_heads,
            head_size=args.head_size,
            block_size=args.block_size,
            max_model_len=args.max_model_len,
            dtype=_DTYPES[args.dtype],
            repeats=repeats,
            warmup=1 if args.quick else 2,
            margin=args.margin,
            progress=show,
        )
        policy.save(args.out)
        print(f"wrote {args.out}")
    else:
        policy = load_policy(args.file)
        sig = policy.signature
        print(
            f"policy for {sig.heads} heads / {sig.kv_heads} kv heads, head size {sig.head_size}, {sig.dtype}, "
            f"block {sig.block_size}, device {sig.device}; margin {policy.margin:.0%}"
        )
    for size, choice in sorted(policy.choices.items()):
        print(f"{size:>5}  {choice.kernel:>8}  {choice.reason}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="npugraph", description=__doc__)
    p.add_argument("--version", action="version", version=f"npugraph {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    _demo_parser(sub)
    _selftest_parser(sub)
    _bench_parser(sub)
    dump_cli.add_parser(sub)
    _policy_parser(sub)
    return p


def _demo_parser(sub: Any) -> None:
    """`npugraph demo`."""
    d = sub.add_parser("demo", help="capture a decoder and decode with replay, checked against eager")
    _model_args(d)
    d.add_argument(
        "--model",
        choices=sorted(_MODELS),
        default="gqa",
        help="gqa (Llama-style), mla (DeepSeek-style absorbed MLA), gemma-like (sliding-window layers, "
        "every 4th global) (default gqa)",
    )
    d.add_argument("--window", type=_positive, default=64, help="gemma-like: the sliding window (default 64)")
    d.add_argument(
        "--reference-every",
        type=_positive,
        default=10,
        metavar="N",
        help="also check every Nth step against the float64-attention reference (default 10)",
    )
    d.add_argument("--steps", type=_positive, default=200, help="decode steps (default 200)")
    d.add_argument(
        "--update-free",
        action="store_true",
        help="also capture each size update-free (FIA's lengths frozen to widths, powers of two from the block "
        "size to --max-model-len, the real ones masked on the device); a step replays the narrowest that holds it",
    )
    d.add_argument(
        "--order",
        choices=["update-first", "replay-first"],
        default="replay-first",
        help="issue the update before or after enqueuing the replay",
    )
    d.add_argument(
        "--adversarial",
        type=int,
        default=None,
        metavar="SEED",
        help="simulator: defer and interleave streams in a seeded random order",
    )
    d.add_argument("--json", metavar="PATH", type=_out_path, help="write a machine-readable summary")
    d.add_argument("--dump", metavar="PATH", type=_out_path, help="write the capture manifest")
    d.add_argument("--postmortem-dir", default=None, help="write a post-mortem here when a step fails")
    d.add_argument("--no-progress", action="store_true", help="no progress bars")
    d.set_defaults(func=cmd_demo)


def _selftest_parser(sub: Any) -> None:
    """`npugraph selftest`."""
    t = sub.add_parser("selftest", help="check the device behaviours npugraph relies on (run this first on Ascend)")
    t.add_argument("--device", default="sim", choices=["sim", "npu"])
    t.add_argument("--json", metavar="PATH", type=_out_path, help="write the results as JSON")
    t.add_argument(
        "--calibrate",
        metavar="FILE",
        type=_out_path,
        help="also measure the host cost of each device-API call here, for npugraph bench --costs FILE",
    )
    t.set_defaults(func=cmd_selftest)


def _bench_parser(sub: Any) -> None:
    """`npugraph bench`."""
    b = sub.add_parser("bench", help="modeled step timeline and measured update cost, npugraph vs baselines")
    b.add_argument("--layers", type=_sizes, default=[32, 64], help="measured: layer counts (default 32,64)")
    b.add_argument("--sizes", type=_sizes, default=[1, 8], help="measured: batch sizes (default 1,8)")
    b.add_argument(
        "--cost-model", choices=["off", "a2", "both"], default="off", help="measured: host-cost model (default off)"
    )
    b.add_argument("--timeline", metavar="FILE", type=_out_path, help="write a Chrome trace of every modeled shape")
    b.add_argument("--repeats", type=_positive, default=15, help="measured steps per method (default 15)")
    b.add_argument("--extra", action="store_true", help="also measure capture cost and replay vs eager")
    b.add_argument("--json", metavar="PATH", type=_out_path, help="write rows and summary as JSON")
    b.add_argument(
        "--plot",
        metavar="PATH",
        type=_out_path,
        help="draw the modeled steps/s as a PNG chart (needs matplotlib: pip install 'npugraph[plot]')",
    )
    b.add_argument(
        "--from-json",
        metavar="FILE",
        type=_in_file,
        help="with --plot: draw the chart of a JSON that --json wrote, running nothing",
    )
    b.add_argument(
        "--costs", metavar="FILE", type=_in_file, help="model with these host costs (npugraph selftest --calibrate)"
    )
    b.add_argument("--seeds", type=_positive, default=5, help="modeled: runs per shape, for the spread (default 5)")
    b.set_defaults(func=cmd_bench)


def _policy_parser(sub: Any) -> None:
    """`npugraph policy measure | show`."""
    pol = sub.add_parser("policy", help="measure, save and show the PA/FIA choice per size")
    ps = pol.add_subparsers(dest="policy_command", required=True)
    m = ps.add_parser("measure", help="time PA and FIA per size and write a policy file")
    attention_shape_args(m)
    m.add_argument("--repeats", type=_positive, default=7, help="replays timed per kernel and size (default 7)")
    m.add_argument("--quick", action="store_true", help="3 replays and 1 warm-up per kernel and size")
    m.add_argument("--margin", type=_fraction, default=0.05, help="relative near-tie band that keeps the default")
    m.add_argument("--out", required=True, type=_out_path, help="policy JSON to write")
    s = ps.add_parser("show", help="print a policy file's choice per size")
    s.add_argument("file", type=_in_file)
    pol.set_defaults(func=cmd_policy)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``npugraph`` command line; return its exit status.

    Errors become one line on stderr (exit 2), never a traceback; set
    ``NPUGRAPH_DEBUG=1`` to see the traceback of an unexpected one.
    """
    args = build_parser().parse_args(argv)
    if getattr(args, "device", "sim") == "sim" and not os.environ.get("OMP_NUM_THREADS"):
        # The simulator's kernels are small: one intra-op thread; a pool of spinning OpenMP
        # workers only contends with the host work on a busy machine (OMP_NUM_THREADS overrides).
        torch.set_num_threads(1)
    try:
        return int(args.func(args))
    except (NpuGraphError, OSError) as exc:
        print(f"npugraph: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("npugraph: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if os.environ.get("NPUGRAPH_DEBUG"):
            raise
        print(
            f"npugraph: internal error: {type(exc).__name__}: {' '.join(str(exc).split())} "
            "(set NPUGRAPH_DEBUG=1 for the traceback)",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
