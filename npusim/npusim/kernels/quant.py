"""Per-token dynamic int8 quantisation: ``npu_dynamic_quant`` and the fused
``npu_add_rms_norm_dynamic_quant``, with real math.

vllm-ascend's graph-fusion pass (``AddRMSNormQuantFusionPass``, on by default) registers the
pattern ``npu_add_rms_norm`` + ``npu_dynamic_quant`` → ``npu_add_rms_norm_dynamic_quant`` and
traces it on real ``npu`` tensors at registration, so both ops must run even for a model
that is not quantised (only W8A8-dynamic checkpoints match it).  CANN's DynamicQuant: per
row (the last dimension), ``scale = max|x| / 127`` in float32 and ``y = round(x / scale)``
as int8 (an optional ``smooth_scales`` multiplies ``x`` first); the fused op adds the
residual, RMS-normalises with ``gamma`` (and ``beta``), then quantises, and returns
``(y1, y2, x1 + x2, scale1, scale2)``, the second quantisation (``smooth_scale2``) only where
``output_mask`` asks for it.

Static quantisation, whose patterns the same pass registers once vllm-ascend's own custom ops
are there (0.30): ``npu_quantize`` (CANN's AscendQuantV3: ``y = round(x / scales +
zero_points)``, or ``x * scales`` with ``div_mode=False``, the scales broadcast along
``axis``) and the fused ``npu_add_rms_norm_quant`` (residual add, RMSNorm, then that
quantisation: ``(y1, y2, x1 + x2)``).
"""

from __future__ import annotations

from typing import Any

import torch

from npusim.kernels.dense import _kernel, check_residual_norm, residual_norm
from npusim.runtime.launch import fail, launch

__all__ = ["SCHEMAS", "npu_add_rms_norm_dynamic_quant", "npu_add_rms_norm_quant", "npu_dynamic_quant", "npu_quantize"]

# torch_npu's schemas (op-plugin's): keyword-only tensors, which torch.library.custom_op
# cannot infer, so they are declared as torch_npu declares them
SCHEMAS = {
    "npu_dynamic_quant": (
        "npu_dynamic_quant(Tensor input, *, Tensor? smooth_scales=None, Tensor? group_index=None, "
        "ScalarType? dst_type=None) -> (Tensor, Tensor)"
    ),
    "npu_add_rms_norm_dynamic_quant": (
        "npu_add_rms_norm_dynamic_quant(Tensor x1, Tensor x2, Tensor gamma, *, Tensor? smooth_scale1=None, "
        "Tensor? smooth_scale2=None, Tensor? beta=None, float epsilon=1e-06, bool[]? output_mask=None) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)"
    ),
    "npu_quantize": (
        "npu_quantize(Tensor self, Tensor scales, Tensor? zero_points, ScalarType dtype, int axis=1, "
        "bool div_mode=True) -> Tensor"
    ),
    "npu_add_rms_norm_quant": (
        "npu_add_rms_norm_quant(Tensor x1, Tensor x2, Tensor gamma, Tensor scales1, Tensor? zero_points1=None, "
        "Tensor? scales2=None, Tensor? zero_points2=None, int axis=-1, float epsilon=1e-06, bool div_mode=True) "
        "-> (Tensor, Tensor, Tensor)"
    ),
}
# torch_npu's quantised dtypes: the int8 (or uint8) tensor the kernel writes
_QUANT_TYPES = {torch.qint8: torch.int8, torch.int8: torch.int8, torch.quint8: torch.uint8, torch.uint8: torch.uint8}


def _quantize(x: torch.Tensor, y: torch.Tensor, scale: torch.Tensor) -> None:
    """``x`` (float32) to int8 per row: ``scale = max|x| / 127`` (a zero row: scale 0, y 0)."""
    s = x.abs().amax(dim=-1) / 127.0
    scale.copy_(s)
    q = torch.where(s.unsqueeze(-1) > 0, x / s.clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(-1), 0.0)
    y.copy_(q.round().clamp(-128, 127))


