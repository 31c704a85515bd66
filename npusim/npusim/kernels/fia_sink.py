"""FIA v2 with tiling sink (vllm-ascend PRs #15215 / #15336, open as of Nov 2026): lengths
and tiling read from device memory, so a captured kernel needs no host update per layer.

* ``_npu_fused_infer_attention_score_v2_sink_metadata(actual_seq_qlen, actual_seq_kvlen, *,
  num_query_heads, num_key_value_heads, head_dim, block_size, meta_data, input_layout,
  sparse_mode)`` — an AI-CPU op: reads the lengths from device memory and writes FIA's
  tiling plan into ``meta_data`` (1,024 uint32 entries).  It must run **outside** a graph,
  once per step: an AI-CPU node captured in a graph is not re-run on replay (modelled: the
  captured node does nothing), so the graph would replay a stale plan;
* ``npu_fused_infer_attention_score_v2_sink(query, key, value, *, actual_seq_qlen,
  actual_seq_kvlen, block_table, meta_data, ...)`` — FIA v2's math with the lengths as
  device tensors (``actual_seq_qlen`` cumulative) and the plan from ``meta_data``.

On hardware a plan computed for other lengths (a stale one) gives wrong attention or a
fault, silently; the simulator's kernel checks the plan against the lengths it reads and
raises :class:`StaleTilingError` (reported by the next synchronize, as device errors are).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from npusim.errors import SimError
from npusim.kernels.fia import INT_MAX, fia_check, fia_compute, out_pair
from npusim.runtime import state as rt
from npusim.runtime.launch import OpPacket, SimOp, fail, launch, need_tensor

__all__ = [
    "META_ENTRIES",
    "StaleTilingError",
    "_npu_fused_infer_attention_score_v2_sink_metadata",
    "npu_fused_infer_attention_score_v2_sink",
]

META_ENTRIES = 1024  # uint32 entries of the plan buffer (the PRs' size)
_MAGIC = 0x46494153  # "FIAS": a plan was written here
_HEADER = 16
_CORES = 24  # AI cores a plan spreads the requests over (Atlas A2/A3 cube cores)
_LEN_DTYPES = (torch.int32, torch.int64)
_OP = "npu_fused_infer_attention_score_v2_sink"
_META_OP = "_npu_fused_infer_attention_score_v2_sink_metadata"


class StaleTilingError(SimError):
    """The sink kernel ran with a plan computed for other lengths, or with no plan.

    On hardware: wrong attention or a fault, silently.  The usual cause is a metadata op
    captured inside the graph (its AI-CPU node is not re-run on replay) or lengths written
    after the metadata op ran."""


def _fingerprint(values: list[int]) -> int:
    """FNV-1a over the lengths: what a plan was computed for."""
    h = 0x811C9DC5
    for v in values:
        h = ((h ^ (int(v) & 0xFFFFFFFF)) * 0x01000193) & 0xFFFFFFFF
    return h


def _check_common(op: str, p: dict[str, Any], heads: int, kv_heads: int, head_dim: int) -> None:
    layout = p.get("input_layout", "TND")
    if layout != "TND":
        raise NotImplementedError(f"{op}: the simulator models input_layout='TND' only, got {layout!r}")
    if head_dim == 256:
        raise fail(op, "head_dim", "256 is not supported by the tiling-sink kernel (GQA); use FIA with host lengths")
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
        raise fail(op, "num_query_heads", f"({heads}) must be a positive multiple of num_key_value_heads ({kv_heads})")
    if int(p.get("sparse_mode", 0)) not in (0, 3):
        raise fail(op, "sparse_mode", f"{p.get('sparse_mode')} is not modelled for the sink kernel (0 and 3 are)")
    for name in ("actual_seq_qlen", "actual_seq_kvlen"):
        t = p.get(name)
        if not isinstance(t, torch.Tensor):
            raise fail(
                op,
                name,
                f"must be a device tensor (this kernel reads lengths from device memory), got {type(t).__name__}",
            )
        need_tensor(op, name, t, 1)
        if t.dtype not in _LEN_DTYPES:
            raise fail(op, name, f"must be int32 or int64, got {t.dtype}")
    if p["actual_seq_qlen"].shape != p["actual_seq_kvlen"].shape:
        raise fail(op, "actual_seq_kvlen", "must have one entry per request, as actual_seq_qlen has")
    meta = p.get("meta_data")
    if not isinstance(meta, torch.Tensor) or meta.dtype != torch.uint32 or meta.dim() != 1:
        raise fail(op, "meta_data", f"must be a 1-D uint32 tensor of {META_ENTRIES} entries")
    if meta.numel() < META_ENTRIES:
        raise fail(op, "meta_data", f"has {meta.numel()} entries; the plan takes {META_ENTRIES}")


# --- the metadata op ------------------------------------------------------------------


def _meta_check(p: dict[str, Any]) -> dict[str, Any]:
    _check_common(_META_OP, p, int(p["num_query_heads"]), int(p["num_key_value_heads"]), int(p["head_dim"]))
    if int(p["block_size"]) <= 0:
        raise fail(_META_OP, "block_size", f"must be positive, got {p['block_size']}")
    return {}


def _plan(q_ends: list[int], kv: list[int], header: list[int]) -> list[int]:
    """The plan: a header (what it was computed for) and contiguous request ranges per
    core, balanced by key length (the tiling FIA's host code computes)."""
    batch = len(kv)
    total = sum(max(0, x) for x in kv) or 1
    tiles: list[int] = []
    start, acc = 0, 0
    for i, x in enumerate(kv):
        acc += max(0, x)
        if len(tiles) // 2 < _CORES - 1 and acc * _CORES >= total * (len(tiles) // 2 + 1) and i + 1 < batch:
            tiles += [start, i + 1]
            start = i + 1
    tiles += [start, batch]
    plan = [*header, _fingerprint(q_ends), _fingerprint(kv), q_ends[-1] if q_ends else 0, len(tiles) // 2]
    plan += [0] * (_HEADER - len(plan))
    return plan + tiles


def _meta_header(p: dict[str, Any], batch: int) -> list[int]:
    return [
        _MAGIC,
        batch,
        int(p["num_query_heads"]),
        int(p["num_key_value_heads"]),
        int(p["head_dim"]),
        int(p["block_size"]),
        int(p.get("sparse_mode", 0)),
    ]


def _meta_compute(p: dict[str, Any], info: dict[str, Any]) -> None:
    q_ends = [int(x) for x in p["actual_seq_qlen"].tolist()]
    kv = [int(x) for x in p["actual_seq_kvlen"].tolist()]
    if any(b < a for a, b in itertools.pairwise(q_ends)) or any(x < 0 for x in q_ends):
        raise fail(_META_OP, "actual_seq_qlen", f"must be non-decreasing cumulative query ends, got {q_ends[:8]}")
    if any(x < 0 for x in kv):
        raise fail(_META_OP, "actual_seq_kvlen", f"entries must be >= 0, got {kv[:8]}")
    plan = _plan(q_ends, kv, _meta_header(p, len(kv)))
    meta = p["meta_data"]
    meta[: len(plan)].copy_(torch.tensor(plan, dtype=torch.int64, device="cpu"))


_META = SimOp(
    _META_OP,
    "default",
    host_args=(),
    output_args=("meta_data",),
    check=_meta_check,
    compute=_meta_compute,
    workspace=lambda p, info: 0,
    anchor="meta_data",
)

# What a replay does with a metadata op captured inside the graph: nothing.  An AI-CPU node
# is not re-run on replay, so the plan stays what it was (a stale plan, or none).
_META_CAPTURED = SimOp(
    _META_OP,
    "captured",
    host_args=(),
    output_args=(),
    check=_meta_check,
    compute=lambda p, info: None,
    workspace=lambda p, info: 0,
    anchor="meta_data",
)


def _npu_fused_infer_attention_score_v2_sink_metadata(
    actual_seq_qlen: torch.Tensor,
    actual_seq_kvlen: torch.Tensor,
    *,
    num_query_heads: int,
    num_key_value_heads: int,
    head_dim: int,
    block_size: int,
    meta_data: torch.Tensor,
    input_layout: str = "TND",
    sparse_mode: int = 0,
) -> torch.Tensor:
    """Write FIA's tiling plan for the lengths in device memory into ``meta_data`` (on the
    current stream).  Call it outside any graph, before each replay that reads the plan."""
    p = dict(locals())
    op = _META_CAPTURED if rt.get_state().capture is not None else _META
    launch(op, p)
    return meta_data


# --- the kernel -----------------------------------------------------------------------


def _kernel_check(p: dict[str, Any]) -> dict[str, Any]:
    q = need_tensor(_OP, "query", p["query"], 3)
    heads, kv_heads = int(p["num_query_heads"]), int(p["num_key_value_heads"])
    _check_common(_OP, p, heads, kv_heads, int(q.shape[2]))
    bt = need_tensor(_OP, "block_table", p.get("block_table"), 2)
    if bt.dtype != torch.int32:
        raise fail(_OP, "block_table", f"must be int32, got {bt.dtype}")
    if p["actual_seq_kvlen"].shape[0] != bt.shape[0]:
        raise fail(
            _OP, "actual_seq_kvlen", f"has {p['actual_seq_kvlen'].shape[0]} entries for {bt.shape[0]} block-table rows"
        )
    if int(q.shape[1]) != heads:
        raise fail(_OP, "num_query_heads", f"is {heads} but the query has {q.shape[1]} heads")
    return {}


def _v1_params(p: dict[str, Any], q_ends: list[int], kv: list[int]) -> dict[str, Any]:
    """The lengths as read from device memory, under FIA v1's names (for its math)."""
    return {
        "query": p["query"],
        "key": p["key"],
        "value": p["value"],
        "atten_mask": p.get("atten_mask"),
        "actual_seq_lengths": tuple(q_ends),
        "actual_seq_lengths_kv": tuple(kv),
        "block_table": p["block_table"],
        "num_heads": p["num_query_heads"],
        "num_key_value_heads": p["num_key_value_heads"],
        "scale": p["softmax_scale"],
        "pre_tokens": p.get("pre_tokens", INT_MAX),
        "next_tokens": p.get("next_tokens", INT_MAX),
        "input_layout": "TND",
        "sparse_mode": p.get("sparse_mode", 0),
        "block_size": p["block_size"],
        "softmax_lse_flag": p.get("return_softmax_lse", False),
        "learnable_sink": p.get("learnable_sink"),
        "workspace": None,
        "out": p["out"],
    }


def _kernel_compute(p: dict[str, Any], info: dict[str, Any]) -> None:
    q_ends = [int(x) for x in p["actual_seq_qlen"].tolist()]
    kv = [int(x) for x in p["actual_seq_kvlen"].tolist()]
    plan = [int(x) for x in p["meta_data"][:_HEADER].tolist()]
    hint = (
        f" Run {_META_OP} on these lengths before each replay, outside the graph: an AI-CPU node captured "
        "in a graph is not re-run on replay. (Simulator check: the hardware would run a stale plan silently.)"
    )
    if plan[0] != _MAGIC:
        raise StaleTilingError(f"{_OP}: meta_data holds no tiling plan." + hint)
    head_dim = int(p["query"].shape[2])
    want = _meta_header({**p, "head_dim": head_dim}, len(kv))
    if plan[: len(want)] != want:
        raise StaleTilingError(
            f"{_OP}: meta_data's plan was computed for another shape (batch, heads, kv heads, head dim, "
            f"block size, sparse mode: {plan[1:7]}, the kernel has {want[1:]})." + hint
        )
    if plan[7] != _fingerprint(q_ends) or plan[8] != _fingerprint(kv):
        raise StaleTilingError(
            f"{_OP}: meta_data's plan was computed for other lengths than the kernel reads "
            f"(actual_seq_kvlen now {kv[:8]}{'...' if len(kv) > 8 else ''})." + hint
        )
    v1 = _v1_params(p, q_ends, kv)
    fia_compute(v1, fia_check(v1))


def _sink_op(overload: str) -> SimOp:
    return SimOp(
        _OP,
        overload,
        host_args=(),
        output_args=("out",),
        check=_kernel_check,
        compute=_kernel_compute,
        workspace=lambda p, info: 0,
    )


_SINK = _sink_op("default")
_SINK_OUT = _sink_op("out")


def _sink_params(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    actual_seq_qlen: torch.Tensor,
    actual_seq_kvlen: torch.Tensor,
    block_table: torch.Tensor,
    meta_data: torch.Tensor,
    num_query_heads: int = 1,
    num_key_value_heads: int = 0,
    softmax_scale: float = 1.0,
    input_layout: str = "TND",
    block_size: int = 0,
    sparse_mode: int = 0,
    atten_mask: torch.Tensor | None = None,
    pre_tokens: int = INT_MAX,
    next_tokens: int = INT_MAX,
    learnable_sink: torch.Tensor | None = None,
    return_softmax_lse: bool = False,
    out: Any = None,
) -> dict[str, Any]:
    p = dict(locals())
    p["num_key_value_heads"] = int(num_key_value_heads) or int(num_query_heads)
    return p


def _sink_default(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any) -> Any:
    p = _sink_params(query, key, value, **kwargs)
    t, n, _ = query.shape
    dv = value.shape[-1] // max(1, int(p["num_key_value_heads"])) if value.dim() == 3 else value.shape[-1]
    out = torch.empty(t, n, dv, dtype=query.dtype, device=query.device)
    lse = torch.empty(1, dtype=torch.float32, device=query.device)
    p["out"] = [out, lse]
    launch(_SINK, p)
    return out, lse


def _sink_out(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any) -> Any:
    p = _sink_params(query, key, value, **kwargs)
    outs = out_pair(p)
    launch(_SINK_OUT, p)
    return outs[0], outs[1]


npu_fused_infer_attention_score_v2_sink = OpPacket(_sink_default, _sink_out, _OP)
