"""Stand-in of vllm_ascend/attention/mla_v1.py (Aug 2026): the MLA decode metadata and
``AscendMLAImpl``'s decode (``forward``, ``_forward_decode``, ``_v_up_proj``) — the same
names, signatures and torch_npu calls (FIA v2 with rope arguments, ``BNSD_NBSD``; its own
recording while the forward context says ``capturing``); bodies of our own.  The real
``forward`` projects the hidden states and writes the latent cache first: here the
"hidden states" are the projected queries, ``[T, N, latent + rope]``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch_npu
from vllm.forward_context import get_forward_context

from vllm_ascend.compilation.acl_graph import get_graph_params


@dataclass
class AscendMLADecodeMetadata:
    block_table: torch.Tensor
    seq_lens_list: list
    actual_seq_lengths_q: list | None = None


@dataclass
class AscendMLAMetadata:
    num_decodes: int
    num_decode_tokens: int
    num_actual_tokens: int
    decode: AscendMLADecodeMetadata | None = None


def _capturing() -> bool:
    return bool(getattr(get_forward_context(), "capturing", False))


class AscendMLAImpl:
    def __init__(self, num_heads, scale, kv_lora_rank, qk_rope_head_dim, W_UV, layer_name=None, enable_kv_nz=False):
        self.num_heads = self.num_heads_padded = num_heads
        self.head_padding = 0
        self.num_kv_heads = 1
        self.scale = float(scale)
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, qk_rope_head_dim
        self.W_UV = W_UV  # [N, latent, v_head_dim]
        self.v_head_dim = W_UV.shape[-1]
        self.layer_name = layer_name
        self.enable_kv_nz = enable_kv_nz
        self.fa_quant_layer = False
        self.speculative_config = None

    def _v_up_proj(self, x):
        x = x.view(self.num_heads, -1, self.kv_lora_rank)
        x = torch_npu.npu_transpose_batchmatmul(x, self.W_UV, perm_y=(1, 0, 2))
        return x.reshape(-1, self.num_heads * self.v_head_dim)

    def _forward_decode(self, q_nope, q_pe, k_nope, k_pe, block_size, attn_metadata, dequant_scale_q_nope=None):
        decode = attn_metadata.decode
        num_tokens = q_nope.size(0)
        k_nope = k_nope.view(-1, self.num_kv_heads, block_size, self.kv_lora_rank)
        k_pe = k_pe.view(-1, self.num_kv_heads, block_size, self.qk_rope_head_dim)
        q_nope = q_nope.view(num_tokens, self.num_heads, 1, -1).contiguous()
        q_pe = q_pe.view(num_tokens, self.num_heads, 1, -1)
        common_kwargs = {
            "query_rope": q_pe,
            "key_rope": k_pe,
            "num_query_heads": self.num_heads_padded,
            "num_key_value_heads": self.num_kv_heads,
            "input_layout": "BNSD_NBSD",
            "atten_mask": None,
            "sparse_mode": 0,
            "softmax_scale": self.scale,
            "block_table": decode.block_table,
            "block_size": block_size,
            "actual_seq_qlen": None,
            "actual_seq_kvlen": decode.seq_lens_list,
        }
        if _capturing():  # its own recording: an event the graph waits on, a task group
            stream = torch_npu.npu.current_stream()
            event = torch.npu.ExternalEvent()
            event.wait(stream)
            event.reset(stream)
            params = get_graph_params()
            params.events[num_tokens].append(event)
            shape = (self.num_heads_padded, num_tokens, 1, self.kv_lora_rank)
            attn_output = torch.empty(shape, dtype=q_pe.dtype, device=q_pe.device)
            softmax_lse = torch.empty(num_tokens, dtype=q_pe.dtype, device=q_pe.device)
            workspace = torch_npu._npu_fused_infer_attention_score_v2_get_max_workspace(
                q_nope, k_nope, k_nope, **common_kwargs
            )
            torch.npu.graph_task_group_begin(stream)
            torch_npu.npu_fused_infer_attention_score_v2.out(
                q_nope, k_nope, k_nope, **common_kwargs, workspace=workspace, out=[attn_output, softmax_lse]
            )
            params.handles[num_tokens].append(torch.npu.graph_task_group_end(stream))
        else:
            attn_output, _ = torch_npu.npu_fused_infer_attention_score_v2(q_nope, k_nope, k_nope, **common_kwargs)
        return self._v_up_proj(attn_output)

    def forward(self, layer_name, hidden_states, kv_cache, attn_metadata, need_gather_q_kv=False, output=None):
        n = attn_metadata.num_decode_tokens
        q_nope, q_pe = hidden_states[:n].split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        output[:n] = self._forward_decode(q_nope, q_pe, kv_cache[0], kv_cache[1], kv_cache[0].shape[1], attn_metadata)
        return output
