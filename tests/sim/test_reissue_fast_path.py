"""A re-issue that passes the previous update's own device arguments skips re-checking them
(npusim/runtime/taskgroups.py, ``reissues_previous``): the engine's every step.  Whatever a
caller does to those arguments between updates, the outcome is the one a first update
with the same arguments would have: the same refusal, or a replay that reads what the
arguments hold now."""

from __future__ import annotations

import gc

import pytest
import torch
from hypothesis import given, settings
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
    args = {
        "q": torch.randn(T, N, D, dtype=torch.float16, device="npu"),
        "kc": torch.randn(NB, BS, KVN, D, dtype=torch.float16, device="npu"),
        "vc": torch.randn(NB, BS, KVN, D, dtype=torch.float16, device="npu"),
        "bt": _table(),
        "ws": torch.empty(1 << 20, dtype=torch.uint8, device="npu"),
    }
    args["out"] = torch.empty_like(args["q"])
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
