"""Capture by recording: every aten op issued during a capture becomes a graph node.

Capture pushes a ``TorchDispatchMode`` that records every aten op instead of running
it: view ops (metadata only) run at once; every other op has its outputs shaped on
meta tensors, allocated from the graph's pool (poisoned with NaN when the block is
new, so that a read before replay shows), and is re-executed in order by replay.
In-place ops and ``out=`` variants are recorded against the memory they mutate, so
nothing (the KV cache included) changes until replay.  Reading a captured result on
the host during capture raises, as on the device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import TorchDispatchMode

from npusim.errors import CaptureError
from npusim.runtime import state as rt
from npusim.runtime.aten import ALLOC_PACKETS, HostReadMode, ShapeUnknown, is_host_read, op_device, plan_outputs
from npusim.runtime.external import ExternalEvent
from npusim.runtime.memory import ArgRef, hold_params, hold_tree
from npusim.runtime.nodes import ExtRecordNode, ExtWaitNode, KernelTask, OpNode, storage_key

__all__ = ["CaptureSession", "make_host_copy"]

_TORCH_NAMESPACES = frozenset({"aten", "prim", "prims"})
_NPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1)


def _has_npu_kernel(func: Any) -> bool:
    """Whether ``func`` has a kernel of its own for the npu device (a custom op's)."""
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), torch._C.DispatchKey.PrivateUse1))


def _composite(func: Any) -> bool:
    """Whether ``func`` is a composite of other ops (it has a CompositeImplicitAutograd kernel)."""
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"))


