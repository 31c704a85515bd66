"""Triton on the simulator: what triton-ascend is to vllm-ascend on a device.

vllm-ascend 0.23.0.post1 runs some of its work as Triton kernels (the slot mapping of its
block table, rotary embedding, the sampler's helpers) and requires ``triton-ascend``.  On
the simulator they run in PyPI Triton's interpreter (``TRITON_INTERPRET=1``), with:

* a Triton backend for the simulator's ``npu`` device (:func:`register_backend`): an active
  driver, so that vLLM's ``HAS_TRITON`` holds, whose ``utils.get_device_properties`` gives
  the core counts vllm-ascend sizes its grids with (``num_aicore``, ``num_vectorcore``);
* each launch a simulator kernel (:func:`launch_as_kernels`): queued on the current stream
  and run when the stream reaches it, and, during a graph capture, recorded as one node of
  the graph, replayed on the memory of the moment.  The interpreter by itself copies every
  argument's storage to the host and back at once, which a capture must refuse (the values
  only exist at replay) and which would order nothing on the stream;
* a kernel whose source is one a torch substitute was checked against computed by that
  substitute instead of the interpreter (:mod:`npusim.kernels.triton_substitutes`: vllm-ascend's
  rope), through the same launch;
* block shapes that are not powers of two (:func:`relax_block_shapes`), as triton-ascend
  allows them;
* Triton's own ``triton.experimental.gluon``, which its interpreter needs, where a program
  put empty stand-ins for it (:func:`real_gluon`: vllm-ascend 0.27.1rc1 does, for Triton 3.2);
* bfloat16 arithmetic on values, not on the interpreter's raw 16-bit patterns
  (:func:`bfloat16_arithmetic`);
* two costs of the interpreter's own that change no result: integer overflow checks whose
  result nothing reads (:func:`no_unasserted_overflow_checks`: a compiled kernel has none
  without ``debug``), and a table of numpy types built again at each operation
  (:func:`cached_numpy_dtypes`); together they were about a third of the time of
  vllm-ascend's rope kernel;
* a stand-in for ``triton.language.extra.cann.extension`` (:func:`cann_extension`):
  triton-ascend's language extension, which vllm-ascend imports at module level, with its
  ``extract_slice``, ``insert_slice`` and ``get_element`` for interpreted kernels (vllm-ascend's
  fused q/k norm and rope, its rejection sampler), bounds checked;
* a stand-in for ``triton.language.extra.cann.libdevice`` (:func:`cann_libdevice`), which
  vllm-ascend 0.26.0rc1 reads off the package at import (its v2 runner's NaN metric): the
  functions triton-ascend's package points at ``triton.language.math``, and ``isnan`` and
  ``isinf`` (CANN's ``__hmf_`` externs, which the interpreter cannot call) as comparisons, for
  the float types CANN's table lists; any other name is refused by name.

:mod:`npusim_hook` wires these in when ``NPUGRAPH_SIM_TORCH_NPU=1`` (as each Triton module
is imported); nothing here imports Triton until then.  What is not simulated: Triton
kernels inside a task-group update (no vllm-ascend path issues one), and timing (the
interpreter is slow: about a millisecond per program instance).
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any, cast

import torch

from npusim.device import backend as _device
from npusim.kernels import AI_CORES, triton_substitutes
from npusim.kernels.triton_substitutes import Substitute
from npusim.runtime.launch import SimOp, launch

__all__ = [
    "BACKEND_NAME",
    "EXTENSION",
    "LIBDEVICE",
    "cann_extension",
    "cann_libdevice",
    "launch_as_kernels",
    "register_backend",
    "relax_block_shapes",
    "bfloat16_arithmetic",
    "cached_numpy_dtypes",
    "no_unasserted_overflow_checks",
]

BACKEND_NAME = "npu"  # triton-ascend's backend name
# NPUSIM_TRITON_SUBSTITUTES=0 runs every Triton kernel in the interpreter, substituted ones too
SUBSTITUTES_ENV = "NPUSIM_TRITON_SUBSTITUTES"
EXTENSION = "triton.language.extra.cann.extension"
LIBDEVICE = "triton.language.extra.cann.libdevice"
# what triton-ascend's triton/language/extra/cann/__init__.py points at triton.language.math
_LIBDEVICE_FROM_MATH = (
    "umulhi", "exp", "exp2", "log", "log2", "cos", "sin", "sqrt", "sqrt_rn", "rsqrt", "div_rn", "erf",
    "floor", "ceil", "fdiv", "fma", "abs",
)  # fmt: skip
# the float types CANN's isnan and isinf table their externs for
_LIBDEVICE_FLOATS = ("fp32", "fp16", "bf16")
# an Atlas A2's cube (AI) and vector cores, what triton-ascend's driver reports
_VECTOR_CORES = 2 * AI_CORES


def register_backend(backends: types.ModuleType) -> None:
    """Add the simulator's backend to ``triton.backends.backends`` (once)."""
    from triton.backends import Backend
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.backends.driver import DriverBase

    if BACKEND_NAME in backends.backends:
        return

    class SimCompiler(BaseBackend):  # type: ignore[misc]
        """Nothing to compile: the simulator runs kernels in Triton's interpreter."""

        @staticmethod
        def supports_target(target: Any) -> bool:
            return bool(target.backend == BACKEND_NAME)

        def hash(self) -> str:
            return "npugraph-sim"

        def parse_options(self, options: dict[str, Any]) -> Any:
            return options

        def add_stages(self, stages: dict[str, Any], options: Any, language: Any = None) -> None:
            raise RuntimeError(
                "npusim runs Triton kernels in Triton's interpreter: set TRITON_INTERPRET=1 before "
                "Triton is imported (NPUGRAPH_SIM_TORCH_NPU=1 does, through npugraph's .pth)"
            )

        def load_dialects(self, context: Any) -> None:
            return None

        def get_module_map(self) -> dict[str, types.ModuleType]:
            return {}

    class SimUtils:
        def get_device_properties(self, device: Any) -> dict[str, int]:
            return {
                "num_aicore": AI_CORES,
                "num_vectorcore": _VECTOR_CORES,
                "multiprocessor_count": AI_CORES,
                "max_shared_mem": 192 * 1024,
            }

    class SimDriver(DriverBase):  # type: ignore[misc]
        """The simulator's ``npu`` device, active where it is this process's device."""

        def __init__(self) -> None:
            self.utils = SimUtils()

        @classmethod
        def is_active(cls) -> bool:
            return _device.installed()

        def map_python_to_cpp_type(self, ty: str) -> str:
            return ty

        def get_current_target(self) -> Any:
            return GPUTarget(BACKEND_NAME, "Ascend910B1", 0)

        def get_active_torch_device(self) -> torch.device:
            return torch.device(BACKEND_NAME, torch.npu.current_device())  # type: ignore[attr-defined]

        def get_benchmarker(self) -> Any:
            raise RuntimeError("npusim does not time Triton kernels (no device timer)")

        def get_current_device(self) -> int:
            return int(torch.npu.current_device())  # type: ignore[attr-defined]

        def set_current_device(self, device: int) -> None:
            torch.npu.set_device(device)  # type: ignore[attr-defined]

        def get_current_stream(self, device: int | None = None) -> int:
            return int(torch.npu.current_stream().stream_id)  # type: ignore[attr-defined]

    backends.backends[BACKEND_NAME] = Backend(SimCompiler, SimDriver)


