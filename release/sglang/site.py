"""What the SGLang environment runs at interpreter start (``sglang_site.pth``), for
release/sglang/generate.py only: with ``NPUGRAPH_SGLANG_COUNTS=DIR`` set, the process that
updates graphs (SGLang's scheduler) times each per-step update, torch_npu's
``NPUGraph.update`` (SGLang's own path) and npugraph's (``ReplayUpdater._write``), counts
npugraph's steps, and rewrites ``DIR/counts-<pid>.json`` after each (the scheduler is killed
at shutdown: nothing written at exit would survive).  Unset, it does nothing.
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
        cls.update = timed(
            cls, "update", counts["torch_npu_update_seconds"], counts["torch_npu_update_device_calls"], write
        )

    def updater(module: Any) -> None:
        cls = module.ReplayUpdater
        cls._write = timed(
            cls, "_write", counts["npugraph_update_seconds"], counts["npugraph_update_device_calls"], write
        )

    def runtime(module: Any) -> None:
        step = module.Runtime.step

        def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
            counts["npugraph_steps"] += 1
            return step(self, *args, **kwargs)

        module.Runtime.step = counted

    after_import("npugraph.sim.surfaces.graphs", graphs)
    after_import("npugraph.replay.updater", updater)
    after_import("npugraph.runtime", runtime)


if _DIR:
    _install(_DIR)
