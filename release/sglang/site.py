"""What the SGLang environment runs at interpreter start (``sglang_site.pth``), for
release/sglang/generate.py only: with ``NPUGRAPH_SGLANG_COUNTS=DIR`` set, the process that
replays graphs (SGLang's scheduler) times

* each decode step's graph call, ``NPUCudaGraphBackend.replay_with_input_update`` as SGLang
  calls it (npugraph's hook when the plugin is on): the update and the replay as each path
  runs them, the same call in both graph modes;
* each per-step update alone: torch_npu's ``NPUGraph.update`` (SGLang's own path, on its
  update thread, beside the replay) and npugraph's (``ReplayUpdater._write``);

each less the simulated device's time, counts npugraph's steps, and rewrites
``DIR/counts-<pid>.json`` after each step's call (the scheduler is killed at shutdown:
nothing written at exit would survive).  Unset, it does nothing.
"""

from __future__ import annotations

import collections
import json
import os
import sys
from pathlib import Path
from typing import Any

_DIR = os.environ.get("NPUGRAPH_SGLANG_COUNTS")


def _install(folder: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # release/: timing.py
    from timing import timed

    from npugraph_hook import after_import

    counts: dict[str, Any] = {
        "graph_step_seconds": [],
        "graph_step_wall_seconds": [],
        "graph_step_device_calls": collections.Counter(),
        "torch_npu_update_seconds": [],
        "npugraph_update_seconds": [],
        "npugraph_steps": 0,
        "torch_npu_update_device_calls": collections.Counter(),
        "npugraph_update_device_calls": collections.Counter(),
    }
    path = Path(folder) / f"counts-{os.getpid()}.json"

    def write() -> None:
        path.write_text(
            json.dumps({k: dict(v) if isinstance(v, collections.Counter) else v for k, v in counts.items()})
        )

    def graphs(module: Any) -> None:  # the simulator's torch_npu.npu.graphs: NPUGraph.update
        cls = module.NPUGraph
        cls.update = timed(cls, "update", counts["torch_npu_update_seconds"], counts["torch_npu_update_device_calls"])

    def updater(module: Any) -> None:
        cls = module.ReplayUpdater
        cls._write = timed(cls, "_write", counts["npugraph_update_seconds"], counts["npugraph_update_device_calls"])

    def runtime(module: Any) -> None:
        step = module.Runtime.step

        def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
            counts["npugraph_steps"] += 1
            return step(self, *args, **kwargs)

        module.Runtime.step = counted

    def backend(module: Any) -> None:
        # timed per instance, at construction: SGLang's plugins hooked the class by then, so
        # the call timed is the one SGLang makes (npugraph's hook when the plugin is on); the
        # counts are written after it, outside every timed call (the updates are inside it)
        cls = module.NPUCudaGraphBackend
        init = cls.__init__

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            self.replay_with_input_update = timed(
                self,
                "replay_with_input_update",
                counts["graph_step_seconds"],
                counts["graph_step_device_calls"],
                write,
                counts["graph_step_wall_seconds"],
            )

        cls.__init__ = __init__

    after_import("sglang.srt.hardware_backend.npu.graph_runner.npu_cudagraph_backend", backend)
    after_import("npugraph.sim.surfaces.graphs", graphs)
    after_import("npugraph.replay.updater", updater)
    after_import("npugraph.runtime", runtime)


if _DIR:
    _install(_DIR)