class _Recorder(TorchDispatchMode):
    # a compiled graph calls higher-order ops (auto_functionalized_v2 around an engine's
    # mutating custom op, when no compiler re-inplaced it): they reach the recorder too
    supports_higher_order_operators = True

    def __init__(self, session: CaptureSession) -> None:
        super().__init__()
        self.session = session
        self.passthrough = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if isinstance(func, HigherOrderOperator):
            return self.run_higher_order(func, args, kwargs)
        if self.passthrough:
            return func(*args, **kwargs)
        return self.session.record_aten(func, tuple(args), kwargs)

    def run_higher_order(self, func: HigherOrderOperator, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        """Run a higher-order op as the device runs it, its dense implementation, with the
        recorder on: the ops it issues (clones, the wrapped op) are recorded one by one."""
        dense = func.py_kernels.get(torch._C.DispatchKey.CompositeExplicitAutograd)
        if dense is None:
            raise CaptureError(
                f"cannot capture the higher-order op {func.name()}: it has no dense implementation to record"
            )
        with self:
            return dense(*args, **kwargs)


class CaptureSession:
    """State of one capture in progress (the simulator's ``aclmdlRICapture``)."""

    def __init__(self, g: Any, stream: rt.Stream) -> None:
        self.graph = g
        self.stream = stream
        self.open_group: Any | None = None
        self.pending: set[int] = set()
        self.recorder = _Recorder(self)
        self.guard = HostReadMode(self.check_host_read)
        self.last_wait: ExtWaitNode | None = None
        self.last_wait_at = -1  # its node index

    # host reads
    def check_stream(self, stream: rt.Stream, what: str) -> None:
        """Refuse ``what`` (a kernel, a collective) issued on ``stream`` while this session's
        stream captures, as capture_error_mode='global' does."""
        if stream is not self.stream:
            raise CaptureError(
                f"{what} issued on {stream!r} while {self.stream!r} is capturing "
                "(capture_error_mode='global' forbids work on other streams during capture)"
            )

    def check_host_read(self, t: torch.Tensor, how: str) -> None:
        if t.device.type == "meta":
            return
        if storage_key(t) in self.pending:
            raise CaptureError(
                f"operation not permitted when stream is capturing: {how} reads a "
                f"{tuple(t.shape)} {t.dtype} tensor produced inside NPU graph capture on the "
                "host; its value only exists after replay. Move the host read out of the "
                "captured region."
            )
        if t.device.type == "npu":
            # a read of device memory to the host is a synchronous copy (rtMemcpy), which a
            # capture refuses whatever the memory holds (CANN: error 107030), as CUDA does
            raise CaptureError(
                f"operation not permitted when stream is capturing: {how} copies a {tuple(t.shape)} "
                f"{t.dtype} npu tensor to the host, a synchronous device-to-host copy (rtMemcpy), which "
                "the device refuses during a graph capture (error 107030 on Ascend). Read it before "
                "the capture, or keep the value on the device."
            )

    def alloc(self, shape: Any, stride: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Allocate from the graph's pool; the graph keeps the memory, the caller the object."""
        memory = rt.get_state().memory
        with torch.utils._python_dispatch._disable_current_modes():
            t = memory.allocate(self.graph._pool, shape, stride, dtype, device)
            if t.numel():
                self.graph._blocks.add(memory.owner(t))
                self.pending.add(storage_key(t))
        return t

    def hold(self, name: str, v: Any, refs: list[ArgRef], *, checked: bool = True) -> Any:
        with torch.utils._python_dispatch._disable_current_modes():
            return hold_tree(rt.get_state().memory, name, v, refs, checked=checked)

    def suspended(self) -> _Suspend:
        return _Suspend(self.recorder)

    def append(self, node: Any) -> None:
        if self.open_group is not None and not isinstance(node, KernelTask):
            raise CaptureError(
                f"{node.describe()} issued inside task group #{self.open_group.group_id}: a "
                "task group holds the tasks of exactly one op call"
            )
        self.graph._nodes.append(node)

    def record_external(self, event: ExternalEvent, wait: bool) -> None:
        if wait:
            node = ExtWaitNode(event)
            self.last_wait = node
            self.last_wait_at = len(self.graph._nodes)
            self.append(node)
        else:
            self.append(ExtRecordNode(event, self.graph))

    def record_aten(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if func.namespace not in _TORCH_NAMESPACES and _has_npu_kernel(func):
            # an engine's custom op whose npu kernel is Python (vLLM's unified attention): run
            # that code with the recorder on, so that the ops inside it are recorded one by one
            with self.recorder:
                return func.redispatch(_NPU_KEYS, *args, **kwargs)
        if _composite(func):
            # inside such a kernel autograd is below us, so composite ops (``contiguous``,
            # ``reshape``) arrive whole: their schema says "may alias", but a copy they make
            # is new memory, which the graph's pool must hold, so run their decomposition
            with self.recorder:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        if is_host_read(func, args, self.check_host_read) or func.is_view:
            return func(*args, **kwargs)  # a read of memory the capture did not write, or metadata only
        if op_device(args, kwargs).type != "npu":
            return func(*args, **kwargs)  # host work (CPU tensors only): it runs now, the graph holds nothing
        device = kwargs.get("device")
        if func.overloadpacket in ALLOC_PACKETS and device is not None and torch.device(device).type == "meta":
            return func(*args, **kwargs)  # shapes only: nothing for the device to hold
        try:
            planned = plan_outputs(func, args, kwargs, self.alloc)
        except ShapeUnknown as exc:
            if exc.host_value:
                return func(*args, **kwargs)  # answered from metadata (is_same_size); reads are HOST_READ_OPS
            raise CaptureError(
                f"cannot capture {func}: {exc}. Data-dependent shapes cannot be captured in a device graph."
            ) from exc
        if func.overloadpacket in ALLOC_PACKETS:  # nothing to run at replay
            return planned.result
        for t in planned.written:
            self.pending.add(storage_key(t))
        refs: list[ArgRef] = []
        node_args = self.hold("input", args, refs)
        node_kwargs = {k: self.hold(k, v, refs) for k, v in kwargs.items()}
        node_fresh = [(i, self.hold("output", b, [])) for i, b in planned.fresh]
        self.append(OpNode(func, node_args, node_kwargs, node_fresh, tuple(refs), self.graph))
        return planned.result

    def record_kernel(self, op: Any, params: dict[str, Any]) -> KernelTask:
        held, refs = hold_params(rt.get_state().memory, op, params)
        task = KernelTask(op, held, refs, self.graph, len(self.graph._nodes))
        group = self.open_group
        if group is not None:
            if group.task is not None:
                raise CaptureError(
                    f"a second op ({op.qualname}) issued inside task group "
                    f"#{group.group_id}, which already holds {group.task.op.qualname}: a "
                    "task group holds the tasks of exactly one op call"
                )
            group.task = task
            task.group = group
            if self.last_wait is not None and self.graph._nodes[-1] is self.last_wait:
                self.last_wait.group = group
            if self.last_wait is not None:
                # the wait a replay passes before this task: the most recent one (a task of a
                # group that shares an event is guarded by the group's one wait)
                group.guard = (self.last_wait_at, self.last_wait.event)
        self.graph._nodes.append(task)
        for name in op.output_args:
            v = params.get(name)
            for t in v if isinstance(v, (list, tuple)) else (v,):
                if isinstance(t, torch.Tensor):
                    self.pending.add(storage_key(t))
        return task


class _Suspend:
    def __init__(self, recorder: _Recorder) -> None:
        self.recorder = recorder

    def __enter__(self) -> None:
        self.recorder.passthrough += 1

    def __exit__(self, *exc: object) -> None:
        self.recorder.passthrough -= 1


def make_host_copy(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` outside the capture recorder (host-side work of an op entry point)."""
    st = rt.get_state()
    if st.capture is None:
        return fn()
    with st.capture.suspended():
        return fn()


def weak_ref_tensor(tensor: Any) -> Any:
    """``torch_npu._C._weak_ref_tensor``: a non-owning alias of ``tensor`` (same data pointer,
    shape, stride and dtype), made outside the capture recorder.

    It keeps nothing alive; it is valid while whoever owns the memory (a graph's pool, the
    tensor's owners) keeps it.  Of a host tensor (the CPU lengths vllm-ascend weak-refs
    with every kernel argument) it is a host tensor, read without waiting: memory is told
    by tensor.device.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"_weak_ref_tensor expects a Tensor, got {type(tensor).__name__}")
    return make_host_copy(lambda: rt.get_state().memory.alias(tensor))