def _dynamic_quant(p: dict[str, Any]) -> None:
    x = p["input"].float()
    if p["smooth_scales"] is not None:
        x = x * p["smooth_scales"].float()
    _quantize(x, p["y"], p["scale"])


def _add_rms_norm_dynamic_quant(p: dict[str, Any]) -> None:
    n, _ = residual_norm(p)
    for i, (smooth, y, scale) in enumerate(
        ((p["smooth_scale1"], p["y1"], p["scale1"]), (p["smooth_scale2"], p["y2"], p["scale2"]))
    ):
        if not p["mask"][i]:
            continue
        _quantize(n * smooth.float() if smooth is not None else n, y, scale)


def _along(t: torch.Tensor, x: torch.Tensor, axis: int) -> torch.Tensor:
    """``t`` (one value, or one per index of ``x``'s ``axis``) shaped to broadcast over ``x``."""
    if t.numel() == 1:
        return t.float().reshape(())
    shape = [1] * x.dim()
    shape[axis] = t.numel()
    return t.float().reshape(shape)


def _static(
    x: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, axis: int, div: bool, y: torch.Tensor
) -> None:
    s = _along(scales, x, axis)
    q = x / s if div else x * s
    if zeros is not None:
        q = q + _along(zeros, x, axis)
    info = torch.iinfo(y.dtype)
    y.copy_(q.round().clamp(info.min, info.max))


def _quantize_static(p: dict[str, Any]) -> None:
    _static(p["input"].float(), p["scales"], p["zero_points"], int(p["axis"]), bool(p["div_mode"]), p["y"])


def _add_rms_norm_quant(p: dict[str, Any]) -> None:
    n, _ = residual_norm(p)
    for scales, zeros, y in ((p["scales1"], p["zero_points1"], p["y1"]), (p["scales2"], p["zero_points2"], p["y2"])):
        if scales is not None:
            _static(n, scales, zeros, int(p["axis"]), bool(p["div_mode"]), y)


def _check_scales(op: str, name: str, t: torch.Tensor | None, x: torch.Tensor, axis: int) -> None:
    if t is not None and t.numel() not in (1, x.shape[axis]):
        raise fail(op, name, f"has {t.numel()} values; it takes 1 or one per index of axis {axis} ({x.shape[axis]})")


_QUANTIZE = _kernel("npu_quantize", "input", ("y",), _quantize_static)
_ADD_RMS_NORM_QUANT = _kernel("npu_add_rms_norm_quant", "x1", ("y1", "y2", "x"), _add_rms_norm_quant)
_DYNAMIC_QUANT = _kernel("npu_dynamic_quant", "input", ("y", "scale"), _dynamic_quant)
_ADD_RMS_NORM_DQ = _kernel(
    "npu_add_rms_norm_dynamic_quant", "x1", ("y1", "y2", "x", "scale1", "scale2"), _add_rms_norm_dynamic_quant
)


