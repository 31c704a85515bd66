"""torch_npu-shaped attention ops of the simulator: PA, FIA, FIA v2 and their helpers.

Each entry point binds its arguments, copies the host-side ones (lengths), checks
shapes on the host, then does what the device would in the current state:

* inside ``graph_task_update_begin/end`` on the current stream: not executed; the
  new host arguments are checked against the captured op and queued as an update;
* during capture: recorded as a kernel task of the graph (in the open task group);
  with ``auto_dispatch_capture`` the simulator adds the event and task group itself;
* otherwise: queued on the current stream and run when the stream reaches it.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from npugraph.sim import _graph as gr
from npugraph.sim import _runtime as rt
from npugraph.sim import kernels as K
from npugraph.sim.errors import CaptureError, WorkspaceTooSmall

__all__ = [
    "_npu_paged_attention",
    "_npu_paged_attention_get_workspace",
    "npu_fused_infer_attention_score",
    "_npu_fused_infer_attention_score_get_max_workspace",
    "npu_fused_infer_attention_score_v2",
    "_npu_fused_infer_attention_score_v2_get_max_workspace",
    "_npu_fused_infer_attention_score_out_graph",
]

_INT_MAX = 2147483647


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
    ) -> None:
        self._max_workspace = max_workspace
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
            lens = {k: _brief_host(params.get(k)) for k in self.host_args}
            raise WorkspaceTooSmall(
                f"{where}: {self.qualname} needs a {need}-byte workspace for {lens}, but the "
                f"workspace given has {have} bytes. (Simulator check: torch_npu does not "
                "size-check the workspace and the hardware would silently corrupt memory.) "
                "Size the workspace for the worst case over all lengths the graph may see."
            )

    def execute(self, params: dict[str, Any], where: str) -> None:
        info = self._check(params)
        self.check_workspace(params, where, info)
        st = rt.get_state()
        t0 = time.perf_counter()
        self._compute(params, info)
        model = st.config.kernel_time_model
        st.device_clock += model(self.name, params) if model is not None else time.perf_counter() - t0


def _brief_host(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        v = v.tolist()
    if isinstance(v, (list, tuple)) and len(v) > 8:
        return f"{list(v[:8])}... ({len(v)} entries)"
    return list(v) if isinstance(v, tuple) else v


def _host_copy(name: str, value: Any) -> Any:
    """Copy a host-side argument at call time (later mutation must change nothing)."""
    if value is None:
        return None
    st = rt.get_state()
    if isinstance(value, torch.Tensor):
        if st.capture is not None:
            st.capture.check_host_read(value, f"host argument {name!r}: clone")
        return gr.make_host_copy(lambda: value.clone())
    try:
        return tuple(int(x) for x in value)
    except TypeError as exc:
        raise TypeError(f"argument {name!r} must be a list of ints, got {value!r}") from exc


def check_placement(op: SimOp, params: dict[str, Any]) -> None:
    """Refuse arguments on the wrong side, as a device does: device tensors on the query's
    device, host-side arguments (lengths) as CPU tensors or lists."""
    query = params.get("query")
    if not isinstance(query, torch.Tensor):
        return
    for name, value in params.items():
        if name in op.host_args:
            if isinstance(value, torch.Tensor) and value.device.type != "cpu":
                raise _fail(
                    op.name,
                    name,
                    f"is a host-side argument (its values go into the kernel's tiling at launch) but is a "
                    f"tensor on {value.device}; pass a CPU tensor or a list",
                )
            continue
        for i, t in enumerate(value if isinstance(value, (list, tuple)) else (value,)):
            if isinstance(t, torch.Tensor) and t.dim() and t.device != query.device:
                label = f"{name}[{i}]" if isinstance(value, (list, tuple)) else name
                raise _fail(
                    op.name, label, f"is on {t.device} but the query is on {query.device}; the kernel reads both"
                )


def launch(op: SimOp, params: dict[str, Any]) -> None:
    """Issue ``op`` on the current stream in whatever mode the stream is in."""
    st = rt.get_state()
    st.charge("op_launch")
    st.counters["op:" + op.name] += 1
    check_placement(op, params)
    for name in op.host_args:
        params[name] = _host_copy(name, params.get(name))
    info = op.check(params)
    stream = st.current_stream
    if stream._updating is not None:
        gr.issue_update(stream, op, params, info)
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
    op.check_workspace(params, f"launch of {op.qualname}", info)
    where = f"{op.qualname} on {stream!r}"
    st.enqueue(stream, rt.KernelWork(lambda: op.execute(params, where), where))
    # Eager torch ops run on the host at once, and the next one may read this kernel's
    # output: eager launches are not deferred, even in adversarial mode.
    st.pump(drain=True)


def _auto_capture(session: gr.CaptureSession, op: SimOp, params: dict[str, Any]) -> None:
    stream = session.stream
    ev = rt.ExternalEvent()
    ev.wait(stream)
    ev.reset(stream)
    gr.graph_task_group_begin(stream)
    if params.get("workspace") is None:
        size = op.max_workspace_bytes(params)
        params["workspace"] = session.alloc((size,), (1,), torch.uint8)
    session.record_kernel(op, params)
    handle = gr.graph_task_group_end(stream)
    session.graph._auto_records.append({"op": op, "params": params, "handle": handle, "event": ev})


def _max_params(op: SimOp, params: dict[str, Any]) -> dict[str, Any]:
    """Params whose lengths are the largest the shapes allow (for max workspaces)."""
    info = op.check(params)
    p = dict(params)
    for name in op.host_args:
        v = p.get(name)
        if v is None:
            continue
        cap = info["max_kv"] if "kv" in name or name == "context_lens" else info["max_q"]
        if isinstance(v, torch.Tensor):
            p[name] = torch.full_like(v, cap)
        elif "kv" in name or name == "context_lens":
            p[name] = tuple(cap for _ in v)
        else:
            p[name] = v
    return p


def auto_update(g: gr.NPUGraph, cpu_update_input: list[dict[str, Any]]) -> None:
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
                value = torch.tensor(list(value), dtype=captured.dtype)  # e.g. PA context_lens
            params[key] = value
        rec["params"] = params  # the record keeps the latest values, as torch_npu's does
        with rt.use_stream(us):
            gr.graph_task_update_begin(us, rec["handle"])
            launch(op, params)
            gr.graph_task_update_end(us)
            rec["event"].record(us)


# --- PA ------------------------------------------------------------------------------


def _fail(op: str, name: str, msg: str) -> ValueError:
    return ValueError(f"{op}: argument {name!r} {msg}")


def _need_tensor(op: str, name: str, t: Any, dims: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise _fail(op, name, f"must be a tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise _fail(op, name, f"must have {dims} dims, got shape {list(t.shape)}")
    return t


def _pa_check(p: dict[str, Any]) -> dict[str, Any]:
    op = "_npu_paged_attention"
    q = _need_tensor(op, "query", p["query"], 3)
    kc = _need_tensor(op, "key_cache", p["key_cache"], 4)
    vc = _need_tensor(op, "value_cache", p["value_cache"], 4)
    bt = _need_tensor(op, "block_table", p["block_table"], 2)
    cl = _need_tensor(op, "context_lens", p["context_lens"], 1)
    out = _need_tensor(op, "out", p["out"], 3)
    t, n, d = q.shape
    _, bs, kvn, dk = kc.shape
    num_heads, num_kv_heads = int(p["num_heads"]), int(p["num_kv_heads"])
    if n != num_heads:
        raise _fail(op, "num_heads", f"is {num_heads} but query has {n} heads")
    if kvn != num_kv_heads:
        raise _fail(op, "num_kv_heads", f"is {num_kv_heads} but key_cache has {kvn} kv heads")
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise _fail(op, "num_heads", f"({num_heads}) must be a multiple of num_kv_heads")
    if dk != d:
        raise _fail(op, "key_cache", f"head size {dk} differs from the query's {d}")
    if vc.shape[:3] != kc.shape[:3]:
        raise _fail(op, "value_cache", f"shape {list(vc.shape)} does not match key_cache")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise _fail(op, "query", f"dtype {q.dtype} is not supported (float16/bfloat16)")
    if kc.dtype != q.dtype or vc.dtype != q.dtype or out.dtype != q.dtype:
        raise _fail(op, "key_cache", "query, caches and out must share one dtype")
    if bt.dtype != torch.int32:
        raise _fail(op, "block_table", f"must be int32, got {bt.dtype}")
    if bt.shape[0] != t:
        raise _fail(op, "block_table", f"has {bt.shape[0]} rows for {t} query tokens")
    if cl.dtype != torch.int32 or cl.device.type != "cpu":
        raise _fail(op, "context_lens", f"must be an int32 CPU tensor, got {cl.dtype}")
    if cl.shape[0] != t:
        raise _fail(op, "context_lens", f"has {cl.shape[0]} entries for {t} query tokens")
    if list(out.shape) != [t, n, vc.shape[3]]:
        raise _fail(op, "out", f"must have shape {[t, n, vc.shape[3]]}, got {list(out.shape)}")
    cap = bt.shape[1] * bs
    lens = cl.tolist()
    for i, length in enumerate(lens):
        if length < 0 or length > cap:
            raise _fail(
                op,
                f"context_lens[{i}]",
                f"= {length} is outside [0, {cap}] (block_table has {bt.shape[1]} blocks of {bs} per request)",
            )
    return {"max_len": max(lens, default=0), "max_kv": cap, "max_q": 1}


def _pa_compute(p: dict[str, Any], info: dict[str, Any]) -> None:
    q, kc, vc = p["query"], p["key_cache"], p["value_cache"]
    bt, cl, out = p["block_table"], p["context_lens"], p["out"]
    t = q.shape[0]
    lmax = info["max_len"]
    if lmax == 0 or t == 0:
        out.zero_()
        return
    k = K.gather_paged(kc, bt, cl, lmax, kc.shape[1], "_npu_paged_attention: block_table")
    v = K.gather_paged(vc, bt, cl, lmax, kc.shape[1], "_npu_paged_attention: block_table")
    o, _ = K.attention(
        q.unsqueeze(2),
        k.permute(0, 2, 1, 3),
        v.permute(0, 2, 1, 3),
        torch.ones(t, dtype=torch.int32),
        cl,
        float(p["scale_value"]),
    )
    out.copy_(o.squeeze(2))


def _pa_workspace(p: dict[str, Any], info: dict[str, Any]) -> int:
    q, vc = p["query"], p["value_cache"]
    return K.pa_workspace_bytes(q.shape[0], q.shape[1], vc.shape[2], vc.shape[3], int(info["max_len"]))


def _pa_max_workspace(p: dict[str, Any], info: dict[str, Any]) -> int:
    # The simulator knows its own model: the short (split-KV) path peaks anywhere up to
    # 1024 tokens, the long path grows with the length.
    return max(_pa_workspace(p, {"max_len": length}) for length in {1, min(1024, info["max_kv"]), info["max_kv"]})


_PA = SimOp(
    "_npu_paged_attention",
    "default",
    host_args=("context_lens",),
    output_args=("out",),
    check=_pa_check,
    compute=_pa_compute,
    workspace=_pa_workspace,
    auto=True,
    max_workspace=_pa_max_workspace,
)


def _npu_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    num_heads: int,
    scale_value: float,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    out: torch.Tensor,
    *,
    workspace: torch.Tensor | None = None,
) -> None:
    """Paged decode attention: one query token per request, lengths on the host."""
    launch(_PA, dict(locals()))


def _npu_paged_attention_get_workspace(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    num_heads: int,
    scale_value: float,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """Return a workspace sized for *these* arguments (not a maximum over lengths)."""
    st = rt.get_state()
    st.charge("workspace_query")
    p = dict(locals())
    p.pop("st")
    p["context_lens"] = _host_copy("context_lens", context_lens)
    size = _PA.workspace_bytes(p)
    return torch.empty(size, dtype=torch.uint8)


# --- FIA -----------------------------------------------------------------------------

_LAYOUTS = ("BSH", "BSND", "BNSD", "TND")
_UNSUPPORTED_FIA = (
    "pse_shift",
    "dequant_scale1",
    "quant_scale1",
    "dequant_scale2",
    "quant_scale2",
    "quant_offset2",
    "antiquant_scale",
    "antiquant_offset",
    "key_antiquant_scale",
    "key_antiquant_offset",
    "value_antiquant_scale",
    "value_antiquant_offset",
    "query_padding_size",
    "kv_padding_size",
    "key_shared_prefix",
    "value_shared_prefix",
    "actual_shared_prefix_len",
    "query_rope",
    "key_rope",
    "key_rope_antiquant_scale",
)


def _fia_check(p: dict[str, Any]) -> dict[str, Any]:
    """Normalise an FIA call: layouts to [B, N, S, D], lengths per batch."""
    op = "npu_fused_infer_attention_score"
    for name in _UNSUPPORTED_FIA:
        if p.get(name) is not None:
            raise NotImplementedError(f"{op}: the simulator does not model {name!r}")
    layout = p["input_layout"]
    if layout not in _LAYOUTS:
        raise _fail(op, "input_layout", f"must be one of {_LAYOUTS}, got {layout!r}")
    q, k, v = p["query"], p["key"], p["value"]
    n = int(p["num_heads"])
    kvn = int(p["num_key_value_heads"]) or n
    if n <= 0 or n % kvn:
        raise _fail(op, "num_heads", f"({n}) must be a positive multiple of num_key_value_heads ({kvn})")
    bt = p.get("block_table")
    block_size = int(p["block_size"])
    qlens = p.get("actual_seq_lengths")
    kvlens = p.get("actual_seq_lengths_kv")
    sparse = int(p["sparse_mode"])
    if sparse not in (0, 3):
        raise _fail(op, "sparse_mode", f"{sparse} is not modelled (0 and 3 are)")
    if sparse == 3 and p.get("atten_mask") is None:
        raise _fail(op, "atten_mask", "is required with sparse_mode=3 (the 2048x2048 compressed mask)")
    # query → [B, N, S, D]
    if layout == "TND":
        _need_tensor(op, "query", q, 3)
        t, qn, d = q.shape
        if qlens is None:
            raise _fail(op, "actual_seq_lengths", "is required with input_layout='TND' (cumulative ends)")
        ends = list(qlens)
        if any(b > a for a, b in zip(ends[1:], ends)) or (ends and ends[-1] != t) or not ends:
            raise _fail(
                op,
                "actual_seq_lengths",
                f"must be non-decreasing cumulative query ends whose last entry equals T={t}, got {_brief_host(ends)}",
            )
        batch = len(ends)
        starts = [0, *ends[:-1]]
        q_per = [e - s for s, e in zip(starts, ends)]
        sq = max(q_per)
    else:
        dims = 3 if layout == "BSH" else 4
        _need_tensor(op, "query", q, dims)
        if layout == "BSH":
            batch, sq, h = q.shape
            if h % n:
                raise _fail(op, "query", f"hidden size {h} is not a multiple of num_heads={n}")
            qn, d = n, h // n
        elif layout == "BSND":
            batch, sq, qn, d = q.shape
        else:
            batch, qn, sq, d = q.shape
        if qlens is None or sq == 1:  # ignored when the query length is 1
            q_per = [sq] * batch
        else:
            if len(qlens) != batch:
                raise _fail(op, "actual_seq_lengths", f"has {len(qlens)} entries for batch {batch}")
            q_per = list(qlens)
            if any(x < 0 or x > sq for x in q_per):
                raise _fail(op, "actual_seq_lengths", f"entries must lie in [0, {sq}]")
        starts = ends = []
    if qn != n:
        raise _fail(op, "num_heads", f"is {n} but query has {qn} heads")
    # keys
    if bt is not None:
        _need_tensor(op, "block_table", bt, 2)
        if bt.dtype != torch.int32:
            raise _fail(op, "block_table", f"must be int32, got {bt.dtype}")
        if bt.shape[0] != batch:
            raise _fail(op, "block_table", f"has {bt.shape[0]} rows for batch {batch}")
        if k.dim() == 3:
            kvh = k.shape[2]
            if kvh % kvn:
                raise _fail(op, "key", f"cache hidden size {kvh} is not a multiple of {kvn} kv heads")
            dk = kvh // kvn
        elif k.dim() == 4:
            if layout == "BNSD":
                _, kh, _, dk = k.shape
            else:
                _, _, kh, dk = k.shape
            if kh != kvn:
                raise _fail(op, "key", f"has {kh} kv heads, num_key_value_heads is {kvn}")
        else:
            raise _fail(op, "key", f"paged cache must have 3 or 4 dims, got {list(k.shape)}")
        cache_bs = k.shape[2] if (k.dim() == 4 and layout == "BNSD") else k.shape[1]
        if block_size != cache_bs:
            raise _fail(op, "block_size", f"is {block_size} but the cache blocks hold {cache_bs}")
        max_kv = bt.shape[1] * block_size
        if kvlens is None:
            raise _fail(op, "actual_seq_lengths_kv", "is required with a block_table")
        kv_per = list(kvlens)
        if len(kv_per) != batch:
            raise _fail(op, "actual_seq_lengths_kv", f"has {len(kv_per)} entries for batch {batch}")
        dv = v.shape[-1] if v.dim() == 4 else v.shape[2] // kvn
    else:
        if layout == "TND":
            _need_tensor(op, "key", k, 3)
            _, kh, dk = k.shape
            dv = v.shape[2]
            kends = list(kvlens) if kvlens is not None else None
            if kends is None or len(kends) != batch or (kends and kends[-1] != k.shape[0]):
                raise _fail(
                    op,
                    "actual_seq_lengths_kv",
                    "must list cumulative key ends (last = key T) per batch with a non-paged TND key",
                )
            kstarts = [0, *kends[:-1]]
            kv_per = [e - s for s, e in zip(kstarts, kends)]
            max_kv = max(kv_per)
        else:
            _need_tensor(op, "key", k, q.dim())
            if layout == "BSH":
                skv, kh = k.shape[1], k.shape[2] // (d or 1)
                dk = d
                dv = v.shape[2] // kh if kh else d
            elif layout == "BSND":
                skv, kh, dk = k.shape[1], k.shape[2], k.shape[3]
                dv = v.shape[3]
            else:
                kh, skv, dk = k.shape[1], k.shape[2], k.shape[3]
                dv = v.shape[3]
            max_kv = skv
            if k.shape[0] != batch:
                raise _fail(op, "key", f"batch {k.shape[0]} differs from the query's {batch}")
            kv_per = list(kvlens) if kvlens is not None else [skv] * batch
            if len(kv_per) != batch:
                raise _fail(op, "actual_seq_lengths_kv", f"has {len(kv_per)} entries for batch {batch}")
        if kh != kvn:
            raise _fail(op, "num_key_value_heads", f"is {kvn} but key has {kh} kv heads")
    if dk != d:
        raise _fail(op, "key", f"head size {dk} differs from the query's {d}")
    for i, x in enumerate(kv_per):
        if x < 0 or x > max_kv:
            raise _fail(op, "actual_seq_lengths_kv", f"[{i}] = {x} is outside [0, {max_kv}]")
    return {
        "layout": layout,
        "batch": batch,
        "heads": n,
        "kv_heads": kvn,
        "sq": sq,
        "d": d,
        "dv": dv,
        "q_per": q_per,
        "kv_per": kv_per,
        "starts": starts,
        "max_kv": max_kv,
        "max_q": sq,
        "rows": q.shape[0] if layout == "TND" else batch * sq,
    }


def _fia_out_shapes(p: dict[str, Any], info: dict[str, Any]) -> tuple[list[int], list[int]]:
    q = p["query"]
    layout, n, dv = info["layout"], info["heads"], info["dv"]
    if layout == "TND":
        out = [q.shape[0], n, dv]
        lse = [q.shape[0], n, 1]
    elif layout == "BSH":
        out = [q.shape[0], q.shape[1], n * dv]
        lse = [info["batch"], n, info["sq"], 1]
    elif layout == "BSND":
        out = [q.shape[0], q.shape[1], n, dv]
        lse = [info["batch"], n, info["sq"], 1]
    else:
        out = [q.shape[0], n, q.shape[2], dv]
        lse = [info["batch"], n, info["sq"], 1]
    if not p["softmax_lse_flag"]:
        lse = [1]
    return out, lse


def _fia_compute(p: dict[str, Any], info: dict[str, Any]) -> None:
    q, k, v = p["query"], p["key"], p["value"]
    out, lse_out = p["out"]
    layout = info["layout"]
    b, n, kvn, sq, d, dv = (info[x] for x in ("batch", "heads", "kv_heads", "sq", "d", "dv"))
    q_per = torch.tensor(info["q_per"], dtype=torch.int64)
    kv_per = torch.tensor(info["kv_per"], dtype=torch.int64)
    # query → [B, N, Sq, D]
    if layout == "TND":
        starts = torch.tensor(info["starts"], dtype=torch.int64)
        idx = starts.unsqueeze(1) + torch.arange(sq).unsqueeze(0)  # [B, Sq]
        idx = torch.where(torch.arange(sq).unsqueeze(0) < q_per.unsqueeze(1), idx, 0)
        qb = q[idx].permute(0, 2, 1, 3)  # [B, N, Sq, D]
    elif layout == "BSH":
        qb = q.reshape(b, sq, n, d).permute(0, 2, 1, 3)
    elif layout == "BSND":
        qb = q.permute(0, 2, 1, 3)
    else:
        qb = q
    lkv = int(kv_per.max()) if b else 0
    bt = p.get("block_table")
    if bt is not None:
        where = "npu_fused_infer_attention_score: block_table"
        if k.dim() == 4 and layout == "BNSD":  # [NB, KVN, BS, D] → [NB, BS, KVN, D]
            kc, vc = k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
        else:
            kc = k.reshape(k.shape[0], k.shape[1], kvn, d)
            vc = v.reshape(v.shape[0], v.shape[1], kvn, dv)
        kb = K.gather_paged(kc, bt, kv_per, lkv, int(p["block_size"]), where).permute(0, 2, 1, 3)
        vb = K.gather_paged(vc, bt, kv_per, lkv, int(p["block_size"]), where).permute(0, 2, 1, 3)
    elif layout == "TND":
        kstarts = torch.cumsum(kv_per, 0) - kv_per
        kidx = kstarts.unsqueeze(1) + torch.arange(lkv).unsqueeze(0)
        kidx = torch.where(torch.arange(lkv).unsqueeze(0) < kv_per.unsqueeze(1), kidx, 0)
        kb, vb = k[kidx].permute(0, 2, 1, 3), v[kidx].permute(0, 2, 1, 3)
    elif layout == "BSH":
        kb = k.reshape(b, k.shape[1], kvn, d).permute(0, 2, 1, 3)
        vb = v.reshape(b, v.shape[1], kvn, dv).permute(0, 2, 1, 3)
    elif layout == "BSND":
        kb, vb = k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
    else:
        kb, vb = k, v
    mask = None
    if int(p["sparse_mode"]) == 0 and p.get("atten_mask") is not None:
        mask = p["atten_mask"]
    o, lse = K.attention(qb, kb, vb, q_per, kv_per, float(p["scale"]), causal=int(p["sparse_mode"]) == 3, mask=mask)
    # o: [B, N, Sq, Dv]; rows past a request's query length are zero
    valid_q = (torch.arange(sq).view(1, 1, sq, 1) < q_per.view(b, 1, 1, 1)) if b else None
    if valid_q is not None:
        o = torch.where(valid_q, o, torch.zeros((), dtype=o.dtype))
    if layout == "TND":
        t = q.shape[0]
        tok = torch.arange(t)
        bidx = torch.searchsorted(torch.tensor([*info["starts"][1:], t + 1]), tok, right=True)
        sidx = tok - torch.tensor(info["starts"])[bidx]
        out.copy_(o[bidx, :, sidx])
        lse_rows = lse[bidx, :, sidx].unsqueeze(-1)
    elif layout == "BSH":
        out.copy_(o.permute(0, 2, 1, 3).reshape(out.shape))
        lse_rows = lse.unsqueeze(-1)
    elif layout == "BSND":
        out.copy_(o.permute(0, 2, 1, 3))
        lse_rows = lse.unsqueeze(-1)
    else:
        out.copy_(o)
        lse_rows = lse.unsqueeze(-1)
    if p["softmax_lse_flag"]:
        lse_out.copy_(lse_rows.reshape(lse_out.shape))
    else:
        lse_out.zero_()


def _fia_workspace(p: dict[str, Any], info: dict[str, Any]) -> int:
    return K.fia_workspace_bytes(info["rows"], info["heads"], info["dv"], max(info["kv_per"], default=0))


def _fia_op(name: str, overload: str, host: tuple[str, ...]) -> SimOp:
    return SimOp(
        name,
        overload,
        host_args=host,
        output_args=("out",),
        check=_fia_check,
        compute=_fia_compute,
        workspace=_fia_workspace,
        auto=True,
    )


_FIA_OUT = _fia_op("npu_fused_infer_attention_score", "out", ("actual_seq_lengths", "actual_seq_lengths_kv"))
_FIA = _fia_op("npu_fused_infer_attention_score", "default", ("actual_seq_lengths", "actual_seq_lengths_kv"))


def _fia_params(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    pse_shift: Any = None,
    atten_mask: torch.Tensor | None = None,
    actual_seq_lengths: Any = None,
    actual_seq_lengths_kv: Any = None,
    dequant_scale1: Any = None,
    quant_scale1: Any = None,
    dequant_scale2: Any = None,
    quant_scale2: Any = None,
    quant_offset2: Any = None,
    antiquant_scale: Any = None,
    antiquant_offset: Any = None,
    key_antiquant_scale: Any = None,
    key_antiquant_offset: Any = None,
    value_antiquant_scale: Any = None,
    value_antiquant_offset: Any = None,
    block_table: torch.Tensor | None = None,
    query_padding_size: Any = None,
    kv_padding_size: Any = None,
    key_shared_prefix: Any = None,
    value_shared_prefix: Any = None,
    actual_shared_prefix_len: Any = None,
    query_rope: Any = None,
    key_rope: Any = None,
    key_rope_antiquant_scale: Any = None,
    num_heads: int = 1,
    scale: float = 1.0,
    pre_tokens: int = _INT_MAX,
    next_tokens: int = _INT_MAX,
    input_layout: str = "BSH",
    num_key_value_heads: int = 0,
    sparse_mode: int = 0,
    inner_precise: int = 0,
    block_size: int = 0,
    antiquant_mode: int = 0,
    key_antiquant_mode: int = 0,
    value_antiquant_mode: int = 0,
    softmax_lse_flag: bool = False,
    query_quant_mode: int = 0,
    workspace: torch.Tensor | None = None,
    out: Any = None,
) -> dict[str, Any]:
    return dict(locals())


def _alloc_outputs(op: SimOp, p: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    info = op.check(p)
    out_shape, lse_shape = _fia_out_shapes(p, info)
    q = p["query"]
    out = torch.empty(out_shape, dtype=q.dtype)
    lse = torch.zeros(lse_shape, dtype=torch.float32)
    return out, lse


class _OpPacket:
    """A callable op with an ``.out`` overload, like ``torch_npu.<op>``."""

    def __init__(self, default: Callable[..., Any], out: Callable[..., Any], name: str) -> None:
        self._default = default
        self.out = out
        self.default = default
        self.__name__ = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._default(*args, **kwargs)


def _fia_default(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any) -> Any:
    if "out" in kwargs or "workspace" in kwargs:
        raise TypeError("npu_fused_infer_attention_score() got an unexpected keyword 'out'/'workspace' (use .out)")
    p = _fia_params(query, key, value, **kwargs)
    for name in _FIA.host_args:
        p[name] = _host_copy(name, p.get(name))
    p["out"] = list(_alloc_outputs(_FIA, p))
    launch(_FIA, p)
    return p["out"][0], p["out"][1]


def _fia_out(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any) -> Any:
    p = _fia_params(query, key, value, **kwargs)
    outs = p.get("out")
    if not isinstance(outs, (list, tuple)) or len(outs) != 2:
        raise ValueError("out must have 2 tensors (attention_out, softmax_lse)")
    p["out"] = list(outs)
    if rt.get_state().current_stream._updating is None:  # an update compares with the captured outs
        _check_out_shapes(_FIA_OUT, p)
    launch(_FIA_OUT, p)
    return outs[0], outs[1]


def _check_out_shapes(op: SimOp, p: dict[str, Any]) -> None:
    for name in op.host_args:
        p[name] = _host_copy(name, p.get(name))
    info = op.check(p)
    out_shape, lse_shape = _fia_out_shapes(p, info)
    out, lse = p["out"]
    if list(out.shape) != out_shape or out.dtype != p["query"].dtype:
        raise _fail(
            op.name,
            "out[0]",
            f"must be {out_shape} {p['query'].dtype}, got {list(out.shape)} {out.dtype}",
        )
    if p["softmax_lse_flag"] and list(lse.shape) != lse_shape:
        raise _fail(op.name, "out[1]", f"(softmax_lse) must be {lse_shape}, got {list(lse.shape)}")


npu_fused_infer_attention_score = _OpPacket(_fia_default, _fia_out, "npu_fused_infer_attention_score")


def _npu_fused_infer_attention_score_get_max_workspace(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any
) -> torch.Tensor:
    """Return a workspace large enough for every length these shapes allow."""
    return _max_workspace(_FIA, _fia_params(query, key, value, **kwargs))


def _max_workspace(op: SimOp, p: dict[str, Any]) -> torch.Tensor:
    rt.get_state().charge("workspace_query")
    for name in op.host_args:
        p[name] = _host_copy(name, p.get(name))
    return torch.empty(op.max_workspace_bytes(p), dtype=torch.uint8)


# --- FIA v2 --------------------------------------------------------------------------

_V2_RENAMES = {
    "num_query_heads": "num_heads",
    "softmax_scale": "scale",
    "actual_seq_qlen": "actual_seq_lengths",
    "actual_seq_kvlen": "actual_seq_lengths_kv",
    "return_softmax_lse": "softmax_lse_flag",
}


def _v2_to_v1(kwargs: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in kwargs.items():
        out[_V2_RENAMES.get(k, k)] = v
    return out


class _V2Op(SimOp):
    """FIA v2: v1's math under v2's argument names."""

    def __init__(self, overload: str) -> None:
        super().__init__(
            "npu_fused_infer_attention_score_v2",
            overload,
            host_args=("actual_seq_qlen", "actual_seq_kvlen"),
            output_args=("out",),
            check=lambda p: _fia_check(_v2_to_v1(p)),
            compute=lambda p, info: _fia_compute(_v2_to_v1(p), info),
            workspace=lambda p, info: _fia_workspace(_v2_to_v1(p), info),
            auto=True,
        )


_V2_OUT = _V2Op("out")
_V2 = _V2Op("default")


def _v2_params(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    query_rope: Any = None,
    key_rope: Any = None,
    pse_shift: Any = None,
    atten_mask: torch.Tensor | None = None,
    actual_seq_qlen: Any = None,
    actual_seq_kvlen: Any = None,
    block_table: torch.Tensor | None = None,
    num_query_heads: int = 1,
    num_key_value_heads: int = 0,
    softmax_scale: float = 1.0,
    pre_tokens: int = _INT_MAX,
    next_tokens: int = _INT_MAX,
    input_layout: str = "BSH",
    sparse_mode: int = 0,
    block_size: int = 0,
    return_softmax_lse: bool = False,
    workspace: torch.Tensor | None = None,
    out: Any = None,
    **quant: Any,
) -> dict[str, Any]:
    p = dict(locals())
    extra = p.pop("quant")
    for k, v in extra.items():
        if v is not None and v != 0:
            raise NotImplementedError(f"npu_fused_infer_attention_score_v2: the simulator does not model {k!r}")
    return p


def _v2_default(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any) -> Any:
    p = _v2_params(query, key, value, **kwargs)
    for name in _V2.host_args:
        p[name] = _host_copy(name, p.get(name))
    v1 = _v2_to_v1(p)
    out, lse = _alloc_outputs(_FIA, v1)
    p["out"] = [out, lse]
    launch(_V2, p)
    return out, lse


def _v2_out(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any) -> Any:
    p = _v2_params(query, key, value, **kwargs)
    outs = p.get("out")
    if not isinstance(outs, (list, tuple)) or len(outs) != 2:
        raise ValueError("out must have 2 tensors (attention_out, softmax_lse)")
    p["out"] = list(outs)
    launch(_V2_OUT, p)
    return outs[0], outs[1]


npu_fused_infer_attention_score_v2 = _OpPacket(_v2_default, _v2_out, "npu_fused_infer_attention_score_v2")


def _npu_fused_infer_attention_score_v2_get_max_workspace(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any
) -> torch.Tensor:
    """FIA v2's maximum workspace for these shapes."""
    return _max_workspace(_V2, _v2_params(query, key, value, **kwargs))


def _npu_fused_infer_attention_score_out_graph(
    update_stream: rt.Stream,
    handle: gr.NPUTaskGroupHandle,
    event: rt.ExternalEvent,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The 4-in-1 fast path: update begin + FIA ``.out`` + update end + event record."""
    st = rt.get_state()
    prev = st.current_stream
    st.current_stream = update_stream
    try:
        gr.graph_task_update_begin(update_stream, handle)
        try:
            res = _fia_out(query, key, value, **kwargs)
        except BaseException:
            update_stream._updating = None
            raise
        gr.graph_task_update_end(update_stream)
        event.record(update_stream)
    finally:
        st.current_stream = prev
    return res
