"""What an engine process says after npugraph captured its graphs: one INFO line, and the
capture manifest at a path the line gives (shared by the vLLM and SGLang integrations)."""

from __future__ import annotations

import logging
import os
import tempfile

from npugraph.runtime import Runtime

__all__ = ["ENV_REPORT_DIR", "report_path", "say_captured"]

ENV_REPORT_DIR = "NPUGRAPH_REPORT_DIR"


def report_path(pid: int | None = None) -> str:
    """Where an engine process writes its capture report: ``$NPUGRAPH_REPORT_DIR`` (default:
    the temporary directory) / ``npugraph-capture-<pid>.json``."""
    folder = os.environ.get(ENV_REPORT_DIR) or tempfile.gettempdir()
    return os.path.join(folder, f"npugraph-capture-{os.getpid() if pid is None else pid}.json")


def say_captured(runtime: Runtime, logger: logging.Logger, namespace: str | None = None) -> str:
    """Write ``runtime``'s capture manifest to :func:`report_path` and log, at INFO on
    ``logger``, one line saying that npugraph captured in this process and what (sizes,
    kernel per size, ExternalEvents, graph memory); returns the line.  A report that cannot
    be written is said in the line, and serving goes on."""
    path = report_path()
    try:
        runtime.save_manifest(path)
        where = f"capture report: {path}"
    except Exception as exc:  # the report is for debugging: never a reason to stop serving
        where = f"capture report not written ({type(exc).__name__}: {exc})"
    line = f"npugraph: active in this engine process (pid {os.getpid()}): {runtime.capture_report(namespace)}; {where}"
    logger.info(line)
    return line
