"""What the SGLang environment runs at interpreter start (``sglang_site.pth``), for
release/sglang/generate.py only: with ``NPUGRAPH_SGLANG_COUNTS=DIR`` set, the process that
replays graphs (SGLang's scheduler) times

* each decode step's graph call, ``NPUCudaGraphBackend.replay_with_input_update`` as SGLang
  calls it (npugraph's hook when the plugin is on): the update and the replay as each path
  runs them, the same call in both graph modes;
* each per-step update alone: torch_npu's ``NPUGraph.update`` (SGLang's own path, on its
  update thread, beside the replay) and npugraph's (``ReplayUpdater._write``);

each less the simulated device's time, counts npugraph's steps, and rewrites
``DIR/counts-<pid>.json`` after each step's call (release/engine_counts.py).  Unset, it does nothing.

With ``NPUGRAPH_SOAK_SAMPLES=DIR`` (make soak), the scheduler samples its memory, graphs,
events and decode batches into ``DIR`` (release/soak_probe.py).  With
``NPUGRAPH_SGLANG_FAULT=host-copy`` (release/sglang/test_faults.py), each Llama MLP reads
a value to the host while a graph is being captured: a model whose layer copies to the host
under capture (on a device, ``rtMemcpy`` fails with 107030).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

_DIR = os.environ.get("NPUGRAPH_SGLANG_COUNTS")


def _install(folder: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # release/: engine_counts.py
    from engine_counts import EngineCounts

    from npusim_hook import after_import

    counts = EngineCounts(folder)

    def graphs(module: Any) -> None:  # the simulator's torch_npu.npu.graphs: NPUGraph.update
        cls = module.NPUGraph
        cls.update = counts.time(cls, "update", "torch_npu_update", write=False)

    def backend(module: Any) -> None:
        # timed per instance, at construction: SGLang's plugins hooked the class by then, so
        # the call timed is the one SGLang makes (npugraph's hook when the plugin is on); the
        # counts are written after it, outside every timed call (the updates are inside it)
        cls = module.NPUCudaGraphBackend
        init = cls.__init__

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            self.replay_with_input_update = counts.time(
                self, "replay_with_input_update", "graph_step", walls="graph_step_wall_seconds"
            )

        cls.__init__ = __init__

    after_import("sglang.srt.hardware_backend.npu.graph_runner.npu_cudagraph_backend", backend)
    after_import("npusim.surfaces.graphs", graphs)
    counts.npugraph(after_import, write_each_step=False)


def _host_copy_in_every_mlp(llama: Any) -> None:
    import torch

    forward = llama.LlamaMLP.forward

    def peeking(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if torch.npu.is_current_stream_capturing():
            x.flatten()[0].item()  # a read to the host of a value only the replay will have
        return forward(self, x, *args, **kwargs)

    llama.LlamaMLP.forward = peeking


def _start() -> None:
    from npusim_hook import after_import

    if _DIR:
        _install(_DIR)
    if os.environ.get("NPUGRAPH_SOAK_SAMPLES"):  # make soak (release/soak.py)
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # release/: soak_probe.py
        from soak_probe import install

        install(os.environ["NPUGRAPH_SOAK_SAMPLES"], after_import, "sglang")
    if os.environ.get("NPUGRAPH_SGLANG_FAULT") == "host-copy":
        after_import("sglang.srt.models.llama", _host_copy_in_every_mlp)


# Once per process: site runs a venv's .pth files twice at start (its venv() and then its
# main() each add site-packages), and a second run would hook everything twice.
if not getattr(sys, "_npugraph_release_site", False):
    sys._npugraph_release_site = True  # type: ignore[attr-defined]
    _start()
