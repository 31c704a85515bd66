"""A re-issue that passes the previous update's own device arguments skips re-checking them
(npusim/runtime/taskgroups.py, ``reissues_previous``): the engine's every step.  Whatever a
caller does to those arguments between updates, the outcome is the one a first update
with the same arguments would have: the same refusal, or a replay that reads what the
arguments hold now."""

from __future__ import annotations

import gc

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import npusim as torch_npu
from npusim import npu
from tests.helpers import equal_on_host

SCALE = 0.125
T, N, KVN, D, NB, BS, COLS = 2, 4, 2, 16, 8, 16, 4

# what a caller may do to the arguments between two updates of one task group
ACTIONS = (
    "same",  # the engine's step: the same tensors, new lengths
    "new_table",  # another block-table tensor
    "move_table",  # the same block-table object set_ onto other memory
    "new_out",  # another output tensor
    "free_out",  # the output dropped, a new one allocated (perhaps at the same address)
    "other_scale",  # a scalar changed: refused
    "other_dtype",  # the tensors copied to another dtype: refused
    "reinterpret",  # views of the same memory in another dtype (same address, shape, stride): refused
    "drop_workspace",  # the workspace freed, None passed for it: refused
)


def _pa(args: dict, lens: torch.Tensor, scale: float = SCALE) -> None:
    torch_npu._npu_paged_attention(
        args["q"], args["kc"], args["vc"], KVN, N, scale, args["bt"], lens, args["out"], workspace=args["ws"]
    )


def _eager(args: dict, lens: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(args["q"])
    torch_npu._npu_paged_attention(args["q"], args["kc"], args["vc"], KVN, N, SCALE, args["bt"], lens, out)
    npu.synchronize()
    return out


def _table() -> torch.Tensor:
    return torch.randint(0, NB, (T, COLS), dtype=torch.int32).to("npu")


def _pa_args() -> dict:
    args = {
        "q": torch.randn(T, N, D, dtype=torch.float16, device="npu"),
        "kc": torch.randn(NB, BS, KVN, D, dtype=torch.float16, device="npu"),
        "vc": torch.randn(NB, BS, KVN, D, dtype=torch.float16, device="npu"),
        "bt": _table(),
        "ws": torch.empty(1 << 20, dtype=torch.uint8, device="npu"),
    }
    args["out"] = torch.empty_like(args["q"])
    return args


@settings(max_examples=25)
@given(
    steps=st.lists(
        st.tuples(st.sampled_from(ACTIONS), st.lists(st.integers(1, COLS * BS), min_size=T, max_size=T)),
        min_size=1,
        max_size=8,
    ),
    seed=st.integers(0, 2**16),
)
def test_a_reissue_after_any_change_to_its_arguments_is_what_a_first_update_gives(steps, seed) -> None:
    torch_npu.configure()  # a fresh device for each example
    torch.manual_seed(seed)
    args = _pa_args()
    g, ev = npu.NPUGraph(), npu.ExternalEvent()
    with npu.graph(g):
        s = npu.current_stream()
        ev.wait(s)
        npu.graph_task_group_begin(s)
        _pa(args, torch.full((T,), BS, dtype=torch.int32))
        h = npu.graph_task_group_end(s)
    us = npu.Stream()
    good: tuple[dict, torch.Tensor] | None = None  # the arguments of the last update that landed
    for action, lengths in steps:
        lens = torch.tensor(lengths, dtype=torch.int32)
        scale, call = SCALE, dict(args)
        if action == "new_table":
            call["bt"] = args["bt"] = _table()
        elif action == "move_table":
            other = _table()
            args["bt"].set_(other.untyped_storage(), 0, other.shape, other.stride())
        elif action == "new_out":
            call["out"] = args["out"] = torch.empty_like(args["q"])
        elif action == "free_out":
            del args["out"], call["out"]
            gc.collect()
            call["out"] = args["out"] = torch.empty_like(args["q"])
        elif action == "other_scale":
            scale = SCALE * 2
        elif action == "other_dtype":
            call.update({k: args[k].to(torch.bfloat16) for k in ("q", "kc", "vc", "out")})
        elif action == "reinterpret":
            call.update({k: args[k].view(torch.bfloat16) for k in ("q", "kc", "vc", "out")})
        elif action == "drop_workspace":
            args["ws"] = call["ws"] = None
            if good is not None:
                good[0]["ws"] = None
            gc.collect()
        with npu.stream(us):
            npu.graph_task_update_begin(us, h)
            if action in ("other_scale", "other_dtype", "reinterpret", "drop_workspace"):
                with pytest.raises(torch_npu.UpdateMismatchError):
                    _pa(call, lens, scale)
                if action == "drop_workspace":
                    args["ws"] = torch.empty(1 << 20, dtype=torch.uint8, device="npu")
            else:
                _pa(call, lens, scale)
                good = (dict(call), lens)
            npu.graph_task_update_end(us)
            ev.record(us)
        g.replay()
        npu.synchronize()
        if good is not None:
            landed, landed_lens = good
            assert equal_on_host(landed["out"], _eager(landed, landed_lens)), action
    g.reset()


def _fia(args: dict, ends: list[int], kv: list[int], out: torch.Tensor, scale: float = SCALE) -> None:
    torch_npu.npu_fused_infer_attention_score.out(
        args["q"],
        args["k"],
        args["v"],
        actual_seq_lengths=ends,
        actual_seq_lengths_kv=kv,
        block_table=args["bt"],
        num_heads=N,
        scale=scale,
        input_layout="TND",
        num_key_value_heads=KVN,
        block_size=BS,
        softmax_lse_flag=False,
        sparse_mode=0,
        atten_mask=None,
        workspace=args["ws"],
        out=[out, args["lse"]],
    )


def _outcome(fn, *args) -> str:
    """``ok``, or the error ``fn(*args)`` raised (its type and message)."""
    try:
        fn(*args)
    except (ValueError, torch_npu.UpdateMismatchError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


@settings(max_examples=60)
@example(steps=[("same", [1, 2], [16]), ("same", [1, 2], [COLS * BS + 1])])  # keys past the table
@example(steps=[("same", [1, 2], [16]), ("same", [1, 2, 2], [16])])  # three requests, two table rows
@example(steps=[("same", [1, 2], [16]), ("same", [2, 2], [16])])  # a request with no query token
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(("same", "same", "new_table", "other_scale")),
            st.sampled_from(([1, 2], [1, 1], [2, 2], [1, 2, 2])),  # TND ends: T = 2 tokens
            st.lists(  # past the table's keys too
                st.integers(0, COLS * BS) | st.sampled_from((COLS * BS + 1, COLS * BS + 3)), min_size=1, max_size=3
            ),
        ),
        min_size=1,
        max_size=8,
    ),
)
def test_fia_rechecks_only_the_lengths_and_refuses_them_as_its_whole_check_does(steps) -> None:
    """FIA's re-issue with the previous update's tensors checks only its lengths
    (``fia_lengths``): each refusal, and each answer, is what a first launch gives."""
    torch_npu.configure()
    args = {
        "q": torch.randn(T, N, D, dtype=torch.float16, device="npu"),
        "bt": _table(),
        "lse": torch.empty(1, dtype=torch.float32, device="npu"),
        "ws": torch.empty(1 << 20, dtype=torch.uint8, device="npu"),
    }
    args["k"], args["v"] = (torch.randn(NB, BS, KVN * D, dtype=torch.float16, device="npu") for _ in "kv")
    out = torch.empty_like(args["q"])
    g, ev = npu.NPUGraph(), npu.ExternalEvent()
    with npu.graph(g):
        s = npu.current_stream()
        ev.wait(s)
        npu.graph_task_group_begin(s)
        _fia(args, [1, 2], [BS, BS], out)
        h = npu.graph_task_group_end(s)
    us = npu.Stream()
    landed: tuple[list[int], list[int], torch.Tensor] | None = None
    kept: list[torch.Tensor] = []
    for action, ends, kv in steps:
        scale = SCALE * 2 if action == "other_scale" else SCALE
        if action == "new_table":
            kept.append(args["bt"])  # the graph reads it until an update replaces it
            args["bt"] = _table()
        first = torch.empty_like(args["q"])  # a first launch of the same call: the oracle
        expected = _outcome(_fia, args, ends, kv, first, scale)
        if expected == "ok" and action == "other_scale":
            expected = "UpdateMismatchError"
        with npu.stream(us):
            npu.graph_task_update_begin(us, h)
            got = _outcome(_fia, args, ends, kv, out, scale)
            # a call its check refused issued no task: the session ends with that said
            ended = _outcome(npu.graph_task_update_end, us)
            assert ended == "ok" or got.startswith("ValueError"), ended
            ev.record(us)
        assert got.startswith(expected), (action, ends, kv)
        if got == "ok":
            npu.synchronize()
            landed = (ends, kv, first)
        g.replay()
        npu.synchronize()
        if landed is not None:
            assert equal_on_host(out, landed[2])
    g.reset()


