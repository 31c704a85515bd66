"""The pure rules under every update, stated as properties: padding, PA's length probes and workspace."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from npugraph.device import load_device
from npugraph.metadata import AttentionMetadata, capture_lens, eager_rows, pad_lens
from npugraph.ops import PA, AttentionCall
from npugraph.ops.pa import _probe_lengths
from npusim import kernels


@st.composite
def steps(draw):
    """A valid step: R real requests (q tokens each >= 1) in a graph of B rows and T tokens."""
    r = draw(st.integers(0, 6))
    q_lens = draw(st.lists(st.integers(1, 4), min_size=r, max_size=r))
    kv = [q + draw(st.integers(0, 50)) for q in q_lens]
    batch = draw(st.integers(max(r, 1), 10))
    real = sum(q_lens)
    # with every row real there is no padding row for spare tokens, so none may be spare
    tokens = real if r == batch else draw(st.integers(real + (batch - r), real + 3 * (batch - r) + 2))
    decode = all(q == 1 for q in q_lens) and draw(st.booleans())
    return kv, None if decode else list(itertools.accumulate(q_lens)), batch, tokens


@given(steps())
def test_padding_keeps_real_requests_and_spreads_spare_tokens_evenly(step):
    kv, ends, batch, tokens = step
    r = len(kv)
    lens = pad_lens(kv, ends, batch, tokens)
    assert lens.num_reqs == r
    assert lens.kv_lens == tuple(kv) + (0,) * (batch - r), "padding requests have no keys"
    real_ends = tuple(ends) if ends is not None else tuple(range(1, r + 1))
    assert lens.q_ends[:r] == real_ends, "a real request's query tokens never change"
    assert len(lens.q_ends) == batch
    if batch > r:
        assert lens.q_ends[-1] == tokens, "every spare token belongs to a padding request"
        starts = (real_ends[-1] if r else 0, *lens.q_ends[r:-1])
        sizes = [e - s for s, e in zip(starts, lens.q_ends[r:])]
        assert max(sizes) - min(sizes) <= 1, f"spread evenly: {sizes}"
        assert sizes == sorted(sizes), "the larger shares last"
        assert min(sizes) >= 1, "a padding request has a query token"


def _metadata(kv, ends):
    qsl = None if ends is None else torch.tensor([0, *ends], dtype=torch.int32)
    return AttentionMetadata(
        seq_lens=torch.tensor(kv, dtype=torch.int32),
        block_table=torch.zeros(len(kv), 1, dtype=torch.int32),
        query_start_loc=qsl,
    )


@given(steps())
def test_a_captured_call_is_as_wide_as_its_longest_request_and_pads_to_its_rows(step):
    kv, ends, batch, tokens = step
    width, lens = capture_lens(_metadata(kv, ends), tokens=tokens, rows=batch, tokens_per_request=1)
    longest = max((b - a for a, b in itertools.pairwise([0, *(ends or ())])), default=1)
    assert width >= longest, "a request's tokens all fit its causal window"
    assert width * batch >= tokens, "the graph's tokens fit its rows"
    assert width == 1 or width == max(longest, -(-tokens // batch)), "no wider than it must be"
    assert lens == pad_lens(kv, ends, batch, tokens), "captured with the padding rule's lengths"


@given(steps())
def test_an_eager_call_adds_a_padding_row_only_for_spare_tokens_with_no_row(step):
    kv, ends, batch, tokens = step
    if ends is None:
        ends = list(range(1, len(kv) + 1))
    rows, width = eager_rows(_metadata(kv, ends), tokens=tokens, rows=len(kv), tokens_per_request=1)
    spare = tokens > (ends[-1] if ends else 0)
    assert rows == len(kv) + (1 if spare else 0)
    assert width == max((b - a for a, b in itertools.pairwise([0, *ends])), default=1)


def test_padding_examples():
    assert pad_lens([5, 7], None, 4, 4).q_ends == (1, 2, 3, 4)
    assert pad_lens([5, 7], [2, 4], 4, 9).q_ends == (2, 4, 6, 9)
    assert pad_lens([], None, 3, 3).q_ends == (1, 2, 3)
    assert pad_lens([], None, 2, 5).q_ends == (2, 5)
    assert pad_lens([3], [2], 1, 2) == pad_lens((3,), (2,), 1, 2)


@given(st.integers(1, 70_000), st.sampled_from([16, 64, 128]))
def test_pa_probes_cover_the_range(max_len, block_size):
    pts = _probe_lengths(max_len, block_size)
    assert pts == sorted(set(pts)), "sorted, each once"
    assert pts[0] == 1 and pts[-1] == max_len
    p = 1
    while p < max_len:
        assert p in pts and p + 1 in pts, f"{p} and {p + 1}: the kernel's tiling changes at powers of two"
        p *= 2
    stride = max(block_size, max_len // 256)
    assert all(x in pts for x in range(stride, max_len + 1, stride)), "an even sweep"
    assert len(pts) <= max_len // stride + 2 * math.ceil(math.log2(max_len + 1)) + 2, "bounded: capture stays fast"


def test_pa_probe_examples():
    assert _probe_lengths(1, 16) == [1]
    assert _probe_lengths(5, 16) == [1, 2, 3, 4, 5]
    assert _probe_lengths(40, 16) == [1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 40]
    assert _probe_lengths(15, 16) == [1, 2, 3, 4, 5, 8, 9, 15], "nothing past max_len"
    assert _probe_lengths(47, 16) == [1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 47]


@pytest.mark.parametrize(
    ("batch", "kv_heads", "max_len"), [(1, 1, 64), (4, 2, 128), (2, 8, 3000), (8, 4, 8192), (3, 1, 5000)]
)
def test_pa_workspace_is_the_maximum_over_every_length(batch, kv_heads, max_len):
    """Exactly the most the kernel's model needs at any length up to max_model_len:
    never less (corruption on hardware), never more (a wasted pool block per graph)."""
    heads, d, bs = 8, 128, 128
    nb = -(-max_len // bs) * batch
    call = AttentionCall(
        query=torch.zeros(batch, heads, d, dtype=torch.float16),
        key_cache=torch.zeros(nb, bs, kv_heads, d, dtype=torch.float16),
        value_cache=torch.zeros(nb, bs, kv_heads, d, dtype=torch.float16),
        block_table=torch.zeros(batch, -(-max_len // bs), dtype=torch.int32),
        out=torch.zeros(batch, heads, d, dtype=torch.float16),
        num_heads=heads,
        num_kv_heads=kv_heads,
        scale=d**-0.5,
    )
    lens = pad_lens([1] * batch, None, batch, batch)
    got = PA.workspace_bytes(load_device("sim"), PA.arguments(call, lens, None), max_len)
    want = max(kernels.pa_workspace_bytes(batch, heads, kv_heads, d, n) for n in range(max_len + 1))
    assert got == want
