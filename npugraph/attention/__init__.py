"""Thin attention clients: a backend calls the runtime and never touches graph internals."""

from __future__ import annotations

import torch

from npugraph.errors import ConfigError
from npugraph.metadata import AttentionMetadata
from npugraph.ops import AttentionCall
from npugraph.runtime import Runtime

__all__ = ["DecodeAttention", "MLAAttention", "AttentionMetadata"]


class _Client:
    """What every attention client is: a named layer of one namespace and KV-cache group."""

    def __init__(
        self,
        runtime: Runtime,
        layer_name: str,
        *,
        scale: float,
        namespace: str,
        group: str,
        tokens_per_request: int,
    ) -> None:
        self.runtime = runtime
        self.layer_name = layer_name
        self.scale = scale
        self.namespace = namespace
        self.group = group
        self.tokens_per_request = tokens_per_request

    def _run(self, call: AttentionCall, meta: AttentionMetadata, ubatch: int) -> torch.Tensor:
        self.runtime.attention(self.layer_name, call, meta, namespace=self.namespace, group=self.group, ubatch=ubatch)
        return call.out


class DecodeAttention(_Client):
    """Decode attention over a paged KV cache, through the runtime (PA or FIA).

    Eager outside capture, recorded as an updatable task inside it; the layer never
    sees task groups, events or workspaces.  ``window``: a sliding-window layer (it sees
    the last ``window`` keys; put such layers in their own KV-cache ``group``).
    ``tokens_per_request`` > 1: speculative verification (causal within each request).
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
        window: int | None = None,
    ) -> None:
        if window is not None and window < 1:
            raise ConfigError(f"layer {layer_name!r}: window must be >= 1, got {window}")
        if num_kv_heads < 1 or num_heads < 1 or num_heads % num_kv_heads:
            # refused here, not at capture: PA and FIA share each KV head among num_heads / num_kv_heads
            raise ConfigError(
                f"layer {layer_name!r}: num_heads ({num_heads}) must be a positive multiple of "
                f"num_kv_heads ({num_kv_heads})"
            )
        super().__init__(
            runtime,
            layer_name,
            scale=scale if scale is not None else head_size**-0.5,
            namespace=namespace,
            group=group,
            tokens_per_request=tokens_per_request,
        )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.window = window

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
        return self._run(
            AttentionCall(
                query=query,
                key_cache=key_cache,
                value_cache=value_cache,
                block_table=meta.block_table,
                out=out,
                num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads,
                scale=self.scale,
                tokens_per_request=self.tokens_per_request,
                window=self.window,
            ),
            meta,
            ubatch,
        )


class MLAAttention(_Client):
    """Absorbed MLA (DeepSeek-style) decode attention, through the runtime (FIA with rope).

    The cache holds one latent vector (``kv_lora_rank``) and one rope key (``rope_dim``)
    per token; queries come as their latent part and their rope part.  One KV head.
    """

    def __init__(
        self,
        runtime: Runtime,
        layer_name: str,
        *,
        num_heads: int,
        kv_lora_rank: int,
        rope_dim: int,
        scale: float | None = None,
        namespace: str = "main",
        group: str = "default",
        tokens_per_request: int = 1,
    ) -> None:
        super().__init__(
            runtime,
            layer_name,
            scale=scale if scale is not None else (kv_lora_rank + rope_dim) ** -0.5,  # the score's dimension
            namespace=namespace,
            group=group,
            tokens_per_request=tokens_per_request,
        )
        self.num_heads = num_heads

    def __call__(
        self,
        q_latent: torch.Tensor,
        q_rope: torch.Tensor,
        latent_cache: torch.Tensor,
        rope_cache: torch.Tensor,
        meta: AttentionMetadata,
        ubatch: int = 0,
    ) -> torch.Tensor:
        """``q_latent [T, N, R]``, ``q_rope [T, N, Dr]``, caches ``[blocks, block_size, 1, R|Dr]``;
        returns ``[T, N, R]`` in the latent space."""
        return self._run(
            AttentionCall(
                query=q_latent,
                key_cache=latent_cache,
                value_cache=latent_cache,
                block_table=meta.block_table,
                out=q_latent.new_empty(q_latent.shape),
                num_heads=self.num_heads,
                num_kv_heads=1,
                scale=self.scale,
                tokens_per_request=self.tokens_per_request,
                query_rope=q_rope,
                key_rope_cache=rope_cache,
            ),
            meta,
            ubatch,
        )
