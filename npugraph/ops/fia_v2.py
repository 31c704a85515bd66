"""FIA v2: ``torch_npu.npu_fused_infer_attention_score_v2.out`` — FIA under v2's argument names.

The lengths are ``actual_seq_qlen`` / ``actual_seq_kvlen`` (host-side, rewritten every
step); heads and scale are ``num_query_heads`` / ``softmax_scale``.  torch_npu has no
4-in-1 for v2, so updates go through begin / op / end / record.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import torch

from npugraph.metadata import StepLens
from npugraph.ops.base import AttentionCall
from npugraph.ops.fia import FIA, fia_arguments, fia_workspace_bytes

__all__ = ["FIA_V2"]

_V2_NAMES = {
    "actual_seq_lengths": "actual_seq_qlen",
    "actual_seq_lengths_kv": "actual_seq_kvlen",
    "num_heads": "num_query_heads",
    "scale": "softmax_scale",
    "softmax_lse_flag": "return_softmax_lse",
}


def _arguments(call: AttentionCall, lens: StepLens, workspace: torch.Tensor | None) -> dict[str, Any]:
    return {_V2_NAMES.get(k, k): v for k, v in fia_arguments(call, lens, workspace).items()}


def _host_values(lens: StepLens) -> dict[str, Any]:
    return {"actual_seq_qlen": lens.q_ends, "actual_seq_kvlen": lens.kv_lens}


def _unsupported(call: AttentionCall) -> str | None:
    if call.is_mla:
        return "this declaration runs GQA; MLA goes through the mla declaration"
    return None


# FIA's declaration under v2's names: the same refreshed table, cache, mask and one-token rule;
# its own kernel, host arguments and workspace helper, and no 4-in-1 update
FIA_V2 = attrs.evolve(
    FIA,
    name="fia_v2",
    kernel="npu_fused_infer_attention_score_v2",
    host_args=("actual_seq_qlen", "actual_seq_kvlen"),
    arguments=_arguments,
    host_values=_host_values,
    workspace_bytes=functools.partial(
        fia_workspace_bytes, "_npu_fused_infer_attention_score_v2_get_max_workspace", "actual_seq_kvlen"
    ),
    unsupported=_unsupported,
    fused_update=False,
)
