# mypy: disable-error-code="override"
# (each collective keeps torch_npu's parameter names; torch's stubs name some otherwise)
"""``hccl`` on the simulator: torch.distributed's collectives for ``npu`` tensors, over gloo.

torch_npu registers an ``hccl`` backend (HCCL, Huawei's collective library) for npu
tensors and adds ``torch.distributed.is_hccl_available``.  The simulator's npu memory is
host memory, so each collective runs gloo on CPU tensors over the same bytes
(:func:`~npugraph.sim.device.backend.on_host`): results land in the npu tensors themselves, as
HCCL's do.  ``init_process_group(backend="hccl")`` and ``new_group(backend="hccl")`` then
work at any world size gloo reaches (processes on this host).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from npugraph.sim.device.backend import on_host as _host  # npu tensors (also in lists) as CPU views

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

    # each collective: gloo on the same memory (the Work it returns is gloo's)
    def allreduce(self, tensors: Any, opts: Any = None) -> Any:
        return self._gloo.allreduce(_host(tensors), opts or _c10d.AllreduceOptions())

    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> Any:
        return self._gloo.allreduce_coalesced(_host(tensors), opts or _c10d.AllreduceCoalescedOptions())

    def broadcast(self, tensors: Any, opts: Any = None) -> Any:
        return self._gloo.broadcast(_host(tensors), opts or _c10d.BroadcastOptions())

    def reduce(self, tensors: Any, opts: Any = None) -> Any:
        return self._gloo.reduce(_host(tensors), opts or _c10d.ReduceOptions())

    def allgather(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        return self._gloo.allgather(_host(outputs), _host(inputs), opts or _c10d.AllgatherOptions())

    def _allgather_base(self, output: Any, input: Any, opts: Any = None) -> Any:
        return self._gloo._allgather_base(_host(output), _host(input), opts or _c10d.AllgatherOptions())

    # torch 2.14 names the tensor collectives *_single (dist.all_gather_into_tensor calls
    # group.all_gather_single); a ProcessGroup without them sends npu tensors to a backend
    # for the npu device, which has none: gloo's, on the same memory, under either name
    def all_gather_single(self, output: Any, input: Any, opts: Any = None) -> Any:
        fn = getattr(self._gloo, "all_gather_single", None) or self._gloo._allgather_base
        return fn(_host(output), _host(input), opts or _c10d.AllgatherOptions())

    def reduce_scatter_single(self, output: Any, input: Any, opts: Any = None) -> Any:
        fn = getattr(self._gloo, "reduce_scatter_single", None) or self._gloo._reduce_scatter_base
        return fn(_host(output), _host(input), opts or _c10d.ReduceScatterOptions())

    def all_gather_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        return self._gloo.all_gather_single_coalesced(_host(outputs), _host(inputs), opts or _c10d.AllgatherOptions())

    def reduce_scatter_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        return self._gloo.reduce_scatter_single_coalesced(
            _host(outputs), _host(inputs), opts or _c10d.ReduceScatterOptions()
        )

    def gather_single(self, output: Any, input: Any, opts: Any = None) -> Any:
        return self._gloo.gather_single(_host(output), _host(input), opts or _c10d.GatherOptions())

    def gather(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        return self._gloo.gather(_host(outputs), _host(inputs), opts or _c10d.GatherOptions())

    def scatter(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        return self._gloo.scatter(_host(outputs), _host(inputs), opts or _c10d.ScatterOptions())

    def reduce_scatter(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        return self._gloo.reduce_scatter(_host(outputs), _host(inputs), opts or _c10d.ReduceScatterOptions())

    def _reduce_scatter_base(self, output: Any, input: Any, opts: Any = None) -> Any:
        return self._gloo._reduce_scatter_base(_host(output), _host(input), opts or _c10d.ReduceScatterOptions())

    def alltoall_base(self, output: Any, input: Any, output_split: Any, input_split: Any, opts: Any = None) -> Any:
        return self._gloo.alltoall_base(
            _host(output), _host(input), output_split, input_split, opts or _c10d.AllToAllOptions()
        )

    def barrier(self, opts: Any = None) -> Any:
        return self._gloo.barrier(opts or _c10d.BarrierOptions())

    def send(self, tensors: Any, dst: int, tag: int = 0) -> Any:
        return self._gloo.send(_host(tensors), dst, tag)

    def recv(self, tensors: Any, src: int, tag: int = 0) -> Any:
        return self._gloo.recv(_host(tensors), src, tag)


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
