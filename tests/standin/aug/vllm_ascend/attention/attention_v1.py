"""Stand-in of vllm_ascend/attention/attention_v1.py (Aug 2026): AscendMetadata, the backend
and its impl with the graph recorders (``full_graph_pa`` / ``full_graph_fia`` /
``full_graph_fia_v2``) and the per-step ``update_graph_params`` — same names, signatures and
torch_npu calls; bodies of our own."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch_npu
from vllm.forward_context import get_forward_context

from vllm_ascend.compilation.acl_graph import get_graph_params, update_graph_params_workspaces

PA_SHAPE_LIST = (1, 2, 3, 4)


class AscendAttentionState(enum.Enum):
    PrefillNoCache = 0
    PrefillCacheHit = 1
    DecodeOnly = 2
    ChunkedPrefill = 3
    SpecDecoding = 4


@dataclass
class AscendMetadata:
    attn_mask: torch.Tensor | None = None
    attn_state: AscendAttentionState = AscendAttentionState.ChunkedPrefill
    num_actual_tokens: int = 0
    seq_lens: torch.Tensor = None
    seq_lens_cpu: torch.Tensor = None
    seq_lens_list: list = None
    actual_seq_lengths_q: list = None
    query_start_loc: torch.Tensor = None  # on the device
    max_query_len: int | None = None
    block_tables: torch.Tensor = None
    slot_mapping: torch.Tensor = None
    causal: bool = True


def using_paged_attention(num_tokens, vllm_config, head_size=None) -> bool:
    return num_tokens in PA_SHAPE_LIST


class AscendAttentionBackend:
    @staticmethod
    def get_impl_cls():
        return AscendAttentionBackendImpl


def _capturing() -> bool:
    return bool(getattr(get_forward_context(), "capturing", False))


class AscendAttentionBackendImpl:
    def __init__(
        self,
        num_heads,
        head_size,
        scale,
        num_kv_heads,
        alibi_slopes,
        sliding_window,
        kv_cache_dtype,
        logits_soft_cap,
        attn_type,
        kv_sharing_target_layer_name,
        **kwargs,
    ):
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.key_cache = self.value_cache = None
        self.sinks = None
        self.vllm_config = kwargs.get("vllm_config")

    def forward(
        self,
        layer,
        query,
        key,
        value,
        kv_cache,
        attn_metadata,
        output=None,
        output_scale=None,
        output_block_scale=None,
    ):
        self.key_cache, self.value_cache = kv_cache[0], kv_cache[1]
        num_tokens = query.shape[0]
        if attn_metadata.attn_state == AscendAttentionState.DecodeOnly and using_paged_attention(
            num_tokens, self.vllm_config
        ):
            out = self.forward_paged_attention(query, attn_metadata, output.view(num_tokens, self.num_heads, -1))
        else:
            out = self.forward_fused_infer_attention(query, key, value, attn_metadata, output, layer)
        return out.reshape(num_tokens, -1)

    def forward_paged_attention(self, query, attn_metadata, output=None):
        if _capturing():
            return self.full_graph_pa(query, attn_metadata, output)
        torch_npu._npu_paged_attention(
            query=query,
            key_cache=self.key_cache,
            value_cache=self.value_cache,
            num_kv_heads=self.num_kv_heads,
            num_heads=self.num_heads,
            scale_value=self.scale,
            block_table=attn_metadata.block_tables,
            context_lens=attn_metadata.seq_lens,
            out=output,
        )
        return output

    def _fia_kwargs(self, query, attn_metadata):
        nb, bs = self.key_cache.shape[:2]
        return {
            "query": query,
            "key": self.key_cache.view(nb, bs, -1),
            "value": self.value_cache.view(nb, bs, -1),
            "atten_mask": attn_metadata.attn_mask,
            "block_table": attn_metadata.block_tables,
            "input_layout": "TND",
            "block_size": bs,
            "actual_seq_lengths": attn_metadata.actual_seq_lengths_q,
            "actual_seq_lengths_kv": attn_metadata.seq_lens_list,
            "num_key_value_heads": self.num_kv_heads,
            "num_heads": self.num_heads,
            "scale": self.scale,
            "sparse_mode": 3,
        }

    def forward_fused_infer_attention(self, query, key, value, attn_metadata, output, layer=None):
        if _capturing():
            attn_output, num_tokens = self.full_graph_fia(query, key, value, attn_metadata, output, layer)
            return attn_output
        num_tokens = attn_metadata.actual_seq_lengths_q[-1]  # the query's rows past it are padding
        out, _ = torch_npu.npu_fused_infer_attention_score(**self._fia_kwargs(query[:num_tokens], attn_metadata))
        view = output.view(query.shape[0], self.num_heads, -1)
        view[:num_tokens] = out
        return view

    # --- the graph recorders (replaced by npugraph) --------------------------------------
    def full_graph_pa(self, query, attn_metadata, output=None):
        graph_params = get_graph_params()
        num_tokens = query.shape[0]
        kwargs = {
            "query": query,
            "key_cache": self.key_cache,
            "value_cache": self.value_cache,
            "num_kv_heads": self.num_kv_heads,
            "num_heads": self.num_heads,
            "scale_value": self.scale,
            "block_table": attn_metadata.block_tables,
            "context_lens": attn_metadata.seq_lens,
            "out": output,
        }
        workspace = torch_npu._npu_paged_attention_get_workspace(**kwargs)
        update_graph_params_workspaces(num_tokens, workspace)
        stream = torch_npu.npu.current_stream()
        event = torch.npu.ExternalEvent()
        event.wait(stream)
        event.reset(stream)
        graph_params.events[num_tokens].append(event)
        graph_params.attn_params[num_tokens].append(dict(kwargs))
        torch.npu.graph_task_group_begin(stream)
        torch_npu._npu_paged_attention(**kwargs, workspace=workspace)
        graph_params.handles[num_tokens].append(torch.npu.graph_task_group_end(stream))
        return output

    def full_graph_fia(self, query, key, value, attn_metadata, output, layer=None):
        graph_params = get_graph_params()
        num_tokens = attn_metadata.actual_seq_lengths_q[-1]
        kwargs = self._fia_kwargs(query, attn_metadata)
        kwargs["atten_mask"] = torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device=query.device), 1)
        workspace = torch_npu._npu_fused_infer_attention_score_get_max_workspace(**kwargs)
        out = output.view(query.shape[0], self.num_heads, -1)
        lse = torch.empty(1, dtype=query.dtype, device=query.device)
        stream = torch_npu.npu.current_stream()
        event = torch.npu.ExternalEvent()
        event.wait(stream)
        event.reset(stream)
        graph_params.events[query.shape[0]].append(event)
        graph_params.attn_params[query.shape[0]].append((kwargs, out, lse, workspace))
        torch.npu.graph_task_group_begin(stream)
        torch_npu.npu_fused_infer_attention_score.out(**kwargs, workspace=workspace, out=[out, lse])
        graph_params.handles[query.shape[0]].append(torch.npu.graph_task_group_end(stream))
        return out, num_tokens

    def full_graph_fia_v2(self, query, key, value, attn_metadata, output, layer=None):
        raise NotImplementedError("the stand-in records FIA v1 only")

    @staticmethod
    def update_graph_params(
        update_stream,
        forward_context,
        num_tokens,
        vllm_config,
        speculative_config=None,
        draft_attn_metadatas=None,
    ):
        """Re-issue every recorded task with this step's lengths, in the metadata dict's order."""
        graph_params = get_graph_params()
        metas = list(forward_context.attn_metadata.values())
        with torch.npu.stream(update_stream):
            for meta, params, handle, event in zip(
                metas,
                graph_params.attn_params[num_tokens],
                graph_params.handles[num_tokens],
                graph_params.events[num_tokens],
            ):
                torch.npu.graph_task_update_begin(update_stream, handle)
                if isinstance(params, dict):
                    torch_npu._npu_paged_attention(**{**params, "context_lens": meta.seq_lens})
                else:
                    kwargs, out, lse, workspace = params
                    kwargs = {
                        **kwargs,
                        "actual_seq_lengths": meta.actual_seq_lengths_q,
                        "actual_seq_lengths_kv": meta.seq_lens_list,
                    }
                    torch_npu.npu_fused_infer_attention_score.out(**kwargs, workspace=workspace, out=[out, lse])
                torch.npu.graph_task_update_end(update_stream)
                event.record(update_stream)