def relax_block_shapes(language: types.ModuleType) -> None:
    """Block shapes and ``tl.arange`` ranges that are not powers of two, as triton-ascend
    allows them outside its SIMT mode (vllm-ascend sizes its blocks by the vector core's
    buffer: ``split_qkv_rmsnorm_rope`` takes a range of 21 rows at Qwen3's head size);
    the other checks (int32 bounds, Triton's largest block) stay (once)."""
    core, semantic = language.core, language.semantic
    if getattr(core.validate_block_shape, "_npugraph_sim", False):
        return
    limit = core.TRITON_MAX_TENSOR_NUMEL

    def validate_block_shape(shape: list[int]) -> int:
        numel = 1
        for i, d in enumerate(shape):
            if not isinstance(d, int):
                raise TypeError(f"Shape element {i} must have type `constexpr[int]`, got `constexpr[{type(d)}]")
            numel *= d
        if numel > limit:
            raise ValueError(f"numel ({numel}) exceeds triton maximum tensor numel ({limit})")
        return numel

    def arange(self: Any, start: int, end: int, *, ret_ty: Any = None) -> Any:
        if not isinstance(start, int) or not isinstance(end, int):
            raise ValueError("arange's arguments must be of type tl.constexpr")
        if start >> 32 or end >> 32:
            raise ValueError("arange must fit in int32")
        if end <= start:
            raise ValueError("arange's end argument must be greater than the start argument")
        if ret_ty is None:
            ret_ty = language.block_type(language.int32, [end - start])
        return self.tensor(self.builder.create_make_range(ret_ty.to_ir(self.builder), start, end), ret_ty)

    validate_block_shape._npugraph_sim = True  # type: ignore[attr-defined]
    core.validate_block_shape = validate_block_shape
    semantic.TritonSemantic.arange = arange


