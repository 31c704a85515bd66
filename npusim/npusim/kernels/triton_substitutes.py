"""Known Triton kernels of other projects, computed with torch instead of Triton's interpreter.

Triton's interpreter runs a kernel's Python once per program instance, a NumPy call per
``tl`` operation: vllm-ascend's rope kernel took 0.3 to 2 s of each 32-layer decode step on
the simulator, and about 10 s of each small engine's start.  A kernel listed here is
recognised by the SHA-256 of its source text (exactly as its file has it, from ``@triton.jit``'s
``def`` on) and computed by a torch function that does what the kernel does, operation for
operation in float32, on the same memory.  Each substitute is checked against the interpreter
running the real kernel, on random inputs and shapes, in the environment of every release that
ships it (``tests/sim/test_triton_substitutes.py``, run by ``make release-check``).  A kernel of
a listed name whose source differs (a newer release changed it) runs in the interpreter,
and the simulator says so once: a substitute is only ever used for the source it was
checked against.

Adding one: write its function here, add its source's digest (``source_digest``) to
:data:`SUBSTITUTES`, and its case to the test.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch

__all__ = ["Substitute", "SUBSTITUTES", "source_digest", "substitute_for"]


@attrs.frozen
class Substitute:
    """A torch computation standing for one Triton kernel's source.

    ``run(args, grid)``: ``args`` the kernel's parameters by name as the launch bound them
    (host tensors for pointers, ints, constexprs), ``grid`` the launch grid (three ints)."""

    kernel: str  # the kernel's function name
    origin: str  # where that source is from, for messages
    run: Callable[[Mapping[str, Any], tuple[int, int, int]], None]


def source_digest(source: str) -> str:
    """The digest a kernel's source is known by (its text from the ``def`` line on)."""
    start = source.find("def ")
    return hashlib.sha256(source[max(start, 0) :].encode()).hexdigest()


def _rows(t: torch.Tensor, rows: int, row_stride: int, width: int) -> torch.Tensor:
    """``rows`` rows of ``width`` elements, ``row_stride`` apart, from ``t``'s first element (a
    kernel's ``ptr + row * row_stride + col``)."""
    return t.as_strided((rows, width), (row_stride, 1), t.storage_offset())


def _rotate(
    x: torch.Tensor, row_stride: int, rows: int, heads: int, hd: int, rd: int, neox: bool, cos: Any, sin: Any
) -> None:
    """Rotate the first ``rd`` elements of each of ``heads`` heads of ``hd`` in place, as
    vllm-ascend's ``_triton_rope`` does: loaded as float32, ``x1 * cos - x2 * sin`` and
    ``x2 * cos + x1 * sin``, stored in ``x``'s dtype."""
    half = rd // 2
    view = x.as_strided((rows, heads, hd), (row_stride, hd, 1), x.storage_offset())
    if neox:
        x1, x2 = view[:, :, :half], view[:, :, half:rd]
    else:
        x1, x2 = view[:, :, 0:rd:2], view[:, :, 1:rd:2]
    a, b = x1.to(torch.float32), x2.to(torch.float32)  # x itself where it is float32
    c, s = cos[:, None, :], sin[:, None, :]
    first, second = a * c - b * s, b * c + a * s  # both from the loaded values, as the kernel's
    x1.copy_(first)
    x2.copy_(second)


