"""How a simulated op is issued: described once (:class:`SimOp`), launched in whatever mode
the current stream is in.

Each entry point binds its arguments, checks their placement, copies the host-side ones
(lengths), checks shapes on the host, then does what the device would:

* inside ``graph_task_update_begin/end`` on the current stream: not executed; the
  new arguments are checked against the captured op and queued as an update;
* during capture: recorded as a kernel task of the graph (in the open task group);
  with ``auto_dispatch_capture`` the simulator adds the event and task group itself;
* otherwise: queued on the current stream and run when the stream reaches it.
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from npugraph.sim.device.backend import on_host
from npugraph.sim.errors import CaptureError, WorkspaceTooSmall
from npugraph.sim.runtime import state as rt
from npugraph.sim.runtime.capture import CaptureSession, make_host_copy
from npugraph.sim.runtime.memory import MEMORY
from npugraph.sim.runtime.taskgroups import (
    graph_task_group_begin,
    graph_task_group_end,
    graph_task_update_begin,
    graph_task_update_end,
    issue_update,
)

__all__ = [
    "SimOp",
    "OpPacket",
    "launch",
    "auto_update",
    "host_copy",
    "max_workspace",
    "fail",
    "need_tensor",
    "brief_host",
]


class SimOp:
    """The simulator's description of one op overload."""

    def __init__(
        self,
        name: str,
        overload: str,
        host_args: tuple[str, ...],
        output_args: tuple[str, ...],
        check: Callable[[dict[str, Any]], dict[str, Any]],
        compute: Callable[[dict[str, Any], dict[str, Any]], None],
        workspace: Callable[[dict[str, Any], dict[str, Any]], int],
        auto: bool,
        max_workspace: Callable[[dict[str, Any], dict[str, Any]], int] | None = None,
        anchor: str = "query",
        bounds: Callable[[dict[str, Any], dict[str, Any]], None] | None = None,
    ) -> None:
        self._max_workspace = max_workspace
        # checks of what the kernel reads when it runs (lengths within the block table):
        # a capture or a task update only records the arguments, and the device accepts
        # them (vllm-ascend captures PA with a length past the table, for its workspace);
        # the kernel reads out of bounds only when it runs, where the simulator raises
        self._bounds = bounds
        # the device argument the others must share a device with (check_placement)
        self.anchor = anchor
        self.name, self.overload = name, overload
        self.qualname = f"{name}.{overload}"
        self.host_args, self.output_args = host_args, output_args
        self._check, self._compute, self._workspace = check, compute, workspace
        self.auto = auto

    def check(self, params: dict[str, Any]) -> dict[str, Any]:
        """Validate shapes and host values; return derived sizes (``info``)."""
        return self._check(params)

    def workspace_bytes(self, params: dict[str, Any]) -> int:
        return self._workspace(params, self._check(params))

    def max_workspace_bytes(self, params: dict[str, Any]) -> int:
        """Bytes that cover every length the shapes of ``params`` allow."""
        if self._max_workspace is not None:
            return self._max_workspace(params, self._check(params))
        return self.workspace_bytes(_max_params(self, params))

    def check_workspace(self, params: dict[str, Any], where: str, info: dict[str, Any] | None = None) -> None:
        ws = params.get("workspace")
        if ws is None:
            return
        need = self._workspace(params, info if info is not None else self._check(params))
        have = ws.numel() * ws.element_size()
        if have < need:
            lens = {k: brief_host(params.get(k)) for k in self.host_args}
            raise WorkspaceTooSmall(
                f"{where}: {self.qualname} needs a {need}-byte workspace for {lens}, but the "
                f"workspace given has {have} bytes. (Simulator check: torch_npu does not "
                "size-check the workspace and the hardware would silently corrupt memory.) "
                "Size the workspace for the worst case over all lengths the graph may see."
            )

    def check_bounds(self, params: dict[str, Any], info: dict[str, Any]) -> None:
        """Raise if running the kernel on ``params`` would read out of bounds."""
        if self._bounds is not None:
            self._bounds(params, info)

    def execute(self, params: dict[str, Any], where: str) -> None:
        info = self._check(params)
        self.check_bounds(params, info)
        self.check_workspace(params, where, info)
        st = rt.get_state()
        t0 = time.perf_counter()
        # the kernel's math runs on the CPU over the device's memory (npu memory is host memory)
        self._compute(on_host(params), info)
        model = st.config.kernel_time_model
        st.device_clock += model(self.name, params) if model is not None else time.perf_counter() - t0


