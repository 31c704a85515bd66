"""Stand-in of the Sept 2026 attention backend (the V2 runner's): AscendMetadata with host
lists, FIAParamProvider / PAParamProvider, and a forward that registers its kernel through
register_task / get_capture_resource — their names and signatures; bodies of our own."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch_npu

from vllm_ascend.compilation.updatable_graph import get_capture_resource, register_task

PA_SHAPE_LIST = (1, 2, 3, 4)


@dataclass
class AscendMetadata:
    attn_mask: torch.Tensor | None = None
    num_actual_tokens: int = 0
    seq_lens: list = None  # host list
    query_start_loc: list = None  # host list of cumulative query ends (FIA's actual_seq_lengths)
    block_table: torch.Tensor = None


@dataclass(frozen=True)
class FIAParamProvider:
    layer_name: str

    def resolve(self, attn_metadata):
        metadata = attn_metadata[self.layer_name]
        return {"actual_seq_lengths": metadata.query_start_loc, "actual_seq_lengths_kv": metadata.seq_lens}


@dataclass(frozen=True)
class PAParamProvider:
    layer_name: str

    def resolve(self, attn_metadata):
        metadata = attn_metadata[self.layer_name]
        return {"context_lens": torch.tensor(metadata.seq_lens, dtype=torch.int32)}


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

    def forward(
        self, layer, query, key, value, kv_cache, attn_metadata, output=None, output_scale=None, output_block_scale=None
    ):
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        num_blocks, block_size = key_cache.shape[:2]
        t = query.shape[0]
        out = output.view(t, self.num_heads, -1)
        if t in PA_SHAPE_LIST:
            kwargs = {
                "query": query,
                "key_cache": key_cache,
                "value_cache": value_cache,
                "num_kv_heads": self.num_kv_heads,
                "num_heads": self.num_heads,
                "scale_value": self.scale,
                "block_table": attn_metadata.block_table,
                "context_lens": torch.tensor(attn_metadata.seq_lens, dtype=torch.int32),
                "out": out,
            }
            register_task(torch_npu._npu_paged_attention, kwargs, PAParamProvider(layer.layer_name))
            return output
        key = key_cache.view(num_blocks, block_size, -1)
        value = value_cache.view(num_blocks, block_size, -1)
        kwargs = {
            "query": query,
            "key": key,
            "value": value,
            "atten_mask": attn_metadata.attn_mask,
            "block_table": attn_metadata.block_table,
            "input_layout": "TND",
            "block_size": block_size,
            "actual_seq_lengths": attn_metadata.query_start_loc,
            "actual_seq_lengths_kv": attn_metadata.seq_lens,
            "num_key_value_heads": self.num_kv_heads,
            "num_heads": self.num_heads,
            "scale": self.scale,
            "sparse_mode": 3,
        }
        workspace = get_capture_resource(
            "npu_fused_infer_attention_score.workspace",
            lambda: torch_npu._npu_fused_infer_attention_score_get_max_workspace(**kwargs),
        )
        lse = torch.empty(1, dtype=query.dtype, device=query.device)
        register_task(
            torch_npu.npu_fused_infer_attention_score.out,
            {**kwargs, "workspace": workspace, "out": [out, lse]},
            FIAParamProvider(layer.layer_name),
        )
        return output