def _bf16_values(handle: Any) -> tuple[Callable[..., bool], Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
    """The interpreter's bfloat16 blocks as values: whether a block is bfloat16, its values
    widened to float32, float32 values narrowed to bfloat16 patterns (round to nearest even,
    NaN kept), and an operation's result as a block (booleans as they are)."""
    import numpy as np

    def is_bf16(*handles: Any) -> bool:  # by name: triton.language may still be loading here
        return any(getattr(h.dtype.scalar, "name", None) == "bf16" for h in handles)

    def widen(h: Any) -> Any:
        return (h.data.astype(np.uint32) << 16).view(np.float32) if is_bf16(h) else h.data

    def narrow(values: Any) -> Any:
        f32 = np.asarray(values, dtype=np.float32)
        bits = f32.view(np.uint32)
        rounded = ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
        return np.where(np.isnan(f32), np.uint16(0x7FC0), rounded)

    def result(out: Any, dtype: Any) -> Any:
        return handle(out if out.dtype == np.bool_ else narrow(out), dtype)

    return is_bf16, widen, narrow, result


def bfloat16_arithmetic(interpreter: types.ModuleType) -> None:
    """bfloat16 arithmetic as a device does it, in Triton's interpreter (once).

    The interpreter keeps a bfloat16 block as its raw 16-bit patterns (``uint16``) and runs
    ``a * b`` on them as integers: garbage (PyPI Triton 3.8: ``1.5 * 2.0`` gives ``0.0``).
    An NPU (and a GPU) computes it on the values, rounded to bfloat16.  So each float
    operation with a bfloat16 operand (binary, unary, fused multiply-add, clamp) runs here
    in float32 and rounds to nearest even, and so does a cast to bfloat16; a comparison
    returns its booleans.  Selects and
    bit casts keep the patterns, as they should.  And any comparison's booleans are typed
    int1, bfloat16 or not (the interpreter types them as their left operand)."""
    import numpy as np

    builder = interpreter.InterpreterBuilder
    if getattr(builder.binary_op, "_npugraph_sim", False):
        return
    handle = interpreter.TensorHandle
    is_bf16, widen, narrow, result = _bf16_values(handle)
    binary, unary, ternary, fma, rsqrt = (
        builder.binary_op,
        builder.unary_op,
        builder.ternary_op,
        builder.create_fma,
        builder.create_rsqrt,
    )

    def binary_op(self: Any, lhs: Any, rhs: Any, op: Any) -> Any:
        out = (
            binary(self, lhs, rhs, op)
            if not is_bf16(lhs, rhs)
            else result(op(widen(lhs), widen(rhs)), lhs.dtype.scalar)
        )
        if out.data.dtype == np.bool_ and getattr(out.dtype.scalar, "name", None) != "int1":
            # A comparison's booleans are int1, as the compiled kernel's are; Triton's
            # interpreter types them as its left operand: a scalar ``x != 0.0`` splat into a
            # block then comes out float, and ``mask & (x != 0.0)`` fails (vllm-ascend 0.30's
            # v2 sampler, categorical_sample.py: numpy's bitwise_and on a float operand)
            out = handle(out.data, interpreter.tl.int1)
        return out

    def unary_op(self: Any, arg: Any, op: Any) -> Any:
        if not is_bf16(arg):
            return unary(self, arg, op)
        return result(op(widen(arg)), arg.dtype.scalar)

    def ternary_op(self: Any, lhs: Any, rhs: Any, other: Any, op: Any) -> Any:
        if op is np.where or not is_bf16(lhs, rhs, other):
            return ternary(self, lhs, rhs, other, op)
        return result(op(widen(lhs), widen(rhs), widen(other)), other.dtype.scalar)

    def create_fma(self: Any, x: Any, y: Any, z: Any) -> Any:
        if not is_bf16(z):
            return fma(self, x, y, z)
        return result(widen(x) * widen(y) + widen(z), z.dtype.scalar)

    def create_rsqrt(self: Any, arg: Any) -> Any:
        if not is_bf16(arg):
            return rsqrt(self, arg)
        return result(1 / np.sqrt(widen(arg)), arg.dtype.scalar)

    def cast_impl(self: Any, src: Any, dst_type: Any) -> Any:
        # A float cast to bfloat16 (``x.to(tl.bfloat16)``, and a store of float32 into a
        # bfloat16 pointer) rounds to nearest even on a device (``arith.truncf``); the
        # interpreter truncates the pattern (vllm-ascend's rope came out an ulp low), and
        # casts from another float type by integer conversion.  Widening keeps the value.
        to_bf16 = getattr(dst_type.scalar, "name", None) == "bf16"
        if to_bf16 and not is_bf16(src) and src.data.dtype.kind == "f":
            return handle(narrow(src.data.astype(np.float32)), dst_type.scalar)
        if is_bf16(src) and getattr(dst_type.scalar, "name", None) in ("fp16", "fp32", "fp64"):
            return handle(widen(src).astype(interpreter._get_np_dtype(dst_type)), dst_type.scalar)
        return interpreted_cast(self, src, dst_type)

    interpreted_cast = builder.cast_impl
    binary_op._npugraph_sim = True  # type: ignore[attr-defined]
    builder.cast_impl = cast_impl
    builder.binary_op = binary_op
    builder.unary_op = unary_op
    builder.ternary_op = ternary_op
    builder.create_fma = create_fma
    builder.create_rsqrt = create_rsqrt


def no_unasserted_overflow_checks(interpreter: types.ModuleType) -> None:
    """Leave out the interpreter's integer overflow checks when they cannot assert (once).

    ``a + b`` on integers in a kernel runs ``binary_op_sanitize_overflow_impl`` when the
    options' ``sanitize_overflow`` is on (the interpreter's default): the sum again in int64,
    two comparisons and a ``device_assert``, which does nothing unless ``debug`` is on.  A
    compiled kernel without ``debug`` emits none of it, and an NPU's add wraps; so with
    ``debug`` off the check only costs time (a third of vllm-ascend's rope kernel over
    2,048 tokens, a minute of each engine's start on the simulator).  With ``debug`` on
    the checks stay, and assert, as Triton's own.  (Idempotent.)"""
    import dataclasses

    builder = interpreter.interpreter_builder  # the one the interpreter runs every kernel with
    if not builder.options.debug:
        builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)


