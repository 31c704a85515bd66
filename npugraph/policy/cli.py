"""``npugraph policy``: measure, save and show kernel policies."""

from __future__ import annotations

import argparse
from typing import Any

import torch

__all__ = ["add_parser", "run"]

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def add_parser(sub: Any) -> None:
    from npugraph.cli import attention_shape_args

    p = sub.add_parser("policy", help="measure, save and show the PA/FIA choice per size")
    ps = p.add_subparsers(dest="policy_command", required=True)
    m = ps.add_parser("measure", help="time PA and FIA per size and write a policy file")
    attention_shape_args(m)
    m.add_argument("--dtype", choices=sorted(_DTYPES), default="float16")
    m.add_argument("--repeats", type=int, default=7)
    m.add_argument("--margin", type=float, default=0.05, help="relative near-tie band that keeps the default")
    m.add_argument("--out", required=True, help="policy JSON to write")
    s = ps.add_parser("show", help="print a policy file's choice per size")
    s.add_argument("file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from npugraph.policy import load_policy, measure_policy

    if args.policy_command == "measure":

        def show(size: int, m: Any) -> None:
            print(f"size {size:>4}: PA {m.pa_median:>9.1f} us  FIA {m.fia_median:>9.1f} us", flush=True)

        policy = measure_policy(
            args.sizes,
            device=args.device,
            heads=args.heads,
            kv_heads=args.kv_heads,
            head_size=args.head_size,
            block_size=args.block_size,
            max_model_len=args.max_model_len,
            dtype=_DTYPES[args.dtype],
            repeats=args.repeats,
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
        print(f"{size:>5}  {choice.kernel:>3}  {choice.reason}")
    return 0
