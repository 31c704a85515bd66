"""Update-free FIA: ``npu_fused_infer_attention_score.out`` with its lengths frozen to a width.

A graph captured at width ``W`` runs FIA with ``actual_seq_lengths_kv = [W] * batch`` for
good: no task group, no update, no ExternalEvent per layer.  Each request's real length is
enforced on the device by FIA's own ``atten_mask`` (True = masked), which a step makes from
the lengths it writes, once per KV-cache group (one length copy and one comparison on the
update stream, outside the graph), as the tiling-sink path writes its lengths.

The mask is the form CANN takes in decode with a block table (torch_npu's FIA documentation
7.2+, ops-transformer's ``incre_flash_attention_tiling_check.cpp``): ``sparse_mode=0``, bool,
``(B, 1, 1, KV_S)`` with ``B`` the query's batch and ``KV_S`` at least the block table's
columns times the block size.  TND takes no such mask, so the query is read as BSND
(``[B, 1, N, D]``, a view of decode's ``[T, N, D]``), and the graph reads its own block
table of ``W / block_size`` columns (a step copies the engine's into it), so that the mask
is ``W`` keys wide, not the engine table's width.  A padding request's mask leaves its first
key visible: a row whose keys are all masked is, in CANN's words, of lost precision.
"""

from __future__ import annotations

from typing import Any

import torch

from npugraph.metadata import StepLens
from npugraph.ops.base import AttentionCall, DeviceLengths, LensGroup, OpSpec

__all__ = ["FIA_FROZEN"]


def _arguments(
    call: AttentionCall, lens: StepLens, workspace: torch.Tensor | None, buffers: LensGroup | None = None
) -> dict[str, Any]:
    nb, bs, kvn, d = call.key_cache.shape
    dv = call.value_cache.shape[-1]
    t, n = int(call.query.shape[0]), call.num_heads
    if buffers is None or buffers.width is None:
        raise TypeError("update-free FIA reads its width, table and mask from a LensGroup made with a width")
    lse = torch.empty(1, dtype=torch.float32, device=call.query.device)
    return {
        "query": call.query.view(t, 1, n, d),
        "key": call.key_cache.view(nb, bs, kvn * d),
        "value": call.value_cache.view(nb, bs, kvn * dv),
        "atten_mask": buffers.mask,
        "actual_seq_lengths_kv": [buffers.width] * t,
        "block_table": buffers.table,
        "num_heads": n,
        "scale": call.scale,
        "input_layout": "BSND",
        "num_key_value_heads": call.num_kv_heads,
        "block_size": bs,
        "sparse_mode": 0,
        "softmax_lse_flag": False,
        "workspace": workspace,
        "out": [call.out.view(t, 1, n, dv), lse],
    }


def _mask(device: Any, group: LensGroup) -> None:
    """The step's mask from the lengths just written (device work, no allocation): key ``j``
    of request ``i`` is masked where ``j >= kvlen[i]``."""
    assert group.mask is not None and group.positions is not None  # a group made with a width
    device.mask_past(group.positions, group.kvlen, group.mask.view(group.batch, -1))


def _host_values(lens: StepLens) -> dict[str, Any]:
    # a padding request (length 0) keeps its first key: a fully masked row is not defined
    return {"q_ends": lens.q_ends, "mask_lens": tuple(k if k > 0 else 1 for k in lens.kv_lens)}


def _unsupported(call: AttentionCall) -> str | None:
    if call.is_mla:
        return "MLA: CANN takes no decode mask with the rope arguments"
    if call.window is not None:
        return "a sliding window is a band mask (sparse_mode=4): the decode mask cannot be combined with it"
    if call.tokens_per_request > 1:
        return "several query tokens a request (speculative verification): the decode mask runs one"
    return None


def _plan_args(call: AttentionCall) -> dict[str, Any]:
    return {}


FIA_FROZEN = OpSpec(
    name="fia_frozen",
    kernel="npu_fused_infer_attention_score",
    overload="out",
    host_args=(),
    refreshed_buffers=("block_table",),
    cache_arg="key",
    arguments=_arguments,
    host_values=_host_values,
    # lengths frozen: the workspace FIA allocates in the capture, from the graph's pool, fits for good
    workspace_bytes=lambda device, kwargs, max_model_len: 0,
    unsupported=_unsupported,
    runs_one_query_token=lambda args: True,
    sink=DeviceLengths(plan_args=_plan_args, plan=_mask, width=True),
)