def cached_numpy_dtypes(interpreter: types.ModuleType) -> None:
    """The interpreter's ``_get_np_dtype``, each answer kept (once).

    Triton's builds a dictionary of its 19 scalar types at every call, and calls it at every
    operation of every program: an eighth of the time of vllm-ascend's rope kernel.  The
    answer depends on the type alone, so each is asked of Triton's function once and kept."""
    original = interpreter._get_np_dtype
    if getattr(original, "_npugraph_sim", False):
        return
    known: dict[Any, Any] = {}  # scalar type -> numpy's (block and pointer types are unhashable)

    def _get_np_dtype(tt_dtype: Any) -> Any:
        language = interpreter.tl  # resolved at the call: triton.language may still be loading now
        if isinstance(tt_dtype, language.block_type):  # a block's is its element's
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, language.pointer_type):
            return original(tt_dtype)
        answer = known.get(tt_dtype)
        if answer is None:
            answer = known[tt_dtype] = original(tt_dtype)
        return answer

    _get_np_dtype._npugraph_sim = True  # type: ignore[attr-defined]
    _get_np_dtype.triton = original  # type: ignore[attr-defined]  # what each answer must equal
    interpreter._get_np_dtype = _get_np_dtype  # type: ignore[attr-defined]


def launch_as_kernels(interpreter: types.ModuleType) -> None:
    """Make each launch of an interpreted Triton kernel a simulator kernel (once)."""
    executor = interpreter.GridExecutor
    run = executor.__call__
    if getattr(run, "_npugraph_sim", False):
        return

    def call(self: Any, *args: Any, **kwargs: Any) -> None:
        params: dict[str, Any] = {f"arg{i}": a for i, a in enumerate(args)}
        params.update({f"kw_{k}": v for k, v in kwargs.items()})
        tensors = tuple(k for k, v in params.items() if isinstance(v, torch.Tensor))
        if not tensors or all(params[k].device.type != "npu" for k in tensors):
            return run(self, *args, **kwargs)  # host tensors only: the interpreter as it is
        substitute = _substitute(self.fn)

        def compute(host: dict[str, Any], info: dict[str, Any]) -> None:
            host_args = [host[f"arg{i}"] for i in range(len(args))]
            host_kwargs = {k: host[f"kw_{k}"] for k in kwargs}
            if substitute is None or os.environ.get(SUBSTITUTES_ENV, "1") == "0":
                real_gluon()
                run(self, *host_args, **host_kwargs)
                return
            names = inspect.getfullargspec(self.fn).args  # what the interpreter binds, too
            bound = inspect.getcallargs(self.fn, *host_args, **{k: v for k, v in host_kwargs.items() if k in names})
            grid = self.grid(bound) if callable(self.grid) else self.grid
            substitute.run(bound, (*grid, 1, 1, 1)[:3])

        launch(_kernel_op(self.fn.__name__, tensors, compute), params)

    call._npugraph_sim = True  # type: ignore[attr-defined]
    executor.__call__ = call


