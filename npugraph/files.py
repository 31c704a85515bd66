"""Files npugraph writes and reads: never through a symlink, never unbounded."""

from __future__ import annotations

import json
import os
import stat
from typing import Any

from npugraph.errors import NpuGraphError

__all__ = ["FileError", "MAX_JSON_BYTES", "check_writable", "write_bytes", "write_text", "read_json"]

MAX_JSON_BYTES = 64 * 2**20  # a manifest of thousands of graphs is a few MiB


class FileError(NpuGraphError, OSError):
    """A file could not be written or read safely (or is not what it should be)."""


def check_writable(path: str) -> str:
    """Refuse, before any work, an output path that is a symlink, a folder, something other
    than a regular file, in a missing folder, or not writable."""
    if os.path.islink(path):
        raise FileError(f"{path}: is a symbolic link; npugraph does not write through links")
    if os.path.isdir(path):
        raise FileError(f"{path}: is a directory; give a file path")
    if os.path.exists(path):
        if not os.path.isfile(path):
            raise FileError(f"{path}: is not a regular file (a device or a pipe?); give a file path")
        if not os.access(path, os.W_OK):
            raise FileError(f"{path}: exists and is not writable")
        if os.path.realpath(path).startswith(("/proc/", "/sys/")):
            raise FileError(f"{path}: is a kernel file (/proc, /sys), not one to write; give a file path")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise FileError(f"{path}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise FileError(f"{path}: folder {parent} is not writable")
    return path


def write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` (created or truncated), refusing to follow a symlink."""
    write_bytes(path, text.encode())


def write_bytes(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` (created or truncated), refusing to follow a symlink."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        raise FileError(f"{path}: cannot write: {exc.strerror or exc}") from exc
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except OSError as exc:
        raise FileError(f"{path}: cannot write: {exc.strerror or exc}") from exc


def read_json(path: str, what: str, *, limit: int = MAX_JSON_BYTES) -> Any:
    """Parse a JSON file of at most ``limit`` bytes; every failure is a :class:`FileError`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise FileError(f"cannot read {what} {path!r}: {exc.strerror or exc}") from exc
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        raise FileError(f"cannot read {what} {path!r}: it is {kind}; give the {what}'s file path")
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise FileError(f"{what} {path!r} is larger than {limit} bytes; refusing to read it")
    try:
        return json.loads(data)
    except RecursionError as exc:
        raise FileError(f"{what} {path!r} is nested too deeply to be a {what}") from exc
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise FileError(f"{what} {path!r} is not valid JSON: {exc}") from exc