def npu_dynamic_quant(
    input: torch.Tensor,
    *,
    smooth_scales: torch.Tensor | None = None,
    group_index: torch.Tensor | None = None,
    dst_type: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 quantisation: ``(y int8, scale float32 [input.shape[:-1]])``."""
    if group_index is not None or dst_type not in (None, torch.int8):
        raise NotImplementedError("npu_dynamic_quant: group_index and dst_type other than int8 are not simulated")
    if smooth_scales is not None and tuple(smooth_scales.shape) != (input.shape[-1],):
        raise fail(
            "npu_dynamic_quant", "smooth_scales", f"must be [{input.shape[-1]}], got {list(smooth_scales.shape)}"
        )
    y = torch.empty(input.shape, dtype=torch.int8, device=input.device)
    scale = torch.empty(input.shape[:-1], dtype=torch.float32, device=input.device)
    launch(_DYNAMIC_QUANT, {"input": input, "smooth_scales": smooth_scales, "y": y, "scale": scale})
    return y, scale


def npu_add_rms_norm_dynamic_quant(
    x1: torch.Tensor,
    x2: torch.Tensor,
    gamma: torch.Tensor,
    *,
    smooth_scale1: torch.Tensor | None = None,
    smooth_scale2: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    epsilon: float = 1e-6,
    output_mask: list[bool] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Residual add, RMSNorm, then per-row int8 quantisation: ``(y1, y2, x1 + x2, scale1,
    scale2)``; ``output_mask`` says which of the two quantisations to compute (default: the
    first, and the second where ``smooth_scale2`` is given)."""
    check_residual_norm("npu_add_rms_norm_dynamic_quant", x1, x2, gamma)
    mask = list(output_mask) if output_mask is not None else [True, smooth_scale2 is not None]
    rows = x1.shape[:-1]

    def quantized(on: bool) -> tuple[torch.Tensor, torch.Tensor]:
        shape, srows = (x1.shape, rows) if on else ((0,), (0,))
        return (
            torch.empty(shape, dtype=torch.int8, device=x1.device),
            torch.empty(srows, dtype=torch.float32, device=x1.device),
        )

    (y1, scale1), (y2, scale2) = quantized(mask[0]), quantized(mask[1])
    x = torch.empty_like(x1)
    params = {"x1": x1, "x2": x2, "gamma": gamma, "beta": beta, "epsilon": epsilon, "mask": mask}
    params.update(smooth_scale1=smooth_scale1, smooth_scale2=smooth_scale2, y1=y1, y2=y2, x=x)
    params.update(scale1=scale1, scale2=scale2)
    launch(_ADD_RMS_NORM_DQ, params)
    return y1, y2, x, scale1, scale2


def npu_quantize(
    self: torch.Tensor,
    scales: torch.Tensor,
    zero_points: torch.Tensor | None,
    dtype: torch.dtype,
    axis: int = 1,
    div_mode: bool = True,
) -> torch.Tensor:
    """Static quantisation: ``round(self / scales + zero_points)`` (``div_mode=False``:
    ``self * scales``) as int8 (``torch.qint8``) or uint8 (``torch.quint8``), the scales
    one value or one per index of ``axis``."""
    op = "npu_quantize"
    if dtype not in _QUANT_TYPES:
        raise NotImplementedError(f"{op}: dtype {dtype} is not simulated (qint8 and quint8 are)")
    _check_scales(op, "scales", scales, self, axis)
    _check_scales(op, "zero_points", zero_points, self, axis)
    y = torch.empty(self.shape, dtype=_QUANT_TYPES[dtype], device=self.device)
    params = {"input": self, "scales": scales, "zero_points": zero_points, "axis": axis, "div_mode": div_mode, "y": y}
    launch(_QUANTIZE, params)
    return y


def npu_add_rms_norm_quant(
    x1: torch.Tensor,
    x2: torch.Tensor,
    gamma: torch.Tensor,
    scales1: torch.Tensor,
    zero_points1: torch.Tensor | None = None,
    scales2: torch.Tensor | None = None,
    zero_points2: torch.Tensor | None = None,
    axis: int = -1,
    epsilon: float = 1e-6,
    div_mode: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Residual add, RMSNorm, then static int8 quantisation by ``scales1`` (and ``scales2``):
    ``(y1, y2, x1 + x2)``; ``y2`` is empty without ``scales2``."""
    op = "npu_add_rms_norm_quant"
    check_residual_norm(op, x1, x2, gamma)
    for name, t in (
        ("scales1", scales1),
        ("zero_points1", zero_points1),
        ("scales2", scales2),
        ("zero_points2", zero_points2),
    ):
        _check_scales(op, name, t, x1, axis)
    y1 = torch.empty(x1.shape, dtype=torch.int8, device=x1.device)
    y2 = torch.empty(x1.shape if scales2 is not None else (0,), dtype=torch.int8, device=x1.device)
    x = torch.empty_like(x1)
    params = {"x1": x1, "x2": x2, "gamma": gamma, "epsilon": epsilon, "axis": axis, "div_mode": div_mode}
    params.update(scales1=scales1, zero_points1=zero_points1, scales2=scales2, zero_points2=zero_points2)
    params.update(y1=y1, y2=y2, x=x)
    launch(_ADD_RMS_NORM_QUANT, params)
    return y1, y2, x
