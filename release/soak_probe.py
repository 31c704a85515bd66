"""What a soak (release/soak.py) samples inside a served engine, installed at interpreter start
by release/ascend_site.py (vLLM) and release/sglang/site.py (SGLang) when
``NPUGRAPH_SOAK_SAMPLES=DIR`` is set.

The process that runs the model (vLLM's EngineCore, SGLang's scheduler) starts a sampler
thread at its first forward pass or graph (SGLang's: when it builds its model runner), and appends one JSON line a second to
``DIR/samples-<pid>.jsonl``:

* ``rss``: the process's resident memory; ``host_rss``: the part of it outside the simulated
  card's large blocks (its own anonymous mappings of 64 MiB and more: the KV caches, whose
  pages the host backs only as the engine first writes them, so that ``rss`` climbs as a soak
  reaches new cache blocks, a device's memory a card would hold); ``device_bytes``: the
  simulated device's bytes allocated (``torch.npu.memory_allocated``); what fills the host
  side: glibc's heap (``malloc_in_use``, ``malloc_free``: held free in its arenas,
  ``malloc_mapped``) and Python's (``python_blocks``: its allocated blocks);
* ``graphs``: the captured graphs alive (the simulator's ``NPUGraph`` objects: npugraph's and
  the engine's own alike); ``npugraph_graphs``: npugraph's entries, over its runtimes;
* ``external_events``: the ExternalEvents alive; ``streams``: the device streams created so far;
* ``forwards``: the forward passes, counted by ``MODE:BATCH``: vLLM's graph mode for the
  pass (``FULL``, ``PIECEWISE``, ``NONE``: eager) and its batch descriptor's tokens; SGLang's
  decode batches, ``graph`` or ``eager``, by batch size (a decode batch run eagerly is a
  fallback; SGLang's prefill is eager by design and not counted).

Counting is by hooks on the classes (weak sets: a sample never keeps an object alive), no
walk of the heap.  Unset, nothing is installed.
"""

from __future__ import annotations

import collections
import ctypes
import json
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["install"]

PERIOD_S = 1.0


class _Probe:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.graphs: weakref.WeakSet[Any] = weakref.WeakSet()
        self.events: weakref.WeakSet[Any] = weakref.WeakSet()
        self.runtimes: weakref.WeakSet[Any] = weakref.WeakSet()
        self.stream_ids: set[int] = set()
        self.forwards: collections.Counter[str] = collections.Counter()
        self.started = False
        self.lock = threading.Lock()
        self.stopped = threading.Event()  # set only by a test: the engine's process samples until it ends

    def start(self) -> None:
        with self.lock:
            if self.started:
                return
            self.started = True
        threading.Thread(target=self._run, name="npugraph-soak-probe", daemon=True).start()

    def forward(self, mode: str, batch: int) -> None:
        self.forwards[f"{mode}:{batch}"] += 1
        self.start()  # the process that runs the model, in every mode (eager too)

    def _sample(self) -> dict[str, Any]:
        import psutil
        import torch

        rss = psutil.Process().memory_info().rss
        return {
            "t": time.time(),
            "rss": rss,
            "host_rss": rss - _large_anonymous_resident(),
            "device_bytes": int(torch.npu.memory_allocated()),
            **_malloc(),
            "python_blocks": sys.getallocatedblocks(),
            "graphs": len(self.graphs),
            "npugraph_graphs": sum(len(r.entries()) for r in list(self.runtimes)),
            "external_events": len(self.events),
            "streams": len(self.stream_ids),
            "forwards": dict(self.forwards),
        }

    def _run(self) -> None:
        path = self.folder / f"samples-{os.getpid()}.jsonl"
        while not self.stopped.wait(PERIOD_S):
            try:
                line = json.dumps(self._sample())
            except Exception as exc:  # a sample that fails says so in the file, and sampling goes on
                line = json.dumps({"t": time.time(), "error": f"{type(exc).__name__}: {exc}"})
            with path.open("a") as f:
                f.write(line + "\n")


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _malloc() -> dict[str, int]:
    """glibc's heap: ``malloc_in_use`` (bytes handed out from its arenas), ``malloc_free``
    (bytes its arenas hold free, not given back to the system: fragmentation), ``malloc_mapped``
    (its own mappings for large requests); empty where the C library has no ``mallinfo2``."""
    try:
        info = ctypes.CDLL(None).mallinfo2
    except (AttributeError, OSError):
        return {}
    info.restype = _Mallinfo2
    m = info()
    return {"malloc_in_use": m.uordblks, "malloc_free": m.fordblks, "malloc_mapped": m.hblkhd}


