"""Thin attention clients: a backend calls the runtime and never touches graph internals."""

from __future__ import annotations

import torch

from npugraph.ops import AttentionCall
from npugraph.replay import AttentionMetadata
from npugraph.runtime import Runtime

__all__ = ["DecodeAttention", "AttentionMetadata"]


class DecodeAttention:
    """Decode attention over a paged KV cache, through the runtime (PA or FIA).

    Eager outside capture, recorded as an updatable task inside it; the layer never
    sees task groups, events or workspaces.
    """

    def __init__(
        self,
        runtime: Runtime,
        layer_name: str,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        scale: float | None = None,
        namespace: str = "main",
        group: str = "default",
        tokens_per_request: int = 1,
    ) -> None:
        self.runtime = runtime
        self.layer_name = layer_name
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.scale = scale if scale is not None else head_size**-0.5
        self.namespace = namespace
        self.group = group
        # > 1: speculative verification, each request's tokens attend causally (FIA)
        self.tokens_per_request = tokens_per_request

    def __call__(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        ubatch: int = 0,
    ) -> torch.Tensor:
        """Attend ``query [T, N, D]`` to the cached keys; return ``[T, N, Dv]``.

        ``ubatch``: the micro-batch index when one forward runs several through this layer.
        """
        out = query.new_empty(query.shape[:-1] + value_cache.shape[-1:])
        call = AttentionCall(
            query=query,
            key_cache=key_cache,
            value_cache=value_cache,
            block_table=meta.block_table,
            out=out,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            scale=self.scale,
            tokens_per_request=self.tokens_per_request,
        )
        self.runtime.attention(self.layer_name, call, meta, namespace=self.namespace, group=self.group, ubatch=ubatch)
        return out
