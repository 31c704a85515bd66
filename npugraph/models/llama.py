"""A small Llama-style decoder over a paged KV cache, with random weights.

Embeddings, RMSNorm, RoPE, GQA attention through :class:`~npugraph.attention.DecodeAttention`
(PA or FIA, chosen by the runtime), KV-cache writes in the forward, SwiGLU MLP, LM head.
Block 0 of the cache is reserved as the null block: padding tokens write there.
"""

from __future__ import annotations

import attrs
import torch
from torch import nn

from npugraph.attention import DecodeAttention
from npugraph.replay.lens import AttentionMetadata
from npugraph.runtime import Runtime

__all__ = ["DecoderConfig", "Decoder"]


@attrs.frozen(kw_only=True)
class DecoderConfig:
    """Sizes of the decoder and its KV cache."""

    vocab_size: int = 512
    layers: int = 8
    heads: int = 4
    kv_heads: int = 2
    head_size: int = 64
    intermediate: int = 512
    block_size: int = 16
    num_blocks: int = 256
    max_model_len: int = 512
    dtype: torch.dtype = torch.bfloat16
    rope_theta: float = 10000.0
    seed: int = 0

    @property
    def hidden(self) -> int:
        return self.heads * self.head_size

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
        return xf.to(x.dtype) * self.weight


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [T, H, D]; cos/sin [T, D/2]
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


class _Layer(nn.Module):
    def __init__(self, cfg: DecoderConfig, runtime: Runtime, name: str, namespace: str) -> None:
        super().__init__()
        h, d = cfg.hidden, cfg.head_size
        dt, dev = cfg.dtype, runtime.device.memory
        self.cfg = cfg
        self.norm1 = _RMSNorm(h, dt, dev)
        self.norm2 = _RMSNorm(h, dt, dev)
        self.qkv = nn.Linear(h, (cfg.heads + 2 * cfg.kv_heads) * d, bias=False, dtype=dt, device=dev)
        self.o = nn.Linear(cfg.heads * d, h, bias=False, dtype=dt, device=dev)
        self.gate_up = nn.Linear(h, 2 * cfg.intermediate, bias=False, dtype=dt, device=dev)
        self.down = nn.Linear(cfg.intermediate, h, bias=False, dtype=dt, device=dev)
        shape = (cfg.num_blocks, cfg.block_size, cfg.kv_heads, d)
        self.k_cache = torch.zeros(shape, dtype=dt, device=dev)
        self.v_cache = torch.zeros(shape, dtype=dt, device=dev)
        self.attn = DecodeAttention(
            runtime,
            name,
            num_heads=cfg.heads,
            num_kv_heads=cfg.kv_heads,
            head_size=d,
            namespace=namespace,
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slot_mapping: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        cfg = self.cfg
        t = x.shape[0]
        qkv = self.qkv(self.norm1(x))
        q, k, v = qkv.split(
            [cfg.heads * cfg.head_size, cfg.kv_heads * cfg.head_size, cfg.kv_heads * cfg.head_size],
            dim=-1,
        )
        q = _rope(q.reshape(t, cfg.heads, cfg.head_size), cos, sin)
        k = _rope(k.reshape(t, cfg.kv_heads, cfg.head_size), cos, sin)
        v = v.reshape(t, cfg.kv_heads, cfg.head_size)
        flat = (-1, cfg.kv_heads, cfg.head_size)
        self.k_cache.view(flat).index_copy_(0, slot_mapping, k)
        self.v_cache.view(flat).index_copy_(0, slot_mapping, v)
        a = self.attn(q, self.k_cache, self.v_cache, meta)
        x = x + self.o(a.reshape(t, -1))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(torch.nn.functional.silu(gate) * up)


class Decoder(nn.Module):
    """``forward(input_ids, positions, slot_mapping, meta) -> logits [T, vocab] (float32)``."""

    def __init__(self, cfg: DecoderConfig, runtime: Runtime, namespace: str = "main") -> None:
        super().__init__()
        self.cfg = cfg
        dev = runtime.device.memory
        gen = torch.Generator().manual_seed(cfg.seed)  # weights drawn on the host: the same on every device
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden, dtype=cfg.dtype, device=dev)
        self.layers = nn.ModuleList(
            _Layer(cfg, runtime, f"{namespace}.layers.{i}.attn", namespace) for i in range(cfg.layers)
        )
        self.norm = _RMSNorm(cfg.hidden, cfg.dtype, dev)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False, dtype=cfg.dtype, device=dev)
        with torch.no_grad():
            for p in self.parameters():
                if p.dim() > 1:
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32, device="cpu") * 0.05)
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_size, 2, device=dev).float() / cfg.head_size))
        ang = torch.arange(cfg.max_model_len, device=dev).float().unsqueeze(1) * inv.unsqueeze(0)
        self.cos = ang.cos()
        self.sin = ang.sin()

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.embed(input_ids)
        cos, sin = self.cos[positions], self.sin[positions]
        for layer in self.layers:
            x = layer(x, cos, sin, slot_mapping, meta)
        return self.lm_head(self.norm(x)).float()

    def reset_cache(self) -> None:
        for layer in self.layers:
            assert isinstance(layer, _Layer)
            layer.k_cache.zero_()
            layer.v_cache.zero_()
