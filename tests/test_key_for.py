"""``Runtime.key_for`` and ``step()`` share one padding rule (``npugraph.metadata.batch_refusal``).

An engine that decodes several tokens per request (speculative verification) captures
keys of ``request rows x tokens per request``; a batch whose rows are all real but whose
tokens do not fill the graph has no padding row for its spare tokens.  ``key_for`` must
never hand out a key that ``step()`` then refuses, and never skip a smaller one it accepts.
"""

from __future__ import annotations

import itertools
import random

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from npugraph import AttentionMetadata
from npugraph.errors import BatchRefused, MetadataError, UnknownKeyError
from npugraph.metadata import batch_refusal
from npugraph.reference import paged_attention_reference

from .helpers import BLOCK, BLOCKS, MAX_LEN, TOL, Harness, query_for


def _meta(q_lens, rng):
    """Real requests with these query lengths (cumulative ends in query_start_loc), random
    key lengths of at least their query, distinct blocks."""
    lens = [rng.randint(max(q, 1), MAX_LEN) for q in q_lens]
    table = torch.zeros(len(lens), MAX_LEN // BLOCK, dtype=torch.int32)
    pool = rng.sample(range(BLOCKS), BLOCKS)
    at = 0
    for i, n in enumerate(lens):
        used = -(-n // BLOCK)
        if at + used > BLOCKS:  # out of distinct blocks: reuse (attention only reads them)
            at = 0
        table[i, :used] = torch.tensor(pool[at : at + used], dtype=torch.int32)
        at += used
    qsl = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    return AttentionMetadata(seq_lens=torch.tensor(lens, dtype=torch.int32), block_table=table, query_start_loc=qsl)


def _runs(h, key, meta, q):
    """Whether step() runs ``meta`` on ``key``'s graph; a refusal must be the padding rule's,
    typed BatchRefused, and what ``Runtime.refusal`` says without stepping."""
    said = h.rt.refusal(key, {"default": meta})
    try:
        out = h.step(key, {"default": meta}, q)
    except MetadataError as err:
        assert isinstance(err, BatchRefused), err
        why = ("do not fit", "need a padding row", "runs one query token per request", "query tokens, but")
        assert any(w in str(err) for w in why), err
        assert said == str(err), (said, str(err))
        return None
    assert said is None, said
    return out.clone()


def _check_against_reference(h, out, q, meta, q_lens):
    """The real tokens' attention equals the float64 reference (no npugraph padding on
    that path); every spare token is zeros."""
    real = sum(q_lens)
    k, v = h.caches["layer0"]
    ref = paged_attention_reference(
        q[0, :real], k, v, meta.block_table, meta.seq_lens.tolist(), h.attn["layer0"].scale, list(q_lens)
    )
    if real:
        assert (out[0, 0, :real].cpu().double() - ref).abs().max().item() < TOL[h.dtype]
    assert not out[0, 0, real:].any(), "spare tokens must be zeros"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.lists(st.integers(1, 5), min_size=1, max_size=4, unique=True),
    tokens_per_request=st.sampled_from([1, 2, 3]),
    batches=st.lists(st.lists(st.integers(0, 3), max_size=6), min_size=1, max_size=5),
    seed=st.integers(0, 2**16),
)
def test_key_for_returns_the_smallest_key_that_step_runs(rows, tokens_per_request, batches, seed):
    """For any captured key set and any batch (requests, query lengths): key_for's key is
    run by step() and no smaller captured key is; when it raises, no captured key runs it."""
    h = Harness(rows, layers=1, tokens_per_request=tokens_per_request)
    rng = random.Random(seed)
    by_size = sorted(rows)  # key = request rows; tokens = rows x tokens_per_request: one order for both
    for q_lens in batches:
        # a real request has a query token; decode graphs (tokens_per_request 1) also get requests of 2,
        # which their kernels (PA, FIA without a causal mask) cannot run
        q_lens = [min(q or 1, max(tokens_per_request, 2)) for q in q_lens]
        meta = _meta(q_lens, rng)
        n, r = sum(q_lens), len(q_lens)
        runs = {}
        for key in by_size:
            q = query_for(h, key, seed)
            runs[key] = (_runs(h, key, meta, q), q)
        try:
            chosen = h.rt.key_for(n, r)
        except UnknownKeyError as err:
            assert all(out is None for out, _ in runs.values()), f"{err} but step() ran one of {runs}"
            continue
        out, q = runs[chosen]
        assert out is not None, f"key_for({n}, {r}) = {chosen}, which step() refuses"
        assert all(runs[k][0] is None for k in by_size if k < chosen), f"a key below {chosen} runs ({n}, {r})"
        _check_against_reference(h, out, q, meta, q_lens)


def test_the_speculative_cases_from_the_issue():
    """Keys 3, 9, 15, 21, 39 = request rows x 3: one request of 2 tokens needs key 9 (key 3's
    only row is real, 2 < 3 tokens); 13 requests with 34 tokens fit no graph (key 39's 13
    rows are all real)."""
    h = Harness([1, 3, 5, 7, 13], layers=1, tokens_per_request=3)
    assert h.rt.key_for(2, 1) == 3  # the harness's keys are rows; 3 rows hold 9 tokens
    assert h.rt.key_for(3, 1) == 1
    assert h.rt.key_for(9, 3) == 3
    with pytest.raises(UnknownKeyError, match=r"the largest, 13: all 13 captured request rows are real"):
        h.rt.key_for(34, 13)
    assert h.rt.key_for(36, 12) == 13


@given(st.integers(0, 8), st.integers(0, 30), st.integers(1, 8), st.integers(1, 4))
def test_batch_refusal_is_the_padding_rule(r, n, rows, tokens_per_request):
    """batch_refusal accepts exactly the batches the padding rule can lay out."""
    tokens = rows * tokens_per_request
    ok = batch_refusal(rows, tokens, r, n) is None
    assert ok == (r <= rows and n <= tokens and (r < rows or n == tokens))


def test_a_refusable_step_is_refused_before_the_device_unreported_and_the_next_step_is_right(tmp_path):
    """An engine that runs a refused batch eagerly (vLLM's wrapper) makes one call: the step
    raises BatchRefused before any device call, writes no post-mortem, and the graph serves the
    next batch right.  Without ``refusable`` the same refusal is a reported MetadataError."""
    h = Harness([2], layers=2, tokens_per_request=2, postmortem_dir=str(tmp_path))
    spare = attrs.evolve(  # 3 of 4 tokens, both rows real
        h.random_meta(2, [40, 70]), query_start_loc=torch.tensor([0, 1, 3], dtype=torch.int32)
    )
    work = h.rt.device.device_seconds()
    with pytest.raises(BatchRefused, match="need a padding row"):
        h.rt.step(2, {"default": spare}, refusable=True)
    h.rt.synchronize()
    assert h.rt.device.device_seconds() == work, "no device work for a refused step"
    assert not list(tmp_path.iterdir()), "a refusal the caller handles is no fault"
    with pytest.raises(BatchRefused):
        h.rt.step(2, {"default": spare})
    assert list(tmp_path.iterdir()), "an unhandled refusal is reported"
    # the next good step runs, and right: one request of two tokens, a padding row
    good = h.random_meta(1, [90])
    q = query_for(h, 2, 0)
    out = h.step(2, {"default": good}, q)
    for i, name in enumerate(h.names):
        ref = h.reference(name, q[0], good)
        assert (out[0, i, :2].cpu().double() - ref).abs().max().item() < TOL[h.dtype]
