"""Post-mortem dumps: the manifest and recent updates, written when a step fails."""

from __future__ import annotations

import json
import os

from npugraph.capture import CapturedGraph, CaptureManager
from npugraph.dump.manifest import build_manifest
from npugraph.dump.trace import UpdateTrace
from npugraph.errors import NpuGraphError
from npugraph.replay import ReplayUpdater

__all__ = ["MAX_POSTMORTEMS", "PostMortem"]

MAX_POSTMORTEMS = 32  # per runtime: a failing loop must not fill the disk


class PostMortem:
    """Write the manifest and update trace to ``folder`` when a step fails.

    Files are created exclusively (``O_CREAT | O_EXCL | O_NOFOLLOW``, mode 0600) in a
    folder created with mode 0700, at most :data:`MAX_POSTMORTEMS` per runtime; a
    failure while writing one is noted in the error's message and never replaces it.
    """

    def __init__(self, manager: CaptureManager, updater: ReplayUpdater, trace: UpdateTrace, folder: str | None) -> None:
        self.manager = manager
        self.updater = updater
        self.trace = trace
        self.folder = folder
        self._count = 0

    def on_error(self, err: NpuGraphError, entry: CapturedGraph | None) -> None:
        if self.folder is None or err.postmortem is not None:
            return
        if self._count >= MAX_POSTMORTEMS:
            return
        self._count += 1
        try:
            doc = build_manifest(self.manager, self.updater, self.trace)
            doc["error"] = {
                "type": type(err).__name__,
                "message": str(err),
                "namespace": entry.namespace if entry else None,
                "key": repr(entry.key) if entry else None,
            }
            data = json.dumps(doc, indent=1, default=repr).encode()
            os.makedirs(self.folder, mode=0o700, exist_ok=True)
            path = os.path.join(self.folder, f"npugraph-postmortem-{os.getpid()}-{self._count}.json")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        except Exception as exc:  # the user's error matters more than its post-mortem
            note = f" [post-mortem not written: {type(exc).__name__}: {exc}]"
        else:
            err.postmortem = path
            note = f" [post-mortem written to {path}]"
        if err.args:
            err.args = (f"{err.args[0]}{note}", *err.args[1:])
