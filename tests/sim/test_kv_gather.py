"""``npu_gather_pa_kv_cache`` (vllm-ascend 0.30's MLA reads a prefill's context with it) against
a reference written here token by token from CANN's description and op-plugin's own golden:
no simulator code is on its path."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import npusim as torch_npu
from npusim import npu

DEVICE = "npu"


def _reference(key_cache, value_cache, tables, lens, offsets, rows):
    bs = key_cache.shape[1]
    key = torch.zeros(rows, *key_cache.shape[2:], dtype=key_cache.dtype)
    value = torch.zeros(rows, *value_cache.shape[2:], dtype=value_cache.dtype)
    r = 0
    for i, n in enumerate(lens):
        start = offsets[i] // bs if offsets is not None else 0
        for j in range(n):
            if r >= rows:
                return key, value
            block = int(tables[i][start + j // bs])
            key[r] = key_cache[block, j % bs]
            value[r] = value_cache[block, j % bs]
            r += 1
    return key, value


@settings(max_examples=20, deadline=None)
@given(
    lens=st.lists(st.integers(0, 20), min_size=1, max_size=4),
    bs=st.sampled_from([4, 8]),
    offset_blocks=st.lists(st.integers(0, 2), min_size=4, max_size=4),
    use_offset=st.booleans(),
    cumsum=st.booleans(),
    short=st.integers(0, 3),
    seed=st.integers(0, 99),
)
def test_gather_copies_each_requests_tokens_from_its_blocks(lens, bs, offset_blocks, use_offset, cumsum, short, seed):
    g = torch.Generator().manual_seed(seed)
    blocks, width = 40, 8
    kc = torch.randn(blocks, bs, 1, 16, generator=g).to(torch.bfloat16)
    vc = torch.randn(blocks, bs, 1, 8, generator=g).to(torch.bfloat16)
    tables = torch.stack([torch.randperm(blocks, generator=g)[:width] for _ in lens]).int()
    offsets = [b * bs + (1 if b else 0) for b in offset_blocks[: len(lens)]] if use_offset else None
    rows = max(sum(lens) - short, 0)
    key = torch.full((rows, 1, 16), 7.0, dtype=torch.bfloat16, device=DEVICE)
    value = torch.full((rows, 1, 8), 7.0, dtype=torch.bfloat16, device=DEVICE)
    seq_lens = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()] if cumsum else lens, dtype=torch.int32)
    torch_npu.npu_gather_pa_kv_cache(
        kc.npu(),
        vc.npu(),
        tables.npu(),
        seq_lens.npu(),
        key=key,
        value=value,
        seq_offset=torch.tensor(offsets, dtype=torch.int32).npu() if offsets is not None else None,
        is_seq_lens_cumsum=cumsum,
    )
    npu.synchronize()
    want_k, want_v = _reference(kc, vc, tables, lens, offsets, rows)
    assert torch.equal(key.cpu(), want_k) and torch.equal(value.cpu(), want_v)


def test_gather_refuses_what_the_kernel_cannot_read():
    kc = torch.zeros(4, 4, 1, 16, dtype=torch.bfloat16, device=DEVICE)
    key = torch.zeros(8, 1, 16, dtype=torch.bfloat16, device=DEVICE)
    table = torch.tensor([[0, 1]], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="'key' rows are \\[1, 8\\], the cache's tokens \\[1, 16\\]"):
        torch_npu.npu_gather_pa_kv_cache(kc, kc, table, table[0], key=key[..., :8], value=key)
    with pytest.raises(ValueError, match="'block_tables' .*reads block 2 of a table 2 wide"):
        torch_npu.npu_gather_pa_kv_cache(
            kc,
            kc,
            table,
            torch.tensor([9], dtype=torch.int32, device=DEVICE),
            key=key[:0].new_zeros(12, 1, 16),
            value=key.new_zeros(12, 1, 16),
        )
        npu.synchronize()
