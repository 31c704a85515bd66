"""What a real generation measures inside the engine's own process (release/ascend_site.py for
vLLM, release/sglang/site.py for SGLang): each engine runs its model in a process of its own
(vLLM's EngineCore, SGLang's scheduler), so the counts are kept there, by hooks installed at
interpreter start, and written to ``DIR/counts-<pid>.json`` after each timed call (the engine
process is killed at shutdown: nothing written at exit would survive).  The generation script
reads them back with :func:`read`.
"""

from __future__ import annotations

import collections
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from timing import timed  # this folder's

__all__ = ["EngineCounts", "read"]


class EngineCounts:
    """One engine process's counts: lists of seconds and counters of device calls, by name."""

    def __init__(self, folder: str) -> None:
        self.values: dict[str, Any] = {
            "npugraph_update_seconds": [],
            "npugraph_update_device_calls": collections.Counter(),
            "npugraph_steps": 0,
            "npugraph_update_free_steps": 0,  # of them, steps of an update-free graph (its key has a width)
            "npugraph_update_tokens": [],
            "npugraph_capture_report": [],
        }
        self.folder = Path(folder)

    def write(self) -> None:
        if "ray_node" not in self.values:  # once: a Ray worker is Ray's from its start
            self.values["ray_node"] = _ray_node()
        # the pid at the write: vLLM forks its engine process from the one that installed this
        values = {k: dict(v) if isinstance(v, collections.Counter) else v for k, v in self.values.items()}
        (self.folder / f"counts-{os.getpid()}.json").write_text(json.dumps(values))

    def time(self, owner: Any, name: str, key: str, walls: str | None = None, write: bool = True) -> Any:
        """``owner.name`` timed into ``key_seconds`` (and its device calls into
        ``key_device_calls``, the simulator's own seconds in it into ``key_own``, its whole
        wall times into ``walls``), the counts written after each call unless ``write`` is
        false."""
        seconds = self.values.setdefault(f"{key}_seconds", [])
        calls = self.values.setdefault(f"{key}_device_calls", collections.Counter())
        own = self.values.setdefault(f"{key}_own", [])
        wall = self.values.setdefault(walls, []) if walls else None
        return timed(owner, name, seconds, calls, self.write if write else None, wall, own)

    def npugraph(self, after_import: Callable[[str, Callable[[Any], None]], None], write_each_step: bool) -> None:
        """npugraph's side, wherever it runs: each per-step update (``ReplayUpdater._write``)
        timed, each step counted, and each runtime's capture report at its first step; the
        counts written after each step if ``write_each_step`` (not where the step runs inside
        a call the caller times: the write would land inside it)."""

        def updater(module: Any) -> None:
            cls = module.ReplayUpdater
            cls._write = self.time(cls, "_write", "npugraph_update", "npugraph_update_walls", write=False)

        def runtime(module: Any) -> None:
            # every step goes through step_graph (Runtime.step looks the graph up and calls it;
            # vLLM's wrapper calls it with the graph it found)
            step = module.Runtime.step_graph
            from npugraph.errors import BatchRefused as refused

            seen: list[Any] = []

            def counted(runtime: Any, entry: Any, *args: Any, **kwargs: Any) -> Any:
                if not any(r is runtime for r in seen):
                    seen.append(runtime)
                    self.values["npugraph_capture_report"].append(runtime.capture_report())
                try:
                    out = step(runtime, entry, *args, **kwargs)
                except refused:
                    raise  # not a graph step: its engine runs the batch eagerly
                except BaseException:
                    self._counted_step(entry, write_each_step)  # a failed step counts, as it did
                    raise
                self._counted_step(entry, write_each_step)
                return out

            module.Runtime.step_graph = counted

        after_import("npugraph.replay.updater", updater)
        after_import("npugraph.runtime", runtime)

    def _counted_step(self, entry: Any, write: bool) -> None:
        """One of npugraph's steps counted, with its padded size (vLLM's batch descriptor)
        beside its update's seconds."""
        self.values["npugraph_steps"] += 1
        key = entry.key
        if hasattr(key, "width"):  # npugraph's WidthKey: the size's own key inside
            self.values["npugraph_update_free_steps"] += 1
            key = key.key
        self.values["npugraph_update_tokens"].append(int(getattr(key, "num_tokens", 0) or 0))
        if write:
            self.write()


def _ray_node() -> str:
    """The id of the Ray node this process runs on (vLLM's Ray executor: a rank's actor), or ""."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return ""
    return str(ray.get_runtime_context().get_node_id())


def read(folder: Path, processes: int = 1) -> list[dict[str, Any]]:
    """The counts of each model process that wrote any in ``folder`` (none if none did): the
    engine's, or each rank's worker under tensor parallelism.  More than ``processes`` is an
    error (the generation is one engine, with one model process per rank)."""
    found = sorted(folder.glob("counts-*.json"))
    if len(found) > processes:
        raise RuntimeError(
            f"{len(found)} model processes counted in {folder}, not {processes}: {[p.name for p in found]}"
        )
    return [json.loads(p.read_text()) for p in found]
