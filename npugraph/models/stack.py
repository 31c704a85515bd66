"""A stack of decode-attention layers only: the smallest model whose update path is the product's.

Used by the benchmark and the kernel-policy measurement, where the rest of a decoder
would only add noise.
"""

from __future__ import annotations

import torch

from npugraph.attention import DecodeAttention
from npugraph.metadata import AttentionMetadata
from npugraph.runtime import Runtime

__all__ = ["AttentionStack"]


class AttentionStack:
    """``layers`` attention layers over their own paged caches; ``__call__`` runs them all."""

    def __init__(
        self,
        runtime: Runtime,
        *,
        layers: int,
        heads: int = 4,
        kv_heads: int = 1,
        head_size: int = 64,
        block_size: int = 128,
        num_blocks: int = 16,
        dtype: torch.dtype = torch.float16,
        namespace: str = "main",
        seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)  # drawn on the host: the same on every device
        shape = (num_blocks, block_size, kv_heads, head_size)
        dev = runtime.device.memory
        self.caches = [
            (
                torch.randn(shape, generator=gen, device="cpu").to(dtype=dtype, device=dev),
                torch.randn(shape, generator=gen, device="cpu").to(dtype=dtype, device=dev),
            )
            for _ in range(layers)
        ]
        self.attn = [
            DecodeAttention(
                runtime,
                f"{namespace}.layers.{i}.attn",
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_size=head_size,
                namespace=namespace,
            )
            for i in range(layers)
        ]
        self.heads, self.head_size, self.dtype = heads, head_size, dtype
        self.block_size, self.num_blocks = block_size, num_blocks

    def __call__(self, query: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = query
        for attn, (k, v) in zip(self.attn, self.caches):
            x = attn(x, k, v, meta)
        return x
