"""``torch_npu._apply_patches``: torch_npu's way of pointing torch's names at its own.

Each patch is ``[dotted path under torch, value]``: the value replaces ``torch.<path>``
(a missing module on the way is made empty, as torch_npu makes it); a module value with an
``__all__`` is merged into an existing module name by name.  SGLang calls it at start-up to
point ``torch.profiler.profile`` and ``ProfilerActivity`` at torch_npu's.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["_apply_patches"]


def _owner(path: list[str]) -> Any:
    """The object holding ``path[-1]`` under torch, making empty modules where none is."""
    obj: Any = torch
    for name in path[:-1]:
        if not hasattr(obj, name):
            made = types.ModuleType(f"{obj.__name__}.{name}")
            sys.modules[made.__name__] = made
            setattr(obj, name, made)
        obj = getattr(obj, name)
    return obj


def _apply_patches(monkey_patches: Sequence[Sequence[Any]]) -> None:
    for dest, patch in monkey_patches:
        path = str(dest).split(".")
        owner, last = _owner(path), path[-1]
        if not isinstance(patch, types.ModuleType):
            setattr(owner, last, patch)
            continue
        if not hasattr(owner, last) or not hasattr(patch, "__all__"):
            setattr(owner, last, patch)
            sys.modules[f"{owner.__name__}.{last}"] = patch
            continue
        target = getattr(owner, last)
        for attr in patch.__all__:
            setattr(target, attr, getattr(patch, attr))