def real_gluon() -> None:
    """Put Triton's own ``triton.experimental.gluon`` back where a program replaced it by empty
    stand-ins, so that Triton's interpreter can specialize a kernel's arguments (it imports
    ``triton.experimental.gluon.nvidia`` to do so).

    vllm-ascend 0.27.1rc1 puts those stand-ins into ``sys.modules`` at import, unconditionally,
    because triton-ascend (Triton 3.2) has no gluon; its later releases do so only where the
    import fails.  On a device triton-ascend compiles, and nothing reads them; here PyPI's
    Triton, which has gluon, interprets.  Code that took a stand-in keeps it."""
    stand_in = sys.modules.get("triton.experimental.gluon")
    if stand_in is None or hasattr(stand_in, "__path__"):
        return  # Triton's own package, or not imported yet
    for name in [n for n in sys.modules if n.startswith("triton.experimental.gluon")]:
        del sys.modules[name]
    experimental = sys.modules.get("triton.experimental")
    if experimental is not None and getattr(experimental, "__file__", None) is None:
        del sys.modules["triton.experimental"]  # a stand-in package with no files (``__path__ = []``)
    importlib.import_module("triton.experimental.gluon.nvidia")


def _substitute(fn: Any) -> Substitute | None:
    """The torch substitute checked for kernel ``fn``'s source (found once per kernel: the
    interpreter keeps one rewritten function per kernel); a kernel of a substituted name
    whose source differs runs in the interpreter, said once."""
    known = fn.__dict__.get("_npusim_substitute", _UNKNOWN)
    if known is not _UNKNOWN:
        return cast("Substitute | None", known)
    found = None
    if fn.__name__ in triton_substitutes.NAMES:
        try:
            source = inspect.getsource(fn)
        except (OSError, TypeError):
            source = ""
        found = triton_substitutes.substitute_for(fn.__name__, source)
        if found is None:
            warnings.warn(
                f"npusim: Triton kernel {fn.__name__} ({inspect.getsourcefile(fn)}) differs from every "
                f"source its torch substitute was checked against "
                f"({', '.join(s.origin for s in triton_substitutes.SUBSTITUTES.values() if s.kernel == fn.__name__)}): "
                "it runs in Triton's interpreter (right, slower)",
                stacklevel=2,
            )
    fn._npusim_substitute = found
    return found


_UNKNOWN = object()  # a kernel not looked up yet