@pytest.mark.parametrize(
    ("lens", "refusal"),
    [
        (torch.tensor([3, 5, 7], dtype=torch.int32), "has 3 entries for 2 query tokens"),
        (torch.tensor([3, 5], dtype=torch.int64), "must be an int32 CPU tensor"),
        (torch.tensor([[3, 5]], dtype=torch.int32), "must have 1 dims"),
    ],
)
def test_pa_rechecks_its_context_lengths_as_its_whole_check_does(lens: torch.Tensor, refusal: str) -> None:
    """PA's re-issue with the previous update's tensors checks its context lengths alone
    (``_pa_lengths``), and refuses what a first launch refuses."""
    args = _pa_args()
    with pytest.raises(ValueError, match=refusal):
        _pa(args, lens)  # a first launch
    g = npu.NPUGraph()
    with npu.graph(g):
        s = npu.current_stream()
        npu.graph_task_group_begin(s)
        _pa(args, torch.full((T,), BS, dtype=torch.int32))
        h = npu.graph_task_group_end(s)
    us = npu.Stream()
    with npu.stream(us):
        for _ in range(2):  # the second re-issues the first's tensors
            npu.graph_task_update_begin(us, h)
            _pa(args, torch.tensor([7, 9], dtype=torch.int32))
            npu.graph_task_update_end(us)
        npu.graph_task_update_begin(us, h)
        with pytest.raises(ValueError, match=refusal):
            _pa(args, lens)
        with pytest.raises(torch_npu.UpdateMismatchError, match="0 ops were issued"):
            npu.graph_task_update_end(us)
    g.replay()
    npu.synchronize()
    assert equal_on_host(args["out"], _eager(args, torch.tensor([7, 9], dtype=torch.int32)))
    g.reset()