def brief_host(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        v = v.tolist()
    if isinstance(v, (list, tuple)) and len(v) > 8:
        return f"{list(v[:8])}... ({len(v)} entries)"
    return list(v) if isinstance(v, tuple) else v


def host_copy(name: str, value: Any) -> Any:
    """Copy a host-side argument at call time (later mutation must change nothing)."""
    if value is None:
        return None
    st = rt.get_state()
    if isinstance(value, torch.Tensor):
        if st.capture is not None:
            st.capture.check_host_read(value, f"host argument {name!r}: clone")
        return make_host_copy(lambda: value.clone())
    try:
        return tuple(int(x) for x in value)
    except TypeError as exc:
        raise TypeError(f"argument {name!r} must be a list of ints, got {value!r}") from exc


def check_placement(op: SimOp, params: dict[str, Any]) -> None:
    """Refuse arguments on the wrong side, as a device does: device tensors on the device of
    the op's anchor argument (the query, for attention), host-side arguments (lengths) as
    CPU tensors or lists."""
    anchor = params.get(op.anchor)
    if not isinstance(anchor, torch.Tensor):
        return
    for name, value in params.items():
        if name in op.host_args:
            if isinstance(value, torch.Tensor) and value.device.type != "cpu":
                raise fail(
                    op.name,
                    name,
                    f"is a host-side argument (its values go into the kernel's tiling at launch) but is a "
                    f"tensor on {value.device}; pass a CPU tensor or a list",
                )
            continue
        for i, t in enumerate(value if isinstance(value, (list, tuple)) else (value,)):
            if not isinstance(t, torch.Tensor) or not t.dim():
                continue
            label = f"{name}[{i}]" if isinstance(value, (list, tuple)) else name
            if t.device.type != "npu":
                raise fail(
                    op.name,
                    label,
                    f"is a {t.device} tensor, but the kernel reads it in device memory: pass an npu tensor "
                    "(npugraph.sim.install_npu_device() gives this process the npu device)",
                )
            if t.device != anchor.device:
                raise fail(
                    op.name, label, f"is on {t.device} but the {op.anchor} is on {anchor.device}; the kernel reads both"
                )


@rt.locked
def launch(op: SimOp, params: dict[str, Any]) -> None:
    """Issue ``op`` on the current stream in whatever mode the stream is in (nothing for
    fake tensors: a torch op's fake implementation, tracing shapes only)."""
    if isinstance(params.get(op.anchor), FakeTensor):
        return
    st = rt.get_state()
    st.charge("op_launch")
    st.counters["op:" + op.name] += 1
    check_placement(op, params)
    for name in op.host_args:
        params[name] = host_copy(name, params.get(name))
    info = op.check(params)
    stream = st.current_stream
    if stream._updating is not None:
        issue_update(stream, op, params, info)
        return
    session = st.capture
    if session is not None:
        if session.stream is not stream:
            raise CaptureError(
                f"{op.qualname} launched on {stream!r} while {session.stream!r} is capturing "
                "(capture_error_mode='global' forbids work on other streams during capture)"
            )
        if session.auto and op.auto and session.open_group is None:
            _auto_capture(session, op, params)
            return
        op.check_workspace(params, f"capture of {op.qualname}", info)
        session.record_kernel(op, params)
        return
    op.check_bounds(params, info)  # it runs as soon as the stream reaches it: say so now
    op.check_workspace(params, f"launch of {op.qualname}", info)
    where = f"{op.qualname} on {stream!r}"
    # device memory from now on: eager ops on it are ordered after this kernel
    st.memory.adopt([v for k, v in params.items() if k not in op.host_args])
    st.enqueue(stream, rt.KernelWork(lambda: op.execute(params, where), where))


def _auto_capture(session: CaptureSession, op: SimOp, params: dict[str, Any]) -> None:
    stream = session.stream
    ev = rt.ExternalEvent()
    ev.wait(stream)
    ev.reset(stream)
    graph_task_group_begin(stream)
    if params.get("workspace") is None:
        size = op.max_workspace_bytes(params)
        params["workspace"] = session.alloc((size,), (1,), torch.uint8, params["query"].device)
    session.record_kernel(op, params)
    handle = graph_task_group_end(stream)
    session.graph._auto_records.append({"op": op, "params": params, "handle": handle, "event": ev})


def _max_params(op: SimOp, params: dict[str, Any]) -> dict[str, Any]:
    """Params whose lengths are the largest the shapes allow (for max workspaces)."""
    info = op.check(params)
    p = dict(params)
    for name in op.host_args:
        v = p.get(name)
        if v is None:
            continue
        if "kv" not in name and name != "context_lens":
            continue  # query ends as given: the workspace grows with the keys
        cap = info["max_kv"]
        if isinstance(v, torch.Tensor):  # a host value: made on the host, never captured
            p[name] = make_host_copy(functools.partial(torch.full_like, v, cap))
        else:
            p[name] = tuple(cap for _ in v)
    return p


def auto_update(g: Any, cpu_update_input: list[dict[str, Any]]) -> None:
    """``NPUGraph.update``: rewrite the host args of every auto-dispatch record."""
    if not g._auto:
        raise RuntimeError("NPUGraph.update is only supported for graphs captured with auto_dispatch_capture=True")
    records = g._auto_records
    if len(cpu_update_input) == 1:
        inputs = list(cpu_update_input) * len(records)
    elif len(cpu_update_input) == len(records):
        inputs = list(cpu_update_input)
    else:
        raise RuntimeError(
            f"The length of cpu_update_input ({len(cpu_update_input)}) must be 1 or equal to "
            f"the number of captured ops to update ({len(records)})"
        )
    st = rt.get_state()
    if st.auto_update_stream is None:
        st.auto_update_stream = rt.Stream()
    us = st.auto_update_stream
    for rec, update_input in zip(records, inputs):
        op: SimOp = rec["op"]
        unknown = set(update_input) - set(op.host_args)
        if unknown:
            warnings.warn(
                f"NPUGraph.update: keys {sorted(unknown)} are not host arguments of "
                f"{op.qualname} ({list(op.host_args)}) and were skipped",
                stacklevel=3,
            )
        params = dict(rec["params"])
        for key in op.host_args:
            if key not in update_input:
                continue
            value = update_input[key]
            captured = params.get(key)
            if isinstance(captured, torch.Tensor) and not isinstance(value, torch.Tensor):
                value = torch.tensor(list(value), dtype=captured.dtype, device=captured.device)  # e.g. PA context_lens
            params[key] = value
        rec["params"] = params  # the record keeps the latest values, as torch_npu's does
        with rt.use_stream(us):
            graph_task_update_begin(us, rec["handle"])
            launch(op, params)
            graph_task_update_end(us)
            rec["event"].record(us)


def fail(op: str, name: str, msg: str) -> ValueError:
    return ValueError(f"{op}: argument {name!r} {msg}")


def need_tensor(op: str, name: str, t: Any, dims: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise fail(op, name, f"must be a tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise fail(op, name, f"must have {dims} dims, got shape {list(t.shape)}")
    return t


class OpPacket:
    """A callable op with an ``.out`` overload, like ``torch_npu.<op>``."""

    def __init__(self, default: Callable[..., Any], out: Callable[..., Any], name: str) -> None:
        self._default = default
        self.out = out
        self.default = default
        self.__name__ = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._default(*args, **kwargs)


def max_workspace(op: SimOp, p: dict[str, Any]) -> torch.Tensor:
    rt.get_state().charge("workspace_query")
    for name in op.host_args:
        p[name] = host_copy(name, p.get(name))
    device = p["query"].device if isinstance(p.get("query"), torch.Tensor) else MEMORY
    return torch.empty(op.max_workspace_bytes(p), dtype=torch.uint8, device=device)