def _kernel_op(name: str, tensors: tuple[str, ...], compute: Any) -> SimOp:
    # which pointers a Triton kernel writes its signature does not say: every tensor
    # argument counts as written (ordering and race checks err on the safe side)
    return SimOp(
        f"triton:{name}",
        "interpreted",
        host_args=(),
        output_args=tensors,
        check=lambda p: {},
        compute=compute,
        workspace=lambda p, info: 0,
        anchor=tensors[0],
    )


def cann_extension() -> types.ModuleType:
    """A stand-in for triton-ascend's ``triton.language.extra.cann.extension``: the slice and
    element functions vllm-ascend's kernels call, for kernels run in Triton's interpreter."""
    module = types.ModuleType(EXTENSION, "npusim's stand-in for triton-ascend's language extension")
    module.extract_slice = extract_slice  # type: ignore[attr-defined]
    module.insert_slice = insert_slice  # type: ignore[attr-defined]
    module.get_element = get_element  # type: ignore[attr-defined]
    return module


def cann_libdevice() -> types.ModuleType:
    """A stand-in for triton-ascend's ``triton.language.extra.cann.libdevice``, for kernels run in
    Triton's interpreter (see the module doc)."""
    import triton.language as tl

    module = types.ModuleType(LIBDEVICE, "npusim's stand-in for triton-ascend's libdevice")
    module.isnan = _isnan  # type: ignore[attr-defined]
    module.isinf = _isinf  # type: ignore[attr-defined]

    def missing(name: str) -> Any:
        # looked up at each use: Triton's interpreter swaps triton.language.math's functions
        # for its own while a kernel runs, and an alias kept from before would miss that
        if name in _LIBDEVICE_FROM_MATH:
            return getattr(tl.math, name)
        raise AttributeError(
            f"triton-ascend's libdevice.{name} is one of CANN's device-library externs, which Triton's "
            "interpreter cannot call, and npusim has no stand-in for it (it has "
            f"{', '.join(sorted([*_LIBDEVICE_FROM_MATH, 'isinf', 'isnan']))})"
        )

    module.__getattr__ = missing  # type: ignore[method-assign]
    return module


def _float_block(arg0: Any, name: str) -> Any:
    import triton.language as tl

    if not isinstance(arg0, tl.tensor) or arg0.dtype.name not in _LIBDEVICE_FLOATS:
        got = arg0.dtype.name if isinstance(arg0, tl.tensor) else type(arg0).__name__
        raise TypeError(
            f"triton-ascend's libdevice.{name} takes {', '.join(_LIBDEVICE_FLOATS)} (CANN's extern table), not {got}"
        )
    return arg0


def _isnan(arg0: Any, _semantic: Any = None) -> Any:
    """triton-ascend's ``libdevice.isnan``: int1, true where the value is NaN."""
    arg0 = _float_block(arg0, "isnan")
    return arg0 != arg0


def _isinf(arg0: Any, _semantic: Any = None) -> Any:
    """triton-ascend's ``libdevice.isinf``: int1, true where the value is +inf or -inf."""
    import triton.language as tl

    arg0 = _float_block(arg0, "isinf")
    return tl.math.abs(arg0) == float("inf")


# triton-ascend's own functions are builtins lowered to MLIR's tensor.extract_slice,
# tensor.insert_slice and tensor.extract; in Triton's interpreter a block is a numpy array
# (TensorHandle.data), so each is one numpy indexing.  A device does not check the bounds
# (an access past the block reads or writes other registers, silently); numpy would clip a
# slice without a word: both are refused here, naming the function and the dimension.


def _as_int(value: Any, what: str) -> int:
    import numpy as np
    import triton.language as tl

    if isinstance(value, tl.constexpr):
        value = value.value
    if isinstance(value, tl.tensor):
        data = value.handle.data
        if data.size != 1:
            raise TypeError(f"{what} must be a scalar, not a block of shape {list(data.shape)}")
        return int(data.reshape(-1)[0])
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value)
    raise TypeError(f"{what} must be an int, a constexpr or a scalar tensor, not {type(value).__name__}")


def _block(value: Any, name: str, what: str) -> Any:
    import triton.language as tl

    if not isinstance(value, tl.tensor) or not value.type.is_block():
        raise TypeError(f"triton-ascend's {name}: {what} must be a block tensor, not {type(value).__name__}")
    return value


