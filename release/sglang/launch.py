"""SGLang's server as the server checks start it (release/sglang/test_server.py,
release/sglang/test_faults.py): the check's tiny Llama, and ``python -m
sglang.launch_server`` on it with npugraph's plugin, as a user starts it."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from generate import write_model  # this folder's
from serving import SGLANG_READY, Served, started  # release/'s

__all__ = ["START_S", "check_model", "launch"]

START_S = 900  # the simulator starts SGLang's server, and captures its graphs, in about a minute


def check_model(scratch: Path) -> Path:
    """The check's Llama: the one release/sglang/run.sh's generation wrote (its folder in
    ``NPUGRAPH_GENERATE_RESULTS``), else one written into ``scratch``."""
    given = os.environ.get("NPUGRAPH_GENERATE_RESULTS")
    if given and (Path(given) / "llama" / "config.json").is_file():
        return Path(given) / "llama"
    write_model(scratch / "llama", "llama")
    return scratch / "llama"


def launch(model_dir: Path, log: Path, *flags: str, **env: str) -> contextlib.AbstractContextManager[Served]:
    """SGLang's server on ``model_dir`` with npugraph's plugin (``flags``: its own, ``env``: more
    of the environment), ready once SGLang says so; its scheduler samples itself beside
    ``log`` (release/soak_probe.py)."""
    full = {
        **os.environ,
        "NPUGRAPH_ENABLE": "1",
        "NPUGRAPH_SIM_TORCH_NPU": "1",
        "NPUGRAPH_SOAK_SAMPLES": str(log.parent),
        **env,
    }
    args = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir), "--device", "npu", *flags]
    return started(args, log, full, START_S, ready=SGLANG_READY)
