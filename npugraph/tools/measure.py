"""Measure a kernel policy: time one captured attention layer with PA and with FIA per size.

This runs a model on the runtime, so it sits above the runtime (next to the CLI);
choosing with the result (:class:`npugraph.policy.MeasuredPolicy`) is pure and sits below capture.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from npugraph.device import load_device
from npugraph.metadata import AttentionMetadata
from npugraph.models.stack import AttentionStack
from npugraph.policy import FixedPolicy, KernelChoice, MeasuredPolicy, PolicySignature, SizeMeasurement, StaticPolicy
from npugraph.runtime import Runtime

__all__ = ["measure_policy"]


def _time_kernel(
    device: str, kernel: str, size: int, cfg: Mapping[str, Any], lengths: Sequence[Sequence[int]], warmup: int
) -> list[float]:
    """Device time (us) of replays of a one-layer graph using ``kernel`` at ``size``."""

    # update-first: the timed replay then waits for nothing but the device
    rt = Runtime(device, max_model_len=cfg["max_model_len"], policy=FixedPolicy(kernel), order="update-first")
    stack = AttentionStack(
        rt,
        layers=1,
        heads=cfg["heads"],
        kv_heads=cfg["kv_heads"],
        head_size=cfg["head_size"],
        block_size=cfg["block_size"],
        num_blocks=cfg["num_blocks"],
        dtype=cfg["dtype"],
    )
    cols = -(-cfg["max_model_len"] // cfg["block_size"])
    gen = torch.Generator().manual_seed(size)
    dev = rt.device.memory
    # drawn on the host (reproducible on every device), then placed where the kernel reads them
    table = torch.randint(0, cfg["num_blocks"], (size, cols), dtype=torch.int32, generator=gen, device="cpu").to(dev)
    q = torch.randn(size, cfg["heads"], cfg["head_size"], generator=gen, device="cpu").to(
        dtype=cfg["dtype"], device=dev
    )
    ones = torch.ones(size, dtype=torch.int32, device="cpu")
    rt.capture(stack, q, AttentionMetadata(seq_lens=ones, block_table=table), key=size)
    npu = rt.device.npu
    start, end = npu.Event(enable_timing=True), npu.Event(enable_timing=True)
    out = []
    for i, lens in enumerate(lengths):
        meta = AttentionMetadata(seq_lens=torch.tensor(lens, dtype=torch.int32, device="cpu"), block_table=table)
        start.record(npu.current_stream())
        rt.step(size, {"default": meta})  # the update lands on its own stream before the replay runs
        end.record(npu.current_stream())
        rt.synchronize()
        if i >= warmup:
            out.append(start.elapsed_time(end) * 1e3)  # ms → us
    rt.reset()
    return out


def measure_policy(
    sizes: Sequence[int],
    *,
    device: str = "sim",
    heads: int,
    kv_heads: int,
    head_size: int,
    block_size: int,
    max_model_len: int,
    dtype: torch.dtype = torch.float16,
    num_blocks: int | None = None,
    repeats: int = 7,
    warmup: int = 2,
    margin: float = 0.05,
    default: StaticPolicy | None = None,
    seed: int = 0,
    progress: Callable[[int, SizeMeasurement], None] | None = None,
) -> MeasuredPolicy:
    """Time one captured attention layer with PA and with FIA at each size; keep the faster.

    Lengths are drawn (seeded) over ``[1, max_model_len]``, the same for both kernels;
    each kernel's time is the median of ``repeats`` replays, read from device events.
    When the two are within ``margin`` (relative), the default policy's choice stands.
    """
    default = default or StaticPolicy()
    cfg = {
        "heads": heads,
        "kv_heads": kv_heads,
        "head_size": head_size,
        "block_size": block_size,
        "max_model_len": max_model_len,
        "dtype": dtype,
        "num_blocks": num_blocks or 64,
    }
    rng = random.Random(seed)
    choices: dict[int, KernelChoice] = {}
    meas: dict[int, SizeMeasurement] = {}
    for size in sorted(set(sizes)):
        lengths = [[rng.randint(1, max_model_len) for _ in range(size)] for _ in range(warmup + repeats)]
        m = SizeMeasurement(
            pa_us=tuple(_time_kernel(device, "pa", size, cfg, lengths, warmup)),
            fia_us=tuple(_time_kernel(device, "fia", size, cfg, lengths, warmup)),
        )
        meas[size] = m
        pa, fia = m.pa_median, m.fia_median
        if abs(pa - fia) <= margin * min(pa, fia):
            base = default.choose("", size, size, [])
            choices[size] = KernelChoice(
                kernel=base.kernel,
                reason=f"measured: PA {pa:.1f}us vs FIA {fia:.1f}us within {margin:.0%}; default keeps {base.kernel}",
            )
        else:
            k = "pa" if pa < fia else "fia"
            choices[size] = KernelChoice(kernel=k, reason=f"measured: PA {pa:.1f}us vs FIA {fia:.1f}us")
        if progress is not None:
            progress(size, m)

    sig = PolicySignature(
        heads=heads,
        kv_heads=kv_heads,
        head_size=head_size,
        dtype=str(dtype).replace("torch.", ""),
        block_size=block_size,
        device=load_device(device).name,
    )
    return MeasuredPolicy(signature=sig, choices=choices, measurements=meas, margin=margin, default=default)