def _vllm_ascend_rope(sin_from_padded_half: bool) -> Callable[[Mapping[str, Any], tuple[int, int, int]], None]:
    """vllm-ascend's ``_triton_rope`` (``vllm_ascend/ops/triton/rope.py``): rows of q and k
    rotated in place.  Its grid strides over the rows, so any grid of at least one program
    covers them all.  With ``USE_COS_SIN`` each row's cos and sin come from the cache row of
    its position: cos at ``[0, rope_dim/2)``, sin from ``rope_dim/2`` (0.30) or from
    ``pad_rope_dim/2`` (0.23.0.post1's kernel, ``sin_from_padded_half``) on."""

    def run(a: Mapping[str, Any], grid: tuple[int, int, int]) -> None:
        rows = int(a["num_tokens"])
        if rows <= 0 or min(grid) <= 0:
            return
        half = int(a["rope_dim"]) // 2
        if a["USE_COS_SIN"]:
            pos = _rows(a["pos_ptr"], rows, 1, 1)[:, 0].to(torch.int64)
            table = a["cos_sin_ptr"]
            stride = int(a["cos_sin_row_stride"])
            sin_at = int(a["pad_rope_dim"]) // 2 if sin_from_padded_half else half
            span = int(pos.max()) + 1
            cache = table.as_strided((span, sin_at + half), (stride, 1), table.storage_offset())[pos]
            cos, sin = cache[:, :half], cache[:, sin_at : sin_at + half]
        else:
            cos = _rows(a["cos_ptr"], rows, int(a["cos_row_stride"]), half)
            sin = _rows(a["sin_ptr"], rows, int(a["sin_row_stride"]), half)
        cos, sin = cos.to(torch.float32), sin.to(torch.float32)
        hd, rd, neox = int(a["hd"]), 2 * half, bool(a["IS_NEOX_STYLE"])
        _rotate(a["q_ptr"], int(a["q_row_stride"]), rows, int(a["n_qh"]), hd, rd, neox, cos, sin)
        _rotate(a["k_ptr"], int(a["k_row_stride"]), rows, int(a["n_kh"]), hd, rd, neox, cos, sin)

    return run


def _sglang_softcap(a: Mapping[str, Any], grid: tuple[int, int, int]) -> None:
    """SGLang's ``softcap_inplace_logits_kernel`` (``sglang/kernels/ops/activation/softcap.py``):
    rows of logits, each value ``x`` (widened to float32 with ``CAST_TO_FP32``) made
    ``tanh(x / cap) * cap`` with ``APPLY_SOFTCAP``, stored in place or into the float32
    output rows.  SGLang's graphs launch it every decode step (``cast_to_float32_logits``:
    the cast alone) to fill their logits buffer.  Program ``(pid, row)`` covers columns
    ``[pid * BLOCK_SIZE, (pid + 1) * BLOCK_SIZE)`` below ``ncols`` of row ``row``.  Triton
    divides a 16-bit block by the float32 cap in float32 (its rule for a division), and the
    rest follows in float32, rounded to the block's dtype where stored in place."""
    rows, width = int(grid[1]), min(int(a["ncols"]), int(grid[0]) * int(a["BLOCK_SIZE"]))
    if rows <= 0 or width <= 0:
        return
    src = _rows(a["full_logits_ptr"], rows, int(a["row_stride"]), width)
    x = src.to(torch.float32)
    if a["APPLY_SOFTCAP"]:
        cap = float(a["softcapping_value"])
        x = torch.tanh(x / cap) * cap
    if a["CAST_TO_FP32"]:
        _rows(a["output_ptr"], rows, int(a["output_row_stride"]), width).copy_(x)
    else:
        src.copy_(x)


# source digest -> substitute; each checked against the interpreter on that source
SUBSTITUTES: Mapping[str, Substitute] = {
    "35bfac04e67c9c242d1ad877a5efe243b362ee40e185cd4a220d7dfcca079f00": Substitute(
        "_triton_rope", "vllm-ascend 0.23.0.post1", _vllm_ascend_rope(sin_from_padded_half=True)
    ),
    "104e321d17cd2bb1d0fa217b14fe6e939cf01a9a8dacdccaa157ad59599174bb": Substitute(
        "_triton_rope", "vllm-ascend 0.30.0rc2", _vllm_ascend_rope(sin_from_padded_half=False)
    ),
    # SGLang 0.5.23's (the first with the cast alone, APPLY_SOFTCAP); its softcap is checked
    # against float64 only: Triton's interpreter cannot run libdevice's tanh
    "74a9b899fe9af2ce9691089226b5f78c7d66234c0fb9b6d13232d7ab09488c40": Substitute(
        "softcap_inplace_logits_kernel", "SGLang 0.5.23", _sglang_softcap
    ),
}
NAMES = frozenset(s.kernel for s in SUBSTITUTES.values())


def substitute_for(name: str, source: str) -> Substitute | None:
    """The substitute checked for this kernel source, or None (run it in the interpreter)."""
    return SUBSTITUTES.get(source_digest(source)) if name in NAMES else None
