"""Small decoders over a paged KV cache, with random weights: Llama-style GQA, Gemma-like
sliding-window layers, and DeepSeek-style absorbed MLA.

Embeddings, RMSNorm, RoPE, attention through npugraph's clients (PA or FIA, chosen by the
runtime), KV-cache writes in the forward (the device's ``npu_scatter_pa_kv_cache``, which
skips the padding slot ``PAD_SLOT_ID = -1``, so padding tokens write nowhere and every
block of the cache may belong to a request), SwiGLU MLP, LM head.

Every decoder also has :meth:`Decoder.reference_logits`: the same weights with attention
from :func:`npugraph.reference.paged_attention_reference` on copies of the caches — no
npugraph padding, conversion, op declaration or simulator kernel on that path.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch
from torch import nn

from npugraph.attention import DecodeAttention, MLAAttention
from npugraph.errors import ConfigError
from npugraph.metadata import AttentionMetadata
from npugraph.reference import paged_attention_reference
from npugraph.runtime import Runtime

__all__ = ["DecoderConfig", "Decoder", "MLADecoder"]


@attrs.frozen(kw_only=True)
class DecoderConfig:
    """Sizes of the decoder and its KV cache.

    ``window``: Gemma-like — every ``global_every``-th layer attends globally (KV-cache
    group ``"global"``), the others over the last ``window`` keys (group ``"window"``).
    ``kv_lora_rank`` / ``rope_dim``: the MLA decoder's latent and rope sizes.
    """

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
    window: int | None = None
    global_every: int = 4
    kv_lora_rank: int = 64
    rope_dim: int = 16

    @property
    def hidden(self) -> int:
        return self.heads * self.head_size

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    def window_of(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (``None``: a global layer)."""
        if self.window is None or (layer + 1) % self.global_every == 0:
            return None
        return self.window

    def group_of(self, layer: int) -> str:
        if self.window is None:
            return "default"
        return "global" if self.window_of(layer) is None else "window"


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


