"""What every engine integration (vLLM, SGLang) shares: the ``NPUGRAPH_*`` settings, checked,
the runtime they make, and what an engine process says after npugraph captured its graphs
(one INFO line, and the capture manifest at a path the line gives)."""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from npugraph.capture import CapturedGraph, WidthKey
from npugraph.errors import CaptureFailed, ConfigError
from npugraph.policy import default_widths
from npugraph.runtime import Runtime

__all__ = [
    "ENV_DEVICE",
    "ENV_DEVICE_LENGTHS",
    "ENV_ENABLE",
    "ENV_EVENT_GROUP",
    "ENV_REPORT_DIR",
    "ENV_UPDATE_FREE",
    "check_settings",
    "enabled",
    "env_device",
    "env_device_lengths",
    "env_event_group",
    "env_update_free",
    "capture_widths",
    "widths_for",
    "report_folder",
    "report_path",
    "restore",
    "runtime_from_env",
    "say_captured",
    "unwrap_method",
    "vocabulary_refusal",
    "wrap_method",
]

ENV_ENABLE = "NPUGRAPH_ENABLE"
ENV_DEVICE = "NPUGRAPH_DEVICE"
ENV_EVENT_GROUP = "NPUGRAPH_EVENT_GROUP"
ENV_DEVICE_LENGTHS = "NPUGRAPH_DEVICE_LENGTHS"
ENV_REPORT_DIR = "NPUGRAPH_REPORT_DIR"
ENV_UPDATE_FREE = "NPUGRAPH_UPDATE_FREE"


def enabled() -> bool:
    """``NPUGRAPH_ENABLE``: on for ``1``, ``true``, ``yes`` or ``on`` (any case)."""
    return os.environ.get(ENV_ENABLE, "").strip().lower() in ("1", "true", "yes", "on")


def env_device() -> str | None:
    """``NPUGRAPH_DEVICE``, checked (any case): ``npu``, ``npu:N``, ``sim`` or unset."""
    value = os.environ.get(ENV_DEVICE, "").strip().lower()
    if not value:
        return None
    name, _, index = value.partition(":")
    if name not in ("npu", "sim") or (index and not index.isdigit()):
        raise ConfigError(
            f"{ENV_DEVICE}={os.environ.get(ENV_DEVICE)!r} is not a device npugraph knows; use 'npu', 'npu:N' "
            "or 'sim' (or unset it)"
        )
    return value


