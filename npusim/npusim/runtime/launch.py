r"""How a simulated op is issued: described once (:class:`SimOp`), launched in whatever mode
the current stream is in.

Each entry point binds its arguments, checks their placement, copies the host-side ones
(lengths), checks shapes on the host, then does what the device would:

* inside ``graph_task_update_begin/end`` on the current stream: not executed; the
  new arguments are checked against the captured op and queued as an update;
* during capture: recorded as a kernel task of the graph (in the open task group);
* otherwise: queued on the current stream and run when the stream reaches it.

An entry point that torch_npu has as a torch op is an :class:`OpPacket` of
:class:`SimOverload`\ s: named and schema'd as torch_npu's ``OpOverload``\ s, and seen first by
a torch dispatch mode that asks for the simulator's ops (torch_npu's graph dispatch mode,
which ``auto_dispatch_capture`` enters), as such a mode sees every torch op.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from npusim.device.backend import on_host
from npusim.errors import WorkspaceTooSmall
from npusim.runtime import state as rt
from npusim.runtime.capture import make_host_copy
from npusim.runtime.memory import MEMORY, SCALARS
from npusim.runtime.taskgroups import issue_update, reissues_previous

__all__ = [
    "SimOp",
    "OpPacket",
    "SimOverload",
    "launch",
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
        max_workspace: Callable[[dict[str, Any], dict[str, Any]], int] | None = None,
        anchor: str = "query",
        bounds: Callable[[dict[str, Any], dict[str, Any]], None] | None = None,
        lengths: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any] | None] | None = None,
    ) -> None:
        self._max_workspace = max_workspace
        # ``lengths(params, info)``: the check of new host lengths alone, given ``info`` from a
        # check of the same device arguments (``None`` where it takes the whole check): what a
        # re-issue with the previous update's tensors needs (issue #78)
        self._lengths = lengths
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

    def check(self, params: dict[str, Any]) -> dict[str, Any]:
        """Validate shapes and host values; return derived sizes (``info``)."""
        return self._check(params)

    def recheck(self, params: dict[str, Any], info: dict[str, Any]) -> dict[str, Any]:
        """:meth:`check` of ``params`` whose device arguments (tensors, scalars) are those a
        check returned ``info`` for: only the host lengths are new."""
        if self._lengths is not None:
            found = self._lengths(params, info)
            if found is not None:
                return found
        return self._check(params)

    def workspace_bytes(self, params: dict[str, Any]) -> int:
        return self._workspace(params, self._check(params))

    def max_workspace_bytes(self, params: dict[str, Any]) -> int:
        """Bytes that cover every length the shapes of ``params`` allow."""
        if self._max_workspace is not None:
            return self._max_workspace(params, self._check(params))
        return self.workspace_bytes(_max_params(self, params))

    def check_workspace(self, params: dict[str, Any], where: object, info: dict[str, Any] | None = None) -> None:
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
        modelled = model(self.name, params) if model is not None else None
        # None: a kernel the model does not cover runs for its CPU time
        st.device_clock += modelled if modelled is not None else time.perf_counter() - t0


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
        return tuple(map(int, value))
    except TypeError as exc:
        raise TypeError(f"argument {name!r} must be a list of ints, got {value!r}") from exc


def check_placement(op: SimOp, params: dict[str, Any]) -> None:
    """Refuse arguments on the wrong side, as a device does: device tensors on the device of
    the op's anchor argument (the query, for attention), host-side arguments (lengths) as
    CPU tensors or lists."""
    anchor = params.get(op.anchor)
    if not isinstance(anchor, torch.Tensor):
        return
    host_args = op.host_args
    for name, value in params.items():
        if value is None or type(value) in SCALARS:
            continue  # most of a kernel's arguments (FIA has 43): nothing placed
        if name in host_args:
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
                    "(npusim.install_npu_device() gives this process the npu device)",
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
    # The launch's own host work (binding, placement and shape checks, the copies of host
    # lengths, aliases) is the runtime's, not the program's: no torch mode sees it.  While a
    # replay is pending the simulator's eager ordering is on the stacks, and its Python call
    # per torch function (.dim(), .shape, .tolist()) was most of a re-issue's cost inside a
    # serving step (issue #78: 133 calls a PA re-issue).  A capture's recorder needs none of
    # it either: host copies are made outside it (make_host_copy), host reads checked by name.
    with torch._C._DisableTorchDispatch(), torch._C.DisableTorchFunction():
        _launch(op, params)


def _launch(op: SimOp, params: dict[str, Any]) -> None:
    st = rt.get_state()
    st.charge("op_launch")
    st.counters["op:" + op.name] += 1
    stream = st.current_stream
    updating = stream._updating is not None
    # a re-issue whose device arguments are the previous update's own (the engine's every step)
    # was placed, checked and compared then: only its host lengths are new
    previous = reissues_previous(stream, op, params) if updating else None
    if previous is None:
        check_placement(op, params)
    for name in op.host_args:
        params[name] = host_copy(name, params.get(name))
    info = op.check(params) if previous is None else op.recheck(params, previous.info)
    if updating:
        issue_update(stream, op, params, info, previous)
        return
    session = st.capture
    if session is not None:
        session.check_stream(stream, op.qualname)
        op.check_workspace(params, f"capture of {op.qualname}", info)
        session.record_kernel(op, params)
        return
    op.check_bounds(params, info)  # it runs as soon as the stream reaches it: say so now
    op.check_workspace(params, f"launch of {op.qualname}", info)
    where = f"{op.qualname} on {stream!r}"
    # device memory from now on: eager ops on it are ordered after this kernel
    st.memory.adopt([v for k, v in params.items() if k not in op.host_args])
    st.enqueue(stream, rt.KernelWork(lambda: op.execute(params, where), where))


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


def fail(op: str, name: str, msg: str) -> ValueError:
    return ValueError(f"{op}: argument {name!r} {msg}")


def need_tensor(op: str, name: str, t: Any, dims: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise fail(op, name, f"must be a tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise fail(op, name, f"must have {dims} dims, got shape {list(t.shape)}")
    return t


def _is_default(value: Any, default: Any) -> bool:
    if default is inspect.Parameter.empty:
        return False
    if value is default:
        return True
    if isinstance(value, torch.Tensor) or default is None or type(value) is not type(default):
        return False
    return bool(value == default)


class SimOverload:
    """One overload of a torch_npu op, as a dispatch mode sees torch_npu's ``OpOverload``:
    ``__name__`` (``"op.overload"``, what torch_npu's graph handlers are registered under),
    ``_schema`` (torch_npu's schema text) and a call.

    Called while the top torch dispatch mode asks for the simulator's ops
    (``dispatches_sim_ops``), the call goes to that mode's ``__torch_dispatch__`` with the
    mode popped, as torch dispatches a torch op, and with the arguments as torch's
    dispatcher passes them: the schema's positional parameters in ``args`` (trailing ones
    equal to their defaults dropped), keyword-only ones in ``kwargs`` only where they are
    not their defaults.  Otherwise it runs the simulator's kernel."""

    def __init__(
        self, fn: Callable[..., Any], name: str, overload: str, schema: str = "", signature: Any = None
    ) -> None:
        self._fn = fn
        self.__name__ = f"{name}.{overload}"
        self._overloadname = overload
        self._schema = schema
        self._signature = inspect.signature(signature if signature is not None else fn)

    def name(self) -> str:
        return f"npu::{self.__name__}"

    def __repr__(self) -> str:
        return f"npu.{self.__name__}"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        depth = torch._C._len_torch_dispatch_stack()
        if depth:
            mode = torch._C._get_dispatch_stack_at(depth - 1)
            if getattr(mode, "dispatches_sim_ops", False):
                args, kwargs = self.normalize(args, kwargs)
                with torch.utils._python_dispatch._pop_mode_temporarily() as top:
                    return top.__torch_dispatch__(self, (), args, kwargs)
        # the binding of torch_npu's arguments (C++ there) is the simulator's own time too
        return rt.get_state().own(self._fn, *args, **kwargs)

    def normalize(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` as torch's dispatcher hands them to a dispatch mode."""
        bound = self._signature.bind(*args, **kwargs)
        positional: list[tuple[Any, Any]] = []
        keyword: dict[str, Any] = {}
        for p in self._signature.parameters.values():
            if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                keyword.update(bound.arguments.get(p.name, {}) if p.kind is p.VAR_KEYWORD else {})
                continue
            value = bound.arguments.get(p.name, p.default)
            if p.kind is p.KEYWORD_ONLY:
                if p.name in bound.arguments and not _is_default(value, p.default):
                    keyword[p.name] = value
            else:
                positional.append((value, p.default))
        while positional and _is_default(*positional[-1]):
            positional.pop()
        return tuple(v for v, _ in positional), keyword


class OpPacket:
    """A torch_npu op with its overloads (``torch_npu.<op>``, ``.default``, ``.out``): calling
    it calls ``.default``."""

    def __init__(
        self,
        default: Callable[..., Any],
        out: Callable[..., Any] | None,
        name: str,
        *,
        schemas: tuple[str, str] = ("", ""),
        signatures: tuple[Any, Any] = (None, None),
    ) -> None:
        self.default = SimOverload(default, name, "default", schemas[0], signatures[0])
        if out is not None:
            self.out = SimOverload(out, name, "out", schemas[1], signatures[1])
        self.__name__ = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.default(*args, **kwargs)


def max_workspace(op: SimOp, p: dict[str, Any]) -> torch.Tensor:
    rt.get_state().charge("workspace_query")
    for name in op.host_args:
        p[name] = host_copy(name, p.get(name))
    device = p["query"].device if isinstance(p.get("query"), torch.Tensor) else MEMORY
    return torch.empty(op.max_workspace_bytes(p), dtype=torch.uint8, device=device)
