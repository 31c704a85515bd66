"""vLLM's attention metadata read as npugraph's: :func:`to_attention_metadata` (one
backend's object, by the contract in :mod:`npugraph.integrations.vllm`; vllm-ascend's
``AscendMetadata`` by :func:`metadata_from_ascend`, which its backends' recorders use too)
and :func:`step_metadata` (``forward_context.attn_metadata``, per layer, per micro-batch)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from npugraph.errors import MetadataError
from npugraph.metadata import AttentionMetadata
from npugraph.replay import StepMetadata

__all__ = ["metadata_from_ascend", "step_metadata", "to_attention_metadata"]


def to_attention_metadata(obj: Any) -> AttentionMetadata:
    """Read the contract's fields from a backend's metadata object (see the module doc).

    MLA backends (vllm-ascend's ``AscendMLAMetadata``) keep the decode lengths and table
    in ``obj.decode`` (``seq_lens_list``, ``block_table``) and the cumulative query ends of
    speculative steps in ``actual_seq_lengths_q``; those are read when present.
    """
    if isinstance(obj, AttentionMetadata):
        return obj
    ascend = getattr(obj, "actual_seq_lengths_q", None) is not None or isinstance(getattr(obj, "seq_lens", None), list)
    if ascend and getattr(obj, "decode", None) is None:
        return metadata_from_ascend(obj)  # vllm-ascend's AscendMetadata: host lengths and query ends
    decode = getattr(obj, "decode", None)
    if decode is not None and getattr(decode, "seq_lens_list", None) is not None:
        meta = to_attention_metadata(decode)
        ends = getattr(decode, "actual_seq_lengths_q", None) or getattr(obj, "actual_seq_lengths_q", None)
        if ends is not None and meta.query_start_loc is None:
            qsl = torch.tensor([0, *[int(x) for x in ends]], dtype=torch.int32, device="cpu")
            meta = AttentionMetadata(seq_lens=meta.seq_lens, block_table=meta.block_table, query_start_loc=qsl)
        return meta
    seq = getattr(obj, "seq_lens_list", None)
    if seq is not None:
        seq_lens = torch.tensor(seq, dtype=torch.int32, device="cpu")  # host-side: the kernels' tiling reads it
    else:
        seq_lens = _first_attr(obj, ("seq_lens_cpu", "seq_lens"))
        if seq_lens is None:
            raise MetadataError(
                f"{type(obj).__name__} has no seq_lens_list / seq_lens_cpu / seq_lens; an attention "
                "backend must provide the per-request key lengths on the host"
            )
        seq_lens = seq_lens.to(torch.int32)
    table = _first_attr(obj, ("block_tables", "block_table", "block_table_tensor"))
    if table is None:
        raise MetadataError(f"{type(obj).__name__} has no block_tables / block_table attribute")
    qsl = _first_attr(obj, ("query_start_loc_cpu", "query_start_loc"))
    return AttentionMetadata(seq_lens=seq_lens, block_table=table, query_start_loc=qsl)


def _first_attr(obj: Any, names: tuple[str, ...]) -> Any:
    for n in names:
        v = getattr(obj, n, None)
        if v is not None:
            return v
    return None


def step_metadata(attn_metadata: Any) -> StepMetadata:
    """Map ``forward_context.attn_metadata`` to npugraph's step metadata.

    A dict keyed by layer name gives a dict; a list of such dicts (micro-batching)
    gives a list, one per micro-batch. Each distinct metadata object is converted once.
    """
    converted: dict[int, AttentionMetadata] = {}

    def one(d: Any) -> dict[str, AttentionMetadata]:
        if not isinstance(d, Mapping):
            raise MetadataError(
                "forward_context.attn_metadata must be a dict keyed by attention layer name (or a list "
                f"of such dicts with micro-batching), got {type(d).__name__}"
            )
        out: dict[str, AttentionMetadata] = {}
        for name, obj in d.items():
            m = converted.get(id(obj))
            if m is None:
                m = converted[id(obj)] = to_attention_metadata(obj)
            out[name] = m
        return out

    if isinstance(attn_metadata, list):
        return [one(d) for d in attn_metadata]
    return one(attn_metadata)


def metadata_from_ascend(meta: Any) -> AttentionMetadata:
    """npugraph's metadata from vllm-ascend's ``AscendMetadata`` (capture and step alike).

    Host lengths from ``seq_lens_list`` (Aug 2026), or ``seq_lens`` as a host list (the V2
    runner's) or CPU tensor; query ends from the host list ``actual_seq_lengths_q`` (Aug:
    ``query_start_loc`` is device-resident there) or the V2 runner's host list
    ``query_start_loc`` (cumulative ends, or starts with a leading 0).
    """
    seq = getattr(meta, "seq_lens_list", None)
    if seq is None:
        lens = getattr(meta, "seq_lens", None)
        if isinstance(lens, (list, tuple)):
            seq = list(lens)
        elif isinstance(lens, torch.Tensor) and lens.device.type == "cpu":
            seq = lens.tolist()
        else:
            raise MetadataError(f"{type(meta).__name__} has no seq_lens_list / seq_lens on the host")
    table = getattr(meta, "block_tables", None)
    if table is None:
        table = getattr(meta, "block_table", None)
    if table is None:
        raise MetadataError(f"{type(meta).__name__} has no block_tables / block_table")
    ends = getattr(meta, "actual_seq_lengths_q", None)
    listed = getattr(meta, "query_start_loc", None)
    if ends is None and isinstance(listed, (list, tuple)):
        ends = list(listed[1:]) if len(listed) == len(seq) + 1 and listed and listed[0] == 0 else list(listed)
    qsl = None
    if ends is not None and len(ends) == len(seq) and list(ends) != list(range(1, len(seq) + 1)):
        qsl = torch.tensor([0, *[int(x) for x in ends]], dtype=torch.int32, device="cpu")
    return AttentionMetadata(
        seq_lens=torch.tensor([int(x) for x in seq], dtype=torch.int32, device="cpu"),
        block_table=table,
        query_start_loc=qsl,
    )