def env_event_group() -> int | None:
    """``NPUGRAPH_EVENT_GROUP``: tasks per ExternalEvent (unset: chosen per namespace at
    capture, :data:`npugraph.capture.AUTO_EVENT_GROUP`; 1: one per layer)."""
    value = os.environ.get(ENV_EVENT_GROUP, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(
            f"{ENV_EVENT_GROUP}={value!r} is not a group size; use an integer >= 1 (layers per "
            "ExternalEvent; 1 records one per layer) or unset it (chosen per namespace at capture)"
        )
    return int(value)


def env_device_lengths() -> bool:
    """``NPUGRAPH_DEVICE_LENGTHS``: ``0`` keeps FIA's lengths on the host, updated per layer
    (default ``1``: the tiling-sink kernel where the device has it)."""
    value = os.environ.get(ENV_DEVICE_LENGTHS, "").strip().lower()
    if value in ("", "1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{ENV_DEVICE_LENGTHS}={value!r} is not a switch; use 1 (the default) or 0, or unset it")


def env_update_free() -> tuple[int, ...] | None:
    """``NPUGRAPH_UPDATE_FREE``: capture each decode size's update-free graphs too (lengths
    frozen to a width, masked on the device; each step runs the narrowest that holds it, else
    the updated graph): ``1`` (or ``auto``) at the default ladder (powers of two from the block
    size to max_model_len), or the widths, comma-separated; unset or ``0``: none (``None``;
    ``()`` is the default ladder)."""
    raw = os.environ.get(ENV_UPDATE_FREE, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return None
    if raw in ("1", "true", "yes", "on", "auto"):
        return ()
    parts = [p.strip() for p in raw.split(",")]
    if not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ConfigError(
            f"{ENV_UPDATE_FREE}={os.environ.get(ENV_UPDATE_FREE)!r} is neither a switch nor widths; use 1 "
            "(the default ladder), widths in keys such as 1024,4096, or 0 (or unset it)"
        )
    return tuple(sorted({int(p) for p in parts}))


def widths_for(runtime: Runtime, entry: CapturedGraph, asked: tuple[int, ...] | None) -> tuple[int, ...]:
    """The widths an engine's update-free graphs take (``NPUGRAPH_UPDATE_FREE``'s, ``()``: the
    default ladder), whole blocks of the captured graph's KV cache within max_model_len."""
    block = entry.block_size or 0
    if asked is None or not block:
        return ()
    ladder = asked or default_widths(block, runtime.max_model_len)
    return tuple(w for w in ladder if w % block == 0 and w <= runtime.max_model_len)


def capture_widths(
    runtime: Runtime,
    widths: tuple[int, ...],
    fn: Callable[..., Any],
    *args: Any,
    key: Any,
    namespace: str,
    log: logging.Logger,
    **kwargs: Any,
) -> dict[int, Any] | None:
    """Capture ``fn`` for ``key`` update-free at each of ``widths``, widest first, as the
    engine captured its updated graph; returns each width's outputs.  Where the mode cannot
    run the model (MLA, sliding windows, speculative steps), what it captured is freed,
    ``log`` (the engine's logger) warns why, and ``None`` says to capture no more: the key
    keeps its updated graph alone."""
    done: dict[int, Any] = {}
    try:
        for w in sorted(widths, reverse=True):
            done[w] = runtime.capture(fn, *args, key=key, namespace=namespace, width=w, **kwargs)
    except CaptureFailed as exc:
        for w in done:
            runtime.reset(namespace, WidthKey(key, w))
        log.warning("npugraph: no update-free graphs in %s (updated per step instead): %s", namespace, exc)
        return None
    return done


def check_settings() -> str | None:
    """Check every ``NPUGRAPH_*`` setting (a plugin does, before it touches its engine: a bad
    one is :class:`~npugraph.errors.ConfigError`); returns ``NPUGRAPH_DEVICE``'s value."""
    device = env_device()
    env_event_group()
    env_device_lengths()
    env_update_free()
    return device


def runtime_from_env(max_model_len: int, default_device: str) -> Runtime:
    """An engine's runtime, as the settings ask: ``NPUGRAPH_DEVICE`` (else ``default_device``),
    ``NPUGRAPH_EVENT_GROUP``, ``NPUGRAPH_DEVICE_LENGTHS``; a step that fails writes its
    post-mortem beside the capture report (:func:`report_folder`), one file per process and
    failure, its path in the error's message."""
    return Runtime(
        env_device() or default_device,
        max_model_len=max_model_len,
        event_group=env_event_group(),
        device_lengths=env_device_lengths(),
        postmortem_dir=report_folder(),
    )


def report_folder() -> str:
    """Where an engine process writes its capture report and post-mortems:
    ``$NPUGRAPH_REPORT_DIR``, default the temporary directory."""
    return os.environ.get(ENV_REPORT_DIR) or tempfile.gettempdir()


def report_path(pid: int | None = None) -> str:
    """Where an engine process writes its capture report:
    :func:`report_folder` / ``npugraph-capture-<pid>.json``."""
    return os.path.join(report_folder(), f"npugraph-capture-{os.getpid() if pid is None else pid}.json")


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


def restore(obj: Any, name: str) -> None:
    """Put back ``obj.<name>`` as it was before npugraph replaced it (kept beside it as
    ``_npugraph_original_<name>``); nothing if ``obj`` is None or was not patched."""
    marker = f"_npugraph_original_{name}"
    if obj is not None and hasattr(obj, marker):
        setattr(obj, name, getattr(obj, marker))
        delattr(obj, marker)


def wrap_method(owner: tuple[str, str], name: str, wrap: Callable[[Any], Any]) -> bool | None:
    """Replace method ``name`` of class ``owner`` (its module's name, its own) by
    ``wrap(original)``, the original kept beside it for :func:`restore`; a class wrapped
    already is left as it is.  Returns ``None`` if the module does not import, ``False`` if it
    has no such class or method (nothing replaced), ``True`` otherwise."""
    try:
        module = __import__(owner[0], fromlist=["_"])
    except Exception:  # the engine without that module (or broken): nothing to wrap
        return None
    cls = getattr(module, owner[1], None)
    if cls is None or not hasattr(cls, name):
        return False
    if not hasattr(cls, f"_npugraph_original_{name}"):
        original = getattr(cls, name)
        setattr(cls, f"_npugraph_original_{name}", original)
        setattr(cls, name, wrap(original))
    return True


def unwrap_method(owner: tuple[str, str], name: str) -> None:
    """Undo :func:`wrap_method` (nothing if the module was never imported or not wrapped)."""
    restore(getattr(sys.modules.get(owner[0]), owner[1], None), name)


def vocabulary_refusal(ids: Any, vocab: Any, engine: str, where: str) -> str | None:
    """Why a prompt of token ``ids`` cannot reach ``engine``'s model of ``vocab`` ids (one
    outside ``[0, vocab)``: the embedding lookup fails on it, and on a device faults the NPU),
    or ``None`` if it can, or if there are no ids or no vocabulary to check them against.
    ``where`` says what would fail: the engine's own checks let the id through."""
    if not isinstance(ids, list) or not ids or not isinstance(vocab, int):
        return None
    try:
        lo, hi = min(ids), max(ids)
    except TypeError:
        return None  # not a flat list of ids: the engine's own validation speaks for it
    if lo >= 0 and hi < vocab:
        return None
    bad = lo if lo < 0 else hi
    return (
        f"The prompt holds token id {bad} at position {ids.index(bad)}, outside the model's vocabulary "
        f"[0, {vocab}); send token ids the model's tokenizer makes (refused by npugraph's {engine} plugin: "
        f"{where} would fail on it)"
    )
