"""Misordered halves are named at the call that made them (``StepOrderWarning``).

``update(k); replay(k)`` in replay-first order looks natural but discards the update and
queues a replay that waits for an update that never comes; before, only the next
``synchronize()`` said so (``GraphDeadlock``).  Every half step that throws away work
nobody ran now warns at the caller's line, once per graph and kind, and the runtime goes
on as the step protocol's table says: a warning turned into an error changes nothing of
that, and the next good step is right.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from npugraph.errors import GraphDeadlock, StepOrderWarning
from npugraph.replay import StepPhase

from .helpers import Harness, query_for


def _harness(order):
    return Harness([2, 4], layers=2, order=order)


def _good_step(h, size, seed):
    """A complete step through step(), checked against the float64 reference."""
    meta = h.random_meta(size - 1)
    q = query_for(h, size, seed)
    out = h.step(size, {"default": meta}, q)
    h.check(out, q, dict.fromkeys(h.names, meta))


def _order_warnings(record):
    return [w for w in record if issubclass(w.category, StepOrderWarning)]


def test_update_then_replay_in_replay_first_order_is_named_at_the_replay():
    h = _harness("replay-first")
    meta = {"default": h.random_meta(3)}
    h.rt.update(4, meta)
    with pytest.warns(StepOrderWarning) as record:
        h.rt.replay(4)
    (w,) = _order_warnings(record)
    message = str(w.message)
    assert message.startswith("main/4: this replay discarded the update made before it, which no replay ran.")
    assert "In replay-first order a step is replay() then update()" in message
    assert w.filename == __file__, "the warning points at the caller's line, not npugraph's"
    assert h.rt.graph_state(4).phase is StepPhase.REPLAY_QUEUED, "the transition is the table's"
    # the same mistake again on this graph: said once
    h.rt.update(4, meta)  # completes the waiting replay (it runs this update)
    h.rt.update(4, meta)
    with warnings.catch_warnings():
        warnings.simplefilter("error", StepOrderWarning)
        h.rt.replay(4)
    with pytest.raises(GraphDeadlock, match=r"main/4|key 4"):
        h.rt.synchronize()  # the waiting replay is still released, as before
    _good_step(h, 4, seed=1)


def test_a_second_replay_while_one_waits_is_named():
    h = _harness("replay-first")
    h.rt.replay(4)
    with pytest.warns(StepOrderWarning, match=r"^main/4: this replay came while its previous replay still waited"):
        h.rt.replay(4)
    h.rt.update(4, {"default": h.random_meta(2)})
    h.rt.synchronize()
    _good_step(h, 4, seed=2)


def test_another_graphs_step_names_the_replay_it_abandons():
    h = _harness("replay-first")
    h.rt.replay(4)
    meta = h.random_meta(1)
    q = query_for(h, 2, 3)
    with pytest.warns(StepOrderWarning, match=r"^main/4: this call on main/2 released this graph's replay"):
        out = h.step(2, {"default": meta}, q)
    h.check(out, q, dict.fromkeys(h.names, meta))


def test_update_then_update_in_update_first_order_is_named_at_the_second_update():
    h = _harness("update-first")
    h.rt.update(4, {"default": h.random_meta(3)})
    with pytest.warns(StepOrderWarning) as record:
        h.rt.update(4, {"default": h.random_meta(2)})
    (w,) = _order_warnings(record)
    assert str(w.message).startswith("main/4: this update discarded the update made before it")
    assert "In update-first order a step is update() then replay()" in str(w.message)
    assert w.filename == __file__


@pytest.mark.parametrize("order", ["replay-first", "update-first"])
def test_good_steps_never_warn(order):
    h = _harness(order)
    with warnings.catch_warnings():
        warnings.simplefilter("error", StepOrderWarning)
        for i in range(4):
            _good_step(h, 4 if i % 2 else 2, seed=i)
        meta = h.random_meta(3)
        q = query_for(h, 4, 9)
        h.rt.copy_inputs(h.rt.entry(4), {"query": q}, None)
        halves = (h.rt.replay, lambda k: h.rt.update(k, {"default": meta}))
        for half in halves if order == "replay-first" else halves[::-1]:
            half(4)
        h.rt.synchronize()
        h.check(h.rt.entry(4).outputs, q, dict.fromkeys(h.names, meta))


@pytest.mark.parametrize("order", ["replay-first", "update-first"])
def test_a_misordered_half_raised_as_an_error_leaves_the_runtime_serving(order):
    """With StepOrderWarning as an error, the misordered call raises after its transition:
    the graph is where the table says, and the next good step succeeds and is right."""
    h = _harness(order)
    with warnings.catch_warnings():
        warnings.simplefilter("error", StepOrderWarning)
        h.rt.update(4, {"default": h.random_meta(3)})
        with pytest.raises(StepOrderWarning):
            if order == "replay-first":
                h.rt.replay(4)
            else:
                h.rt.update(4, {"default": h.random_meta(3)})
        expected = StepPhase.REPLAY_QUEUED if order == "replay-first" else StepPhase.UPDATED
        assert h.rt.graph_state(4).phase is expected
        # the next good step: replay-first's step() releases the waiting replay, a second kind
        # said once; update-first's discards nothing more
        try:
            _good_step(h, 4, seed=5)
        except StepOrderWarning:
            _good_step(h, 4, seed=5)
        _good_step(h, 4, seed=6)
    assert torch.equal(h.rt.entry(4).outputs, h.rt.entry(4).outputs)
