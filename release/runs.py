"""How each real generation runs its modes (release/generate.py, release/sglang/generate.py):
each in a process of its own, its output kept beside its result."""

from __future__ import annotations

import subprocess
from pathlib import Path

__all__ = ["clear_results", "result_path", "results", "run_logged"]


def clear_results(out_dir: Path) -> None:
    """Make ``out_dir`` and drop its results: one of an earlier call must not count as this one's."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("*.json"):
        stale.unlink()


def run_logged(args: list[str], out: Path, env: dict[str, str], what: str) -> None:
    """Run ``args`` in ``out``'s folder, its output into ``out`` with suffix ``.log``; a
    failure raises ``RuntimeError`` naming ``what`` and the log (not an assert: python -O
    would drop it, and the run would pass)."""
    log = out.with_suffix(".log")
    done = subprocess.run(args, capture_output=True, text=True, env=env, cwd=out.parent, timeout=900)
    log.write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"generate.py {what} failed (log: {log}):\n{done.stderr[-6000:]}")


def result_path(out_dir: Path, model: str, mode: str, run: int = 1) -> Path:
    """Where run ``run`` (from 1) of ``model`` in ``mode`` writes its result:
    ``llama.npugraph.json``, ``llama.npugraph.run2.json``, ..."""
    return out_dir / (f"{model}.{mode}.json" if run == 1 else f"{model}.{mode}.run{run}.json")


def results(out_dir: Path, model: str, mode: str) -> list[Path]:
    """Every run's result of ``model`` in ``mode`` in ``out_dir``, in run order (up to a gap)."""
    found = []
    while (path := result_path(out_dir, model, mode, len(found) + 1)).is_file():
        found.append(path)
    return found
