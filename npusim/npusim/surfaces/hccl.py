# mypy: disable-error-code="override"
# (each collective keeps torch_npu's parameter names; torch's stubs name some otherwise)
"""``hccl`` on the simulator: torch.distributed's collectives for ``npu`` tensors, over gloo.

torch_npu registers an ``hccl`` backend (HCCL, Huawei's collective library) for npu
tensors and adds ``torch.distributed.is_hccl_available``.  The simulator's npu memory is
host memory, so each collective runs gloo on CPU tensors over the same bytes
(:func:`~npusim.device.backend.on_host`): results land in the npu tensors themselves, as
HCCL's do.  ``init_process_group(backend="hccl")`` and ``new_group(backend="hccl")`` then
work at any world size gloo reaches (processes on this host).

Under a graph capture a collective runs nothing: it is recorded as a node of the graph,
which runs it at every replay (meeting the other ranks' replays), as HCCL's tasks in an
ACL graph do.  Before, it ran once, at capture, and the graph left it out: a
tensor-parallel engine's replays skipped their all-reduces and served wrong tokens.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from npusim.device.backend import on_host as _host  # npu tensors (also in lists) as CPU views
from npusim.runtime import state as rt
from npusim.runtime.memory import ArgRef
from npusim.runtime.nodes import CollectiveNode, storage_key

__all__ = ["ProcessGroupHCCL", "register"]

_c10d: Any = torch._C._distributed_c10d  # the options classes (torch's stubs lack some)


class ProcessGroupHCCL(dist.ProcessGroup):
    """torch_npu's ``ProcessGroupHCCL(store, rank, size, options)``, running gloo underneath.

    A Python ``ProcessGroup`` (torch.distributed uses such a group as it is)."""

    class Options:
        """``ProcessGroupHCCL.Options``: accepted; the simulator has nothing to tune."""

        def __init__(self, is_high_priority_stream: bool = False) -> None:
            self.is_high_priority_stream = is_high_priority_stream
            self.hccl_config: dict[str, Any] = {}
            self.global_ranks_in_group: list[int] = []
            self.group_name = ""
            self._timeout = timedelta(minutes=30)

    def __init__(self, store: Any, rank: int, size: int, options: Any = None) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # the Python constructor
        timeout = getattr(options, "_timeout", None) or timedelta(minutes=30)
        self._gloo: Any = dist.ProcessGroupGloo(store, rank, size, timeout)
        # A ProcessGroup keeps its name in its backends (torch sets it on each after this
        # constructor; destroy_process_group reads it back): gloo, for host tensors.
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self._gloo)

    def getBackendName(self) -> str:
        return "hccl"

    def _get_backend_name(self) -> str:
        return "hccl"

    def _issue(self, call: Callable[..., Any], *tensors: Any) -> Any:
        """Run gloo's ``call`` on CPU views of ``tensors``' memory now (returning gloo's
        Work) or, under a graph capture, record it for every replay and return a completed
        Work (a capture runs nothing)."""
        st = rt.get_state()
        session = st.capture
        if session is None:
            return call(*(_host(t) for t in tensors))
        name = sys._getframe(1).f_code.co_name  # the collective's own method
        session.check_stream(st.current_stream, f"hccl {name}")
        refs: list[ArgRef] = []
        held = [session.hold(f"{name}[{i}]", t, refs) for i, t in enumerate(tensors)]
        views = [_host(h) for h in held]  # the graph's addresses do not move: made once
        session.append(CollectiveNode(name, lambda: call(*views), session.graph, tuple(refs)))
        for t in tree_flatten(list(tensors))[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "npu":
                session.pending.add(storage_key(t))
        done: torch.futures.Future[Any] = torch.futures.Future()
        done.set_result(list(tensors))
        return _c10d._create_work_from_future(done)

    # each collective: gloo on the same memory (the Work it returns is gloo's)
    def allreduce(self, tensors: Any, opts: Any = None) -> Any:
        return self._issue(lambda h0: self._gloo.allreduce(h0, opts or _c10d.AllreduceOptions()), tensors)

    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> Any:
        return self._issue(
            lambda h0: self._gloo.allreduce_coalesced(h0, opts or _c10d.AllreduceCoalescedOptions()), tensors
        )

    def broadcast(self, tensors: Any, opts: Any = None) -> Any:
        return self._issue(lambda h0: self._gloo.broadcast(h0, opts or _c10d.BroadcastOptions()), tensors)

    def reduce(self, tensors: Any, opts: Any = None) -> Any:
        return self._issue(lambda h0: self._gloo.reduce(h0, opts or _c10d.ReduceOptions()), tensors)

    def allgather(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        return self._issue(
            lambda h0, h1: self._gloo.allgather(h0, h1, opts or _c10d.AllgatherOptions()), outputs, inputs
        )

    def _allgather_base(self, output: Any, input: Any, opts: Any = None) -> Any:
        return self._issue(
            lambda h0, h1: self._gloo._allgather_base(h0, h1, opts or _c10d.AllgatherOptions()), output, input
        )

    # torch 2.14 names the tensor collectives *_single (dist.all_gather_into_tensor calls
    # group.all_gather_single); a ProcessGroup without them sends npu tensors to a backend
    # for the npu device, which has none: gloo's, on the same memory, under either name
    def all_gather_single(self, output: Any, input: Any, opts: Any = None) -> Any:
        fn = getattr(self._gloo, "all_gather_single", None) or self._gloo._allgather_base
        return self._issue(lambda h0, h1: fn(h0, h1, opts or _c10d.AllgatherOptions()), output, input)

    def reduce_scatter_single(self, output: Any, input: Any, opts: Any = None) -> Any:
        fn = getattr(self._gloo, "reduce_scatter_single", None) or self._gloo._reduce_scatter_base
        return self._issue(lambda h0, h1: fn(h0, h1, opts or _c10d.ReduceScatterOptions()), output, input)

    def all_gather_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        return self._issue(
            lambda h0, h1: self._gloo.all_gather_single_coalesced(h0, h1, opts or _c10d.AllgatherOptions()),
            outputs,
            inputs,
        )

    def reduce_scatter_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        return self._issue(
            lambda h0, h1: self._gloo.reduce_scatter_single_coalesced(h0, h1, opts or _c10d.ReduceScatterOptions()),
            outputs,
            inputs,
        )

    def gather_single(self, output: Any, input: Any, opts: Any = None) -> Any:
        return self._issue(
            lambda h0, h1: self._gloo.gather_single(h0, h1, opts or _c10d.GatherOptions()), output, input
        )

    def gather(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        return self._issue(lambda h0, h1: self._gloo.gather(h0, h1, opts or _c10d.GatherOptions()), outputs, inputs)

    def scatter(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        return self._issue(lambda h0, h1: self._gloo.scatter(h0, h1, opts or _c10d.ScatterOptions()), outputs, inputs)

    def reduce_scatter(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        return self._issue(
            lambda h0, h1: self._gloo.reduce_scatter(h0, h1, opts or _c10d.ReduceScatterOptions()), outputs, inputs
        )

    def _reduce_scatter_base(self, output: Any, input: Any, opts: Any = None) -> Any:
        return self._issue(
            lambda h0, h1: self._gloo._reduce_scatter_base(h0, h1, opts or _c10d.ReduceScatterOptions()), output, input
        )

    def alltoall_base(self, output: Any, input: Any, output_split: Any, input_split: Any, opts: Any = None) -> Any:
        return self._issue(
            lambda h0, h1: self._gloo.alltoall_base(h0, h1, output_split, input_split, opts or _c10d.AllToAllOptions()),
            output,
            input,
        )

    def barrier(self, opts: Any = None) -> Any:
        return self._gloo.barrier(opts or _c10d.BarrierOptions())

    def send(self, tensors: Any, dst: int, tag: int = 0) -> Any:
        return self._issue(lambda h0: self._gloo.send(h0, dst, tag), tensors)

    def recv(self, tensors: Any, src: int, tag: int = 0) -> Any:
        return self._issue(lambda h0: self._gloo.recv(h0, src, tag), tensors)


def _create(store: Any, rank: int, size: int, timeout: timedelta) -> ProcessGroupHCCL:
    options = ProcessGroupHCCL.Options()
    options._timeout = timeout
    return ProcessGroupHCCL(store, rank, size, options)


def _is_hccl_available() -> bool:
    return True


def register() -> None:
    """Register ``hccl`` for npu tensors with torch.distributed (idempotent)."""
    if "hccl" not in dist.Backend.backend_list:
        dist.Backend.register_backend("hccl", _create, devices=["npu"])
    dist.is_hccl_available = _is_hccl_available  # type: ignore[attr-defined]
