"""Stream-ordered eager work: aten ops on device memory run in their stream's order.

On a device an eager op (``clone``, ``copy_``, ``fill_``, an index write) issued on a
stream runs after the work queued on that stream before it — a graph replay waiting
for its update, a kernel, another graph of the same pool — and the host does not wait
for it; a host read (``item()``, ``tolist()``, ``torch.equal``) waits for the stream.
Device tensors are ``npu`` tensors (host memory behind them), told apart from host
tensors by ``tensor.device``, as on hardware.

While any stream has pending work, each host thread that issued work carries two
modes (:class:`EagerOrdering`):

* an op that touches known device memory while the current stream has work queued
  (in adversarial mode: while any stream has) is not run: its outputs are shaped on
  meta tensors and allocated (floats poisoned with NaN), and the op is queued on the
  stream, to run in order — or, on a stream with no ordering to the work it reads,
  in whatever order the scheduler picks;
* a host read of known device memory waits for the current stream's queue (a
  synchronize; a stream blocked on an event that is never recorded raises
  :class:`~npusim.DeadlockError`, where hardware hangs). A read while the current
  stream is idle reads memory as it is, even if another stream's unordered work has
  not written it yet — what hardware shows.

With nothing pending the modes leave the stack (at the next device call) and cost
nothing.  The simulator's own code runs holding the device lock, and the modes let it
through.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode
from torch.utils._pytree import tree_flatten, tree_map

from npusim.device.backend import on_host
from npusim.runtime.aten import ALLOC_PACKETS, HostReadMode, ShapeUnknown, is_host_read, plan_outputs, run_planned

__all__ = ["EagerOrdering", "EagerOp"]

_copy = torch.ops.aten.copy_.default


class EagerOp:
    """One eager aten op queued on a stream: it runs when the stream reaches it."""

    def __init__(self, state: Any, func: Any, args: Any, kwargs: Any, fresh: list[tuple[int, Any]]) -> None:
        self.state, self.func, self.args, self.kwargs, self.fresh = state, func, args, kwargs, fresh

    def ready(self) -> bool:
        return True

    def step(self, max_nodes: int) -> bool:
        t0 = time.perf_counter()
        try:
            self.state.run_eager(
                self,
                lambda: run_planned(self.func, on_host(self.args), on_host(self.kwargs), on_host(self.fresh)),
                f"eager aten op {self.func}",
            )
        finally:
            self.state.device_clock += time.perf_counter() - t0
            self.args = self.kwargs = None  # the memory it used is free to reuse now
        return True

    def describe(self) -> dict[str, Any]:
        return {"text": f"eager aten op {self.func}"}


class _OrderDispatch(TorchDispatchMode):
    def __init__(self, ordering: EagerOrdering) -> None:
        super().__init__()
        self.ordering = ordering

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        st = self.ordering.state
        if st is None or not st.active or st.capture is not None or st.lock._is_owned():
            return func(*args, **kwargs)
        return self.ordering.dispatch_op(func, tuple(args), kwargs)


class EagerOrdering:
    """One host thread's stream ordering of eager ops (installed while work is pending)."""

    def __init__(self, state: Any) -> None:
        self.state: Any = state  # None once the device it ordered for was reset
        self.dispatch = _OrderDispatch(self)
        self.function = HostReadMode(self.host_read)
        self.installed = False

    # --- the stack -------------------------------------------------------------------
    def install(self) -> None:
        self.function.__enter__()
        self.dispatch.__enter__()
        self.installed = True

    def uninstall(self) -> None:
        """Leave the mode stacks if nothing was pushed above (else stay, passing through)."""
        if _get_current_dispatch_mode() is not self.dispatch or _top_function_mode() is not self.function:
            return
        self.dispatch.__exit__(None, None, None)
        self.function.__exit__(None, None, None)
        self.installed = False

    # --- ordering --------------------------------------------------------------------
    def host_read(self, t: torch.Tensor, how: str) -> None:
        """Wait for the current stream before the host reads device memory (a synchronize)."""
        st = self.state
        if st is None or not st.active or st.capture is not None or st.lock._is_owned():
            return
        stream = st.current_stream
        if stream._queue and st.memory.knows(t):
            with st.lock:
                st.own(st.drain, f"{how} on a device tensor (which waits for {stream!r})", stream)

    def dispatch_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        st = self.state
        if is_host_read(func, args, self.host_read) or func.is_view:
            return func(*args, **kwargs)  # a read the stream was waited for, or metadata only
        tensors = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        stream = st.current_stream
        if not (stream._queue or st.adversarial) or not any(st.memory.knows(t) for t in tensors):
            return func(*args, **kwargs)  # nothing queued before it on its stream, or host memory
        with st.lock:
            return st.own(self._defer, func, args, kwargs, stream)

    def _defer(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], stream: Any) -> Any:
        st = self.state
        try:
            planned = plan_outputs(func, args, kwargs, self._alloc)
        except ShapeUnknown as unknown:
            if not unknown.host_value:
                # data-dependent shapes (nonzero, masked_select): the host waits for the data
                st.drain(f"{func} (its output shape depends on device data)", stream)
            return func(*args, **kwargs)  # a host value from metadata (is_same_size): now
        memory = st.memory
        if func.overloadpacket in ALLOC_PACKETS:
            return planned.result
        touched: Any = (args, kwargs)
        if func is _copy and isinstance(args[1], torch.Tensor):
            # a copy between host memory and device memory.  From host memory: memory no device
            # work touched (an input, a block table), which stays the host's.  Either way,
            # torch_npu synchronizes the stream for a blocking copy and CANN's async copy from or
            # into pageable memory returns once it has run: the host waits for the stream
            # (queued instead, a copy into the host had returned with its destination unwritten)
            into_host = not memory.knows(args[0]) and memory.knows(args[1])
            from_host = not memory.knows(args[1])
            if into_host or from_host:
                blocking = not (len(args) > 2 and args[2]) and not kwargs.get("non_blocking")
                pinned = memory.is_pinned(args[0] if into_host else args[1])
                if blocking or not pinned:
                    kind, host = "blocking" if blocking else "non-blocking", "host" if pinned else "pageable host"
                    st.drain(
                        f"a {kind} copy from device memory into {host} memory (which waits for {stream!r})"
                        if into_host
                        else f"a {kind} copy into device memory from {host} memory (which waits for {stream!r}; "
                        "copy non-blocking from page-locked memory, tensor.pin_memory(), not to wait)",
                        stream,
                    )
                    return func(*args, **kwargs)
                if from_host:
                    touched = (args[0], kwargs)  # not the source
        memory.adopt(touched)  # device memory from now on: ops on it are ordered
        st.enqueue(stream, EagerOp(st, func, args, tree_map(lambda x: x, kwargs), planned.fresh))
        return planned.result

    def _alloc(self, shape: Any, stride: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        t = torch.empty_strided(tuple(shape), tuple(stride), dtype=dtype, device=device)
        if t.numel():
            if t.is_floating_point() or t.is_complex():
                t.fill_(float("nan"))  # a read before the op runs shows
            self.state.memory.owner(t)
        return t


def _top_function_mode() -> Any:
    n = torch._C._len_torch_function_stack()
    return torch._C._get_function_stack_at(n - 1) if n else None