LARGE = 64 << 20  # the simulator's large blocks (npusim/npusim/device/csrc/npu_device.cpp: kLargeFrom)


def _large_anonymous_resident(smaps: str = "/proc/self/smaps") -> int:
    """Resident bytes of this process's anonymous mappings of ``LARGE`` bytes and more."""
    total, large = 0, False
    with open(smaps) as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and ":" not in head[0]:  # a mapping: "start-end perms offset dev inode [path]"
                start, end = (int(x, 16) for x in head[0].split("-"))
                large = end - start >= LARGE and len(head) < 6
            elif large and head and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total


def _tracked(cls: Any, name: str, on_new: Callable[[Any], None]) -> None:
    original = getattr(cls, name)

    def tracked(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        on_new(out if name == "__new__" else self)
        return out

    setattr(cls, name, staticmethod(tracked) if name == "__new__" else tracked)


def install(folder: str, after_import: Callable[[str, Callable[[Any], None]], None], engine: str) -> None:
    """Sample into ``folder`` from the process that captures graphs (``engine``: ``vllm`` or
    ``sglang``, whose forward passes are counted)."""
    probe = _Probe(Path(folder))

    def graphs(module: Any) -> None:  # the simulator's torch_npu.npu.graphs
        def new_graph(g: Any) -> None:
            probe.graphs.add(g)
            probe.start()

        _tracked(module.NPUGraph, "__init__", new_graph)

    def streams(module: Any) -> None:  # the simulator's streams
        _tracked(module.Stream, "__new__", lambda s: probe.stream_ids.add(int(s.stream_id)))

    def external_events(module: Any) -> None:
        _tracked(module.ExternalEvent, "__init__", probe.events.add)

    def runtime(module: Any) -> None:
        _tracked(module.Runtime, "__init__", probe.runtimes.add)

    after_import("npusim.surfaces.graphs", graphs)
    after_import("npusim.runtime.state", streams)
    after_import("npusim.runtime.external", external_events)
    after_import("npugraph.runtime", runtime)
    if engine == "vllm":
        after_import("vllm.forward_context", lambda m: _count_vllm(m, probe))
    else:
        after_import("sglang.srt.model_executor.runner.decode_cuda_graph_runner", lambda m: _count_sglang(m, probe))
        # the scheduler builds its model runner at start: it samples from then on, in every
        # mode (eager counts no decode batch: it has no graph runner to ask)
        after_import(
            "sglang.srt.model_executor.model_runner",
            lambda m: _tracked(m.ModelRunner, "__init__", lambda _runner: probe.start()),
        )


def _count_vllm(module: Any, probe: _Probe) -> None:
    """Each forward pass vLLM runs, by its graph mode (NONE: eager) and batch descriptor's
    token count, from the forward context it sets."""
    original = module.set_forward_context

    def set_forward_context(*args: Any, **kwargs: Any) -> Any:
        mode = kwargs.get("cudagraph_runtime_mode")
        descriptor = kwargs.get("batch_descriptor")
        tokens = descriptor.num_tokens if descriptor is not None else kwargs.get("num_tokens")
        if mode is not None and tokens is not None:
            probe.forward(mode.name, int(tokens))
        return original(*args, **kwargs)

    module.set_forward_context = set_forward_context


def _count_sglang(module: Any, probe: _Probe) -> None:
    """Each decode batch SGLang asks its graph runner about: replayed, or eager (a fallback)."""
    cls = module.DecodeCudaGraphRunner
    original = cls.can_run_graph

    def can_run_graph(self: Any, forward_batch: Any) -> bool:
        ok = bool(original(self, forward_batch))
        probe.forward("graph" if ok else "eager", int(forward_batch.batch_size))
        return ok

    cls.can_run_graph = can_run_graph