def _reference_write(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """A copy of ``cache`` with ``values`` written at ``slots``, position by position
    (a negative slot is padding: written nowhere)."""
    out = cache.clone()
    bs = cache.shape[1]
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            out[s // bs, s % bs] = values[i]
    return out


class _Layer(nn.Module):
    """One decoder layer; subclasses say how attention is computed (``_attend``)."""

    def __init__(self, cfg: DecoderConfig, runtime: Runtime) -> None:
        super().__init__()
        h, dt, dev = cfg.hidden, cfg.dtype, runtime.device.memory
        self.cfg = cfg
        self.ops = runtime.device.ops  # the KV-cache write kernel
        self.norm1 = _RMSNorm(h, dt, dev)
        self.norm2 = _RMSNorm(h, dt, dev)
        self.gate_up = nn.Linear(h, 2 * cfg.intermediate, bias=False, dtype=dt, device=dev)
        self.down = nn.Linear(cfg.intermediate, h, bias=False, dtype=dt, device=dev)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self._attend(self.norm1(x), cos, sin, slot_mapping, meta)
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(torch.nn.functional.silu(gate) * up)

    def reference(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ref: _RefStep) -> torch.Tensor:
        x = x + self._reference_attend(self.norm1(x), cos, sin, ref)
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(torch.nn.functional.silu(gate) * up)

    def _attend(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        raise NotImplementedError

    def _reference_attend(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ref: _RefStep) -> torch.Tensor:
        raise NotImplementedError


@attrs.frozen(kw_only=True)
class _RefStep:
    """What the reference needs of a step: the real tokens' slots, lengths and table."""

    slots: torch.Tensor
    seq_lens: list[int]
    query_lens: list[int]
    block_table: torch.Tensor


class _GQALayer(_Layer):
    def __init__(self, cfg: DecoderConfig, runtime: Runtime, name: str, namespace: str, index: int) -> None:
        super().__init__(cfg, runtime)
        d, dt, dev = cfg.head_size, cfg.dtype, runtime.device.memory
        self.qkv = nn.Linear(cfg.hidden, (cfg.heads + 2 * cfg.kv_heads) * d, bias=False, dtype=dt, device=dev)
        self.o = nn.Linear(cfg.heads * d, cfg.hidden, bias=False, dtype=dt, device=dev)
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
            group=cfg.group_of(index),
            window=cfg.window_of(index),
        )

    def _qkv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cfg, t = self.cfg, h.shape[0]
        q, k, v = self.qkv(h).split(
            [cfg.heads * cfg.head_size, cfg.kv_heads * cfg.head_size, cfg.kv_heads * cfg.head_size], dim=-1
        )
        q = _rope(q.reshape(t, cfg.heads, cfg.head_size), cos, sin)
        k = _rope(k.reshape(t, cfg.kv_heads, cfg.head_size), cos, sin)
        return q, k, v.reshape(t, cfg.kv_heads, cfg.head_size)

    def _attend(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self._qkv(h, cos, sin)
        self.ops.npu_scatter_pa_kv_cache(k.contiguous(), v.contiguous(), self.k_cache, self.v_cache, slots)
        a = self.attn(q, self.k_cache, self.v_cache, meta)
        return self.o(a.reshape(h.shape[0], -1))

    def _reference_attend(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ref: _RefStep) -> torch.Tensor:
        q, k, v = self._qkv(h, cos, sin)
        kc, vc = _reference_write(self.k_cache, ref.slots, k), _reference_write(self.v_cache, ref.slots, v)
        a = paged_attention_reference(
            q, kc, vc, ref.block_table, ref.seq_lens, self.attn.scale, ref.query_lens, window=self.attn.window
        )
        return self.o(a.to(h.device, h.dtype).reshape(h.shape[0], -1))  # the host reference, back on the device


class _MLALayer(_Layer):
    """Absorbed MLA: queries and the cache live in the latent space (W_UK, W_UV absorbed)."""

    def __init__(self, cfg: DecoderConfig, runtime: Runtime, name: str, namespace: str, index: int) -> None:
        super().__init__(cfg, runtime)
        r, dr, dt, dev = cfg.kv_lora_rank, cfg.rope_dim, cfg.dtype, runtime.device.memory
        self.q = nn.Linear(cfg.hidden, cfg.heads * (r + dr), bias=False, dtype=dt, device=dev)
        self.kv = nn.Linear(cfg.hidden, r + dr, bias=False, dtype=dt, device=dev)
        self.o = nn.Linear(cfg.heads * r, cfg.hidden, bias=False, dtype=dt, device=dev)
        self.latent_cache = torch.zeros(cfg.num_blocks, cfg.block_size, 1, r, dtype=dt, device=dev)
        self.rope_cache = torch.zeros(cfg.num_blocks, cfg.block_size, 1, dr, dtype=dt, device=dev)
        self.attn = MLAAttention(
            runtime,
            name,
            num_heads=cfg.heads,
            kv_lora_rank=r,
            rope_dim=dr,
            namespace=namespace,
            group=cfg.group_of(index),
        )

    def _project(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cfg, t = self.cfg, h.shape[0]
        r, dr = cfg.kv_lora_rank, cfg.rope_dim
        q = self.q(h).reshape(t, cfg.heads, r + dr)
        q_lat, q_pe = q.split([r, dr], dim=-1)
        c, k_pe = self.kv(h).split([r, dr], dim=-1)
        return q_lat.contiguous(), _rope(q_pe, cos, sin), c.reshape(t, 1, r), _rope(k_pe.reshape(t, 1, dr), cos, sin)

    def _attend(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        q_lat, q_pe, c, k_pe = self._project(h, cos, sin)
        # the latent vector as "key" and the rope key as "value": one write of both caches
        self.ops.npu_scatter_pa_kv_cache(c.contiguous(), k_pe.contiguous(), self.latent_cache, self.rope_cache, slots)
        a = self.attn(q_lat, q_pe, self.latent_cache, self.rope_cache, meta)
        return self.o(a.reshape(h.shape[0], -1))

    def _reference_attend(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ref: _RefStep) -> torch.Tensor:
        q_lat, q_pe, c, k_pe = self._project(h, cos, sin)
        lat = _reference_write(self.latent_cache, ref.slots, c)
        rope = _reference_write(self.rope_cache, ref.slots, k_pe)
        keys = torch.cat([lat, rope], dim=-1)  # score = q_lat . c + q_pe . k_pe
        a = paged_attention_reference(
            torch.cat([q_lat, q_pe], dim=-1), keys, lat, ref.block_table, ref.seq_lens, self.attn.scale, ref.query_lens
        )
        return self.o(a.to(h.device, h.dtype).reshape(h.shape[0], -1))  # the host reference, back on the device


class Decoder(nn.Module):
    """``forward(input_ids, positions, slot_mapping, meta) -> logits [T, vocab] (float32)``.

    GQA layers (sliding-window ones too, when ``cfg.window`` is set).
    """

    rope_width: str = "head_size"

    def __init__(self, cfg: DecoderConfig, runtime: Runtime, namespace: str = "main") -> None:
        super().__init__()
        width = int(getattr(cfg, self.rope_width))
        if width < 2 or width % 2:
            raise ConfigError(
                f"{self.rope_width} must be even (the rotary embedding turns pairs of dimensions), got {width}"
            )
        self.cfg = cfg
        dev = runtime.device.memory
        gen = torch.Generator().manual_seed(cfg.seed)  # weights drawn on the host: the same on every device
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden, dtype=cfg.dtype, device=dev)
        self.layers = nn.ModuleList(
            self._layer(cfg, runtime, f"{namespace}.layers.{i}.attn", namespace, i) for i in range(cfg.layers)
        )
        self.norm = _RMSNorm(cfg.hidden, cfg.dtype, dev)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False, dtype=cfg.dtype, device=dev)
        with torch.no_grad():
            for p in self.parameters():
                if p.dim() > 1:
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32, device="cpu") * 0.05)
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, width, 2, device=dev).float() / width))
        ang = torch.arange(cfg.max_model_len, device=dev).float().unsqueeze(1) * inv.unsqueeze(0)
        self.cos = ang.cos()
        self.sin = ang.sin()

    def _layer(self, cfg: DecoderConfig, runtime: Runtime, name: str, namespace: str, index: int) -> _Layer:
        return _GQALayer(cfg, runtime, name, namespace, index)

    @property
    def groups(self) -> tuple[str, ...]:
        """The KV-cache groups of the layers (what a step's metadata is keyed by)."""
        return tuple(dict.fromkeys(self.cfg.group_of(i) for i in range(self.cfg.layers)))

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

    @torch.no_grad()
    def reference_logits(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        seq_lens: Sequence[int],
        query_lens: Sequence[int],
        block_table: torch.Tensor,
    ) -> torch.Tensor:
        """Logits of the real tokens (``sum(query_lens)``), attention from the float64
        reference on copies of the caches (the caches are not changed)."""
        n = sum(query_lens)
        if n == 0:  # no real token: no logits
            return torch.zeros(0, self.cfg.vocab_size, dtype=torch.float32, device=input_ids.device)
        # a check, not a model path: the step's inputs may be the host's; the model reads them on its device
        dev = self.embed.weight.device
        input_ids, positions, slot_mapping = (t.to(dev) for t in (input_ids, positions, slot_mapping))
        ref = _RefStep(
            slots=slot_mapping[:n], seq_lens=list(seq_lens), query_lens=list(query_lens), block_table=block_table
        )
        x = self.embed(input_ids[:n])
        cos, sin = self.cos[positions[:n]], self.sin[positions[:n]]
        for layer in self.layers:
            assert isinstance(layer, _Layer)
            x = layer.reference(x, cos, sin, ref)
        head = self.lm_head
        return getattr(head, "inner", head)(self.norm(x)).float()


class MLADecoder(Decoder):
    """The decoder with absorbed-MLA layers (DeepSeek-style): one latent KV head, FIA with rope."""

    rope_width = "rope_dim"

    def _layer(self, cfg: DecoderConfig, runtime: Runtime, name: str, namespace: str, index: int) -> _Layer:
        return _MLALayer(cfg, runtime, name, namespace, index)
