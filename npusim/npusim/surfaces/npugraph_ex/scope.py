"""``npugraph_ex.scope.limit_core_num``: a scope in which ops may use only so many cores.

torchair marks the scope's ends with two side-effect ops (``npugraph_ex::scope_enter`` and
``scope_exit``) that a compiled graph carries and its compiler turns into core limits.  The
simulated device has no cores to limit: the ops are registered (a graph may carry them),
do nothing when run, and the compiler removes them.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["limit_core_num", "register_ops", "remove_scope_markers"]

_NAMESPACE = "npugraph_ex"


def register_ops() -> None:
    """Define ``npugraph_ex::scope_enter(str[] keys, str[] values)`` and ``scope_exit()``
    (once per process)."""
    if hasattr(torch.ops, _NAMESPACE) and hasattr(getattr(torch.ops, _NAMESPACE), "scope_enter"):
        return
    torch.library.define(f"{_NAMESPACE}::scope_enter", "(str[] keys, str[] values) -> ()")
    torch.library.define(f"{_NAMESPACE}::scope_exit", "() -> ()")
    for name in ("scope_enter", "scope_exit"):
        torch.library.impl(f"{_NAMESPACE}::{name}", "CompositeExplicitAutograd")(lambda *args, **kwargs: None)
        torch.library.register_fake(f"{_NAMESPACE}::{name}")(lambda *args, **kwargs: None)


class limit_core_num:  # torchair's name, a class used as a context manager
    """``with limit_core_num(aicore, vectorcore[, stream])``: the ops inside may use at most
    that many AI cores and vector cores (nothing to limit on the simulated device)."""

    def __init__(self, op_aicore_num: int, op_vectorcore_num: int, stream: Any = None) -> None:
        self.values = [str(op_aicore_num), str(op_vectorcore_num)]

    def __enter__(self) -> None:
        torch.ops.npugraph_ex.scope_enter(["_op_aicore_num", "_op_vectorcore_num"], self.values)

    def __exit__(self, *exc: object) -> None:
        torch.ops.npugraph_ex.scope_exit()


def remove_scope_markers(g: torch.fx.Graph) -> None:
    for node in list(g.nodes):
        if node.op == "call_function" and str(node.target).startswith(f"{_NAMESPACE}.scope_"):
            g.erase_node(node)
