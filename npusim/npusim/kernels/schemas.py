"""torch_npu's schemas of the simulated kernels, as op-plugin declares them (what a dispatch
mode reads as an op's ``_schema``).

torch_npu's code generator rewrites an ``.out`` overload with several outputs to take one
``Tensor[] out`` (callers pass ``out=[attention_out, softmax_lse]``); the ``.out`` schemas
here are the rewritten ones.  PA is an ATB op (``atb::_npu_paged_attention``).
"""

__all__ = ["FIA_OUT_SCHEMA", "FIA_SCHEMA", "FIA_V2_OUT_SCHEMA", "FIA_V2_SCHEMA", "PA_SCHEMA"]

FIA_SCHEMA = (
    "npu_fused_infer_attention_score(Tensor query, Tensor key, Tensor value, *, Tensor? pse_shift=None, "
    "Tensor? atten_mask=None, SymInt[]? actual_seq_lengths=None, SymInt[]? actual_seq_lengths_kv=None, "
    "Tensor? dequant_scale1=None, Tensor? quant_scale1=None, Tensor? dequant_scale2=None, Tensor? "
    "quant_scale2=None, Tensor? quant_offset2=None, Tensor? antiquant_scale=None, Tensor? "
    "antiquant_offset=None, Tensor? key_antiquant_scale=None, Tensor? key_antiquant_offset=None, Tensor? "
    "value_antiquant_scale=None, Tensor? value_antiquant_offset=None, Tensor? block_table=None, Tensor? "
    "query_padding_size=None, Tensor? kv_padding_size=None, Tensor? key_shared_prefix=None, Tensor? "
    "value_shared_prefix=None, SymInt[]? actual_shared_prefix_len=None, Tensor? query_rope=None, Tensor? "
    "key_rope=None, Tensor? key_rope_antiquant_scale=None, int num_heads=1, float scale=1.0, int "
    'pre_tokens=2147483647, int next_tokens=2147483647, str input_layout="BSH", int '
    "num_key_value_heads=0, int sparse_mode=0, int inner_precise=0, int block_size=0, int "
    "antiquant_mode=0, int key_antiquant_mode=0, int value_antiquant_mode=0, bool softmax_lse_flag=False)"
    " -> (Tensor, Tensor)"
)
FIA_OUT_SCHEMA = (
    "npu_fused_infer_attention_score.out(Tensor query, Tensor key, Tensor value, *, Tensor? "
    "pse_shift=None, Tensor? atten_mask=None, SymInt[]? actual_seq_lengths=None, SymInt[]? "
    "actual_seq_lengths_kv=None, Tensor? dequant_scale1=None, Tensor? quant_scale1=None, Tensor? "
    "dequant_scale2=None, Tensor? quant_scale2=None, Tensor? quant_offset2=None, Tensor? "
    "antiquant_scale=None, Tensor? antiquant_offset=None, Tensor? key_antiquant_scale=None, Tensor? "
    "key_antiquant_offset=None, Tensor? value_antiquant_scale=None, Tensor? value_antiquant_offset=None, "
    "Tensor? block_table=None, Tensor? query_padding_size=None, Tensor? kv_padding_size=None, Tensor? "
    "key_shared_prefix=None, Tensor? value_shared_prefix=None, SymInt[]? actual_shared_prefix_len=None, "
    "Tensor? query_rope=None, Tensor? key_rope=None, Tensor? key_rope_antiquant_scale=None, int "
    "num_heads=1, float scale=1.0, int pre_tokens=2147483647, int next_tokens=2147483647, str "
    'input_layout="BSH", int num_key_value_heads=0, int sparse_mode=0, int inner_precise=0, int '
    "block_size=0, int antiquant_mode=0, int key_antiquant_mode=0, int value_antiquant_mode=0, bool "
    "softmax_lse_flag=False, Tensor? workspace=None, Tensor[] out) -> (Tensor, Tensor)"
)
FIA_V2_SCHEMA = (
    "npu_fused_infer_attention_score_v2(Tensor query, Tensor key, Tensor value, *, Tensor? "
    "query_rope=None, Tensor? key_rope=None, Tensor? pse_shift=None, Tensor? atten_mask=None, SymInt[]? "
    "actual_seq_qlen=None, SymInt[]? actual_seq_kvlen=None, Tensor? block_table=None, Tensor? "
    "dequant_scale_query=None, Tensor? dequant_scale_key=None, Tensor? dequant_offset_key=None, Tensor? "
    "dequant_scale_value=None, Tensor? dequant_offset_value=None, Tensor? dequant_scale_key_rope=None, "
    "Tensor? quant_scale_out=None, Tensor? quant_offset_out=None, Tensor? quant_scale_p=None, Tensor? "
    "learnable_sink=None, int num_query_heads=1, int num_key_value_heads=0, float softmax_scale=1.0, int "
    'pre_tokens=2147483647, int next_tokens=2147483647, str input_layout="BSH", int sparse_mode=0, int '
    "block_size=0, int query_quant_mode=0, int key_quant_mode=0, int value_quant_mode=0, int "
    "inner_precise=0, bool return_softmax_lse=False, int? query_dtype=None, int? key_dtype=None, int? "
    "value_dtype=None, int? query_rope_dtype=None, int? key_rope_dtype=None, int? "
    "key_shared_prefix_dtype=None, int? value_shared_prefix_dtype=None, int? "
    "dequant_scale_query_dtype=None, int? dequant_scale_key_dtype=None, int? "
    "dequant_scale_value_dtype=None, int? dequant_scale_key_rope_dtype=None, int? out_dtype=None) -> "
    "(Tensor, Tensor)"
)
FIA_V2_OUT_SCHEMA = (
    "npu_fused_infer_attention_score_v2.out(Tensor query, Tensor key, Tensor value, *, Tensor? "
    "query_rope=None, Tensor? key_rope=None, Tensor? pse_shift=None, Tensor? atten_mask=None, SymInt[]? "
    "actual_seq_qlen=None, SymInt[]? actual_seq_kvlen=None, Tensor? block_table=None, Tensor? "
    "dequant_scale_query=None, Tensor? dequant_scale_key=None, Tensor? dequant_offset_key=None, Tensor? "
    "dequant_scale_value=None, Tensor? dequant_offset_value=None, Tensor? dequant_scale_key_rope=None, "
    "Tensor? quant_scale_out=None, Tensor? quant_offset_out=None, Tensor? quant_scale_p=None, Tensor? "
    "learnable_sink=None, int num_query_heads=1, int num_key_value_heads=0, float softmax_scale=1.0, int "
    'pre_tokens=2147483647, int next_tokens=2147483647, str input_layout="BSH", int sparse_mode=0, int '
    "block_size=0, int query_quant_mode=0, int key_quant_mode=0, int value_quant_mode=0, int "
    "inner_precise=0, bool return_softmax_lse=False, int? query_dtype=None, int? key_dtype=None, int? "
    "value_dtype=None, int? query_rope_dtype=None, int? key_rope_dtype=None, int? "
    "key_shared_prefix_dtype=None, int? value_shared_prefix_dtype=None, int? "
    "dequant_scale_query_dtype=None, int? dequant_scale_key_dtype=None, int? "
    "dequant_scale_value_dtype=None, int? dequant_scale_key_rope_dtype=None, int? out_dtype=None, Tensor?"
    " workspace=None, Tensor[] out) -> (Tensor, Tensor)"
)
PA_SCHEMA = (
    "_npu_paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, int num_kv_heads, int "
    "num_heads, float scale_value, Tensor block_table, Tensor context_lens, Tensor(a!) out, *, Tensor? "
    "workspace=None) -> ()"
)
