"""Micro-batching: one forward runs every layer once per micro-batch; metadata is a list."""

from __future__ import annotations

import pytest
import torch

from npugraph import AttentionMetadata, DecodeAttention, Runtime
from npugraph.dump.validate import validate_manifest
from npugraph.errors import MetadataError
from npugraph.policy import FixedPolicy

NB, BS, COLS = 24, 16, 8


class TwoMicroBatches:
    """Each layer attends once for micro-batch 0 and once for micro-batch 1."""

    def __init__(self, rt: Runtime, layers: int = 3) -> None:
        gen = torch.Generator().manual_seed(0)
        self.attn = [
            DecodeAttention(rt, f"main.layers.{i}.attn", num_heads=4, num_kv_heads=1, head_size=64)
            for i in range(layers)
        ]
        dev = rt.device.memory
        self.caches = [
            (
                torch.randn(NB, BS, 1, 64, generator=gen).half().to(dev),
                torch.randn(NB, BS, 1, 64, generator=gen).half().to(dev),
            )
            for _ in range(layers)
        ]

    def __call__(self, q0, q1, meta0, meta1):
        outs = []
        for u, (q, meta) in enumerate(((q0, meta0), (q1, meta1))):
            x = q
            for attn, (k, v) in zip(self.attn, self.caches):
                x = attn(x, k, v, meta, ubatch=u)
            outs.append(x)
        return outs


def _meta(lens, rows, gen):
    table = torch.randint(0, NB, (rows, COLS), dtype=torch.int32, generator=gen)
    return AttentionMetadata(seq_lens=torch.tensor(lens, dtype=torch.int32), block_table=table)


def _padded(meta, rows):
    r = meta.num_reqs
    lens = torch.zeros(rows, dtype=torch.int32)
    lens[:r] = meta.seq_lens
    table = torch.zeros(rows, COLS, dtype=torch.int32)
    table[:r] = meta.block_table
    return AttentionMetadata(seq_lens=lens, block_table=table)


def test_micro_batched_graph_updates_each_micro_batch_from_its_own_metadata():
    rt = Runtime("sim", max_model_len=COLS * BS, policy=FixedPolicy("fia"))
    model = TwoMicroBatches(rt)
    dev = rt.device.memory
    q = torch.randn(8, 4, 64).half().to(dev)
    tables = [torch.zeros(4, COLS, dtype=torch.int32, device=dev) for _ in range(2)]
    ones = torch.ones(4, dtype=torch.int32)
    rt.capture(
        model,
        q[:4],
        q[4:],
        AttentionMetadata(seq_lens=ones, block_table=tables[0]),
        AttentionMetadata(seq_lens=ones, block_table=tables[1]),
        key=8,
    )
    entry = rt.manager.entry("main", 8)
    assert [(t.ubatch, t.layer) for t in entry.tasks][:4] == [
        (0, "main.layers.0.attn"),
        (0, "main.layers.1.attn"),
        (0, "main.layers.2.attn"),
        (1, "main.layers.0.attn"),
    ]
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        m0 = _meta([5 + step, 30, 77][: 3 - step % 2], 3 - step % 2, gen)
        m1 = _meta([100 - step, 9], 2, gen)
        q.copy_(torch.randn(8, 4, 64).half())  # the host's new query, into the device buffer
        # micro-batch 1: layer 0 by its name, the others by the group, with other lengths
        m1_group = AttentionMetadata(seq_lens=torch.tensor([3, 60], dtype=torch.int32), block_table=m1.block_table)
        ref0 = model(q[:4], q[4:], _padded(m0, 4), _padded(m1, 4))[0].clone()
        ref1 = q[4:]
        for i, (attn, (k, v)) in enumerate(zip(model.attn, model.caches)):
            ref1 = attn(ref1, k, v, _padded(m1 if i == 0 else m1_group, 4), ubatch=1)
        out = rt.step(8, [{"default": m0}, {"main.layers.0.attn": m1, "default": m1_group}])
        rt.synchronize()
        assert torch.equal(out[0], ref0) and torch.equal(out[1], ref1), f"step {step}"
        wrong = model(q[:4], q[4:], _padded(m0, 4), _padded(m1, 4))[1]
        assert not torch.equal(out[1], wrong), "layer name and group gave different lengths"
    assert validate_manifest(rt.manifest()) == []
    with pytest.raises(MetadataError, match="the graph has 2 micro-batches but the step's metadata lists 1"):
        rt.update(8, [{"default": m0}])
    with pytest.raises(MetadataError, match="metadata of micro-batch 1 has no entry for layer 'main.layers.0.attn'"):
        rt.update(8, [{"default": m0}, {"other": m1}])
    out = rt.step(8, [{"default": m0}, {"main.layers.0.attn": m1, "default": m1_group}])  # serving goes on
    rt.synchronize()
    assert torch.equal(out[0], ref0) and torch.equal(out[1], ref1), "the step after the bad ones"
