"""PA: ``torch_npu._npu_paged_attention`` — the faster kernel for small decode batches."""

from __future__ import annotations

from typing import Any

import torch

from npugraph.metadata import StepLens
from npugraph.ops.base import AttentionCall, OpSpec

__all__ = ["PA", "PA_HEAD_SIZES", "PA_DTYPES"]

PA_HEAD_SIZES = (64, 128)  # head sizes the PA kernel ships tilings for
PA_DTYPES = (torch.float16, torch.bfloat16)


def _arguments(call: AttentionCall, lens: StepLens, workspace: torch.Tensor | None) -> dict[str, Any]:
    return {
        "query": call.query,
        "key_cache": call.key_cache,
        "value_cache": call.value_cache,
        "num_kv_heads": call.num_kv_heads,
        "num_heads": call.num_heads,
        "scale_value": call.scale,
        "block_table": call.block_table,
        "context_lens": torch.tensor(lens.kv_lens, dtype=torch.int32, device="cpu"),
        "out": call.out,
        "workspace": workspace,
    }


def _host_values(lens: StepLens) -> dict[str, Any]:
    # PA takes the lengths as a CPU int32 tensor (cloned by the kernel at call time)
    return {"context_lens": torch.tensor(lens.kv_lens, dtype=torch.int32, device="cpu")}


def _probe_lengths(max_len: int, block_size: int) -> list[int]:
    """Lengths at which PA's (non-monotonic) workspace is checked: the whole range, sampled.

    Every power of two, every block boundary when there are few, an even sweep of at
    most 256 points otherwise, and ``max_len`` itself.
    """
    powers = [1 << k for k in range((max_len - 1).bit_length())]  # each power of two below max_len
    pts = {max_len, *powers, *(p + 1 for p in powers)}
    stride = max(block_size, max_len // 256)
    pts.update(range(stride, max_len + 1, stride))
    return sorted(pts)


def _workspace_bytes(device: Any, kwargs: dict[str, Any], max_model_len: int) -> int:
    """Max of ``_npu_paged_attention_get_workspace`` over the whole length range.

    PA's workspace depends on the current lengths and is not monotonic (a shorter
    context can need more), so one fake length is not enough.  Uniform batches and
    one-long-rest-short batches are probed at every sampled length.
    """
    query_fn = device.ops._npu_paged_attention_get_workspace
    base = {k: v for k, v in kwargs.items() if k != "workspace"}
    batch = int(kwargs["query"].shape[0])
    best = 0
    for length in _probe_lengths(max_model_len, int(kwargs["key_cache"].shape[1])):
        for lens in ([length] * batch, [length] + [1] * (batch - 1)):
            base["context_lens"] = torch.tensor(lens, dtype=torch.int32, device="cpu")
            ws = query_fn(**base)
            best = max(best, ws.numel() * ws.element_size())
    return best


def _unsupported(call: AttentionCall) -> str | None:
    if call.is_mla:
        return "PA cannot run MLA (no rope arguments, one latent head)"
    if call.window is not None:
        return f"PA cannot run a sliding window (window {call.window})"
    if call.tokens_per_request != 1:
        return f"PA decodes one token per request (got {call.tokens_per_request})"
    head = int(call.query.shape[-1])
    if head not in PA_HEAD_SIZES:
        return f"PA has no tiling for head size {head} (supported: {list(PA_HEAD_SIZES)})"
    if call.query.dtype not in PA_DTYPES:
        return f"PA does not support dtype {call.query.dtype} (float16/bfloat16 only)"
    bs = call.block_size
    if bs % 16 or bs * head > 128 * 128:
        # ATB PagedAttention (CANN 9.0, ascendtb_01_0198): block_size % 16 == 0, block_size * head_size <= 128 * 128
        return f"PA needs a block size that is a multiple of 16 and at most {128 * 128 // head} here (got {bs})"
    return None


PA = OpSpec(
    name="pa",
    kernel="_npu_paged_attention",
    overload=None,
    host_args=("context_lens",),
    refreshed_buffers=("block_table",),
    cache_arg="key_cache",
    arguments=_arguments,
    host_values=_host_values,
    workspace_bytes=_workspace_bytes,
    unsupported=_unsupported,
    runs_one_query_token=lambda args: True,  # its query rows are the requests
)