def _positions(name: str, shape: tuple[int, ...], offsets: Any, sizes: Any, strides: Any) -> tuple[Any, ...]:
    """The index arrays of the slice ``offsets``/``sizes``/``strides`` of a block of ``shape``."""
    import numpy as np

    offsets, sizes, strides = tuple(offsets), tuple(sizes), tuple(strides)
    if not len(offsets) == len(sizes) == len(strides) == len(shape):
        raise ValueError(
            f"triton-ascend's {name}: offsets, sizes and strides need one entry per dimension of the "
            f"block ({len(shape)}), not {len(offsets)}, {len(sizes)} and {len(strides)}"
        )
    axes = []
    for dim, (o, n, st) in enumerate(zip(offsets, sizes, strides)):
        offset = _as_int(o, f"triton-ascend's {name}: offsets[{dim}]")
        size = _as_int(n, f"triton-ascend's {name}: sizes[{dim}]")
        stride = _as_int(st, f"triton-ascend's {name}: strides[{dim}]")
        if size < 1 or stride < 0:
            raise ValueError(
                f"triton-ascend's {name}: sizes[{dim}]={size} must be >= 1 and strides[{dim}]={stride} >= 0"
            )
        last = offset + (size - 1) * stride
        if offset < 0 or last >= shape[dim]:
            raise IndexError(
                f"triton-ascend's {name}: dimension {dim} reads elements {offset}..{last} of a block of "
                f"{shape[dim]}; on a device this reads or writes past the block silently"
            )
        axes.append(offset + stride * np.arange(size))
    return np.ix_(*axes)


def extract_slice(ful: Any, offsets: Any, sizes: Any, strides: Any, _semantic: Any = None) -> Any:
    """triton-ascend's ``extract_slice``: the block of ``sizes`` at ``offsets`` of ``ful``,
    every ``strides``-th element per dimension."""
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    ful = _block(ful, "extract_slice", "ful")
    data = ful.handle.data
    part = data[_positions("extract_slice", data.shape, offsets, sizes, strides)]
    return tl.tensor(TensorHandle(part.copy(), ful.type.scalar), tl.block_type(ful.type.scalar, list(part.shape)))


def insert_slice(ful: Any, sub: Any, offsets: Any, sizes: Any, strides: Any, _semantic: Any = None) -> Any:
    """triton-ascend's ``insert_slice``: ``ful`` with ``sub`` written at the slice
    ``offsets``/``sizes``/``strides`` (a new block; ``ful`` itself is unchanged)."""
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    ful = _block(ful, "insert_slice", "ful")
    sub = _block(sub, "insert_slice", "sub")
    if sub.type.scalar != ful.type.scalar:
        raise TypeError(f"triton-ascend's insert_slice: sub is {sub.type.scalar}, ful is {ful.type.scalar}")
    data = ful.handle.data.copy()
    where = _positions("insert_slice", data.shape, offsets, sizes, strides)
    expected = tuple(len(axis.reshape(-1)) for axis in where)
    if tuple(sub.handle.data.shape) != expected:
        raise ValueError(
            f"triton-ascend's insert_slice: sub has shape {list(sub.handle.data.shape)}, sizes say {list(expected)}"
        )
    data[where] = sub.handle.data
    return tl.tensor(TensorHandle(data, ful.type.scalar), tl.block_type(ful.type.scalar, list(data.shape)))


def get_element(src: Any, indice: Any, _semantic: Any = None) -> Any:
    """triton-ascend's ``get_element``: the one element of ``src`` at ``indice``, as a scalar."""
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    src = _block(src, "get_element", "src")
    data = src.handle.data
    indice = tuple(indice)
    if len(indice) != data.ndim:
        raise ValueError(f"triton-ascend's get_element: {len(indice)} indices for a block of rank {data.ndim}")
    where = tuple(_as_int(i, f"triton-ascend's get_element: indice[{d}]") for d, i in enumerate(indice))
    for dim, (i, n) in enumerate(zip(where, data.shape)):
        if not 0 <= i < n:
            raise IndexError(
                f"triton-ascend's get_element: index {i} of dimension {dim} is outside the block's {n}; "
                "on a device this reads past the block silently"
            )
    return tl.tensor(TensorHandle(np.array([data[where]], dtype=data.dtype), src.type.scalar), src.type.scalar)
