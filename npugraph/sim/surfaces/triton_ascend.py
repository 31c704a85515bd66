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
* a stand-in for ``triton.language.extra.cann.extension`` (:func:`cann_extension`):
  triton-ascend's language extension, which vllm-ascend imports at module level.  Its
  functions are not simulated; calling one raises.

:mod:`npugraph_hook` wires these in when ``NPUGRAPH_SIM_TORCH_NPU=1`` (as each Triton module
is imported); nothing here imports Triton until then.  What is not simulated: Triton
kernels inside a task-group update (no vllm-ascend path issues one), and timing (the
interpreter is slow: about a millisecond per program instance).
"""

from __future__ import annotations

import types
from typing import Any

import torch

from npugraph.sim.device import backend as _device
from npugraph.sim.kernels import AI_CORES
from npugraph.sim.runtime.launch import SimOp, launch

__all__ = ["BACKEND_NAME", "EXTENSION", "cann_extension", "launch_as_kernels", "register_backend"]

BACKEND_NAME = "npu"  # triton-ascend's backend name
EXTENSION = "triton.language.extra.cann.extension"
# an Atlas A2's cube (AI) and vector cores, what triton-ascend's driver reports
_VECTOR_CORES = 2 * AI_CORES
# triton-ascend's language extension: what vllm-ascend 0.23.0.post1 imports from it
_EXTENSION_NAMES = ("insert_slice", "extract_slice", "get_element")


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
                "npugraph.sim runs Triton kernels in Triton's interpreter: set TRITON_INTERPRET=1 before "
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
            raise RuntimeError("npugraph.sim does not time Triton kernels (no device timer)")

        def get_current_device(self) -> int:
            return int(torch.npu.current_device())  # type: ignore[attr-defined]

        def set_current_device(self, device: int) -> None:
            torch.npu.set_device(device)  # type: ignore[attr-defined]

        def get_current_stream(self, device: int | None = None) -> int:
            return int(torch.npu.current_stream().stream_id)  # type: ignore[attr-defined]

    backends.backends[BACKEND_NAME] = Backend(SimCompiler, SimDriver)


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

        def compute(host: dict[str, Any], info: dict[str, Any]) -> None:
            run(
                self,
                *(host[f"arg{i}"] for i in range(len(args))),
                **{k: host[f"kw_{k}"] for k in kwargs},
            )

        launch(_kernel_op(self.fn.__name__, tensors, compute), params)

    call._npugraph_sim = True  # type: ignore[attr-defined]
    executor.__call__ = call


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
    """A stand-in for triton-ascend's ``triton.language.extra.cann.extension``."""
    module = types.ModuleType(EXTENSION, "npugraph.sim's stand-in for triton-ascend's language extension")

    def not_simulated(name: str) -> Any:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError(
                f"triton-ascend's {name} is not simulated by npugraph.sim; a Triton kernel that calls it needs "
                "an Ascend host"
            )

        refuse.__name__ = name
        return refuse

    for name in _EXTENSION_NAMES:
        setattr(module, name, not_simulated(name))
    return module
