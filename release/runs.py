"""How each real generation runs its modes (release/generate.py, release/sglang/generate.py):
each in a process of its own, its output kept beside its result."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

__all__ = [
    "SCOPES",
    "TIMED",
    "check_scope",
    "clear_results",
    "counts_folder",
    "engine_env",
    "order",
    "ascend_source",
    "needs_custom_ops",
    "result_path",
    "results",
    "run_logged",
    "run_to_the_end",
    "side_by_side",
    "timed",
    "two_at_a_time",
]

# the models whose graph steps release/update_cost.py times (the Qwen3's are few: its graph
# steps run a Triton kernel in the interpreter, and it serves fewer tokens); "deep" (32
# layers, make release-check's full scope only) is the side-by-side benchmark
TIMED = ("llama", "ngram", "deep")

# How much a release check runs (CHECK_SCOPE): "full" (make release-check, make sglang-check)
# every model and repeat; "ci" (.ci/run) each kind of run once, inside CI's time limit: the
# combinations and repeats it leaves out are named where each check chooses its runs; "compat"
# (make compat, release/compat.sh) what every release is held to: its own tests of the graph
# path, the Llama and the Qwen3 in each mode, vLLM's default mode and npugraph's INFO line
SCOPES = ("full", "ci", "compat")


def check_scope() -> str:
    """``CHECK_SCOPE`` (default ``full``); any other value stops the check in one line."""
    scope = os.environ.get("CHECK_SCOPE", "full")
    if scope not in SCOPES:
        raise SystemExit(f"CHECK_SCOPE must be one of {', '.join(SCOPES)}, not {scope!r}")
    return scope


def ascend_source(path: str) -> str | None:
    """The text of this environment's vllm-ascend file ``path`` (``ops/layernorm.py``), or None
    where it has no such file or no vllm-ascend: what a release does, read off its own sources
    rather than a table of versions.  Finds the package without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("vllm_ascend")
    if spec is None or spec.origin is None:
        return None
    file = Path(spec.origin).parent / path
    return file.read_text() if file.is_file() else None


def needs_custom_ops() -> bool:
    """Whether this release's layers import ``vllm_ascend_C`` with no fallback: its RMSNorm with a
    residual does from 0.28.0rc1 on (``ops/layernorm.py``)."""
    return "import vllm_ascend.vllm_ascend_C" in (ascend_source("ops/layernorm.py") or "")


def timed(models: Iterable[str]) -> tuple[str, ...]:
    """Of ``models`` (those a generation ran), the ones whose graph modes it times, each alone
    on the machine: ``TIMED``'s, but at CI's scope, where the 32-layer benchmark runs, that
    one alone (the two-layer models' graph modes then share the machine: CI's time)."""
    given = set(models)
    ran = tuple(m for m in TIMED if m in given)
    return ("deep",) if check_scope() == "ci" and "deep" in ran else ran


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
    t0 = time.monotonic()
    done = subprocess.run(args, capture_output=True, text=True, env=env, cwd=out.parent, timeout=900)
    log.write_text(done.stdout + done.stderr)
    # one line per engine as it ends: where a check's time went is in CI's log, even a cut
    # one, and in .ci/run's list at its end ($CHECK_TIMES)
    line = f"    {what}: {time.monotonic() - t0:.0f} s"
    print(line, file=sys.stderr, flush=True)
    if times := os.environ.get("CHECK_TIMES"):
        with open(times, "a") as f:
            print(line, file=f)
    if done.returncode != 0:
        raise RuntimeError(f"generate.py {what} failed (log: {log}):\n{done.stderr[-6000:]}")


def result_path(out_dir: Path, model: str, mode: str, run: int = 1) -> Path:
    """Where run ``run`` (from 1) of ``model`` in ``mode`` writes its result:
    ``llama.npugraph.json``, ``llama.npugraph.run2.json``, ..."""
    return out_dir / (f"{model}.{mode}.json" if run == 1 else f"{model}.{mode}.run{run}.json")


def results(out_dir: Path, model: str, mode: str) -> list[Path]:
    """Every run's result of ``model`` in ``mode`` in ``out_dir``, in run order (up to a gap)."""
    found: list[Path] = []
    while (path := result_path(out_dir, model, mode, len(found) + 1)).is_file():
        found.append(path)
    return found


def order(
    models: tuple[str, ...],
    graph_modes: tuple[str, ...],
    runs: int,
    repeated: str,
    *,
    eager: Iterable[str] | None = None,
) -> list[tuple[str, str, int]]:
    """The (model, mode, run) a generation runs, in order: eager once per model of ``eager``
    (default: every one), the graph modes once for each other model, then ``runs`` times, in
    turn, for ``repeated`` (the update cost's verdict takes every run; a drift of the machine
    falls on both modes alike)."""
    if runs < 1:
        raise ValueError(f"runs must be at least 1, not {runs}")
    eagerly = set(models if eager is None else eager)
    plan = [(model, "eager", 1) for model in models if model in eagerly]
    plan += [(model, mode, 1) for model in models if model != repeated for mode in graph_modes]
    plan += [(repeated, mode, run) for run in range(1, runs + 1) for mode in graph_modes]
    return plan


def side_by_side(
    plan: list[tuple[str, str, int]], timed: tuple[str, ...]
) -> tuple[list[tuple[str, str, int]], list[tuple[str, str, int]]]:
    """Split ``plan`` into the runs that may share the machine, two at a time, and the runs
    that must have it alone, in plan order: the graph modes of the ``timed`` models (their
    update cost is measured in host time, and a neighbour on the other core would be in it).

    The shared runs come as every model's eager run, then the first graph mode of each
    model, then the second: a model's two graph modes, which compile the same graph into
    one compile cache, are not neighbours."""
    alone = [r for r in plan if r[0] in timed and r[1] != "eager"]
    shared = [r for r in plan if r not in alone]
    modes = list(dict.fromkeys(mode for _, mode, _ in shared))
    return sorted(shared, key=lambda r: modes.index(r[1])), alone


def counts_folder(out: Path) -> Path:
    """The folder beside result ``out`` where its engine process writes its counts, emptied."""
    folder = out.with_suffix(".counts")
    folder.mkdir(exist_ok=True)
    for stale in folder.glob("counts-*.json"):
        stale.unlink()
    return folder


def two_at_a_time(jobs: Iterable[Callable[[], None]]) -> None:
    """Run ``jobs`` (each an engine in processes of its own) two at a time, in order.

    An engine keeps about one core busy (its processes take turns), so two share this two-core
    machine. The first failure raises: the jobs not started by then are dropped, not run for a
    result nobody reads."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(job) for job in jobs]
        try:
            for done in as_completed(futures):
                done.result()
        finally:
            pool.shutdown(cancel_futures=True)


# The folder where every engine of one check run keeps vLLM's model-inspection cache
# (release/run.sh sets it; unset, each compile cache keeps its own)
MODELINFOS = "NPUGRAPH_CHECK_MODELINFOS"


def share_model_info(cache: Path) -> None:
    """Point vLLM's model-inspection cache in ``cache`` (``modelinfos``) at the check's one
    folder (``$NPUGRAPH_CHECK_MODELINFOS``), as a user's ``~/.cache/vllm`` keeps it between
    starts.

    Without it, every engine whose compile cache is new inspects its architecture in a
    subprocess that imports vLLM and the model (about 22 s a start here). Each file holds one
    architecture's interface facts keyed by the hash of its module's source, so a changed
    model is inspected again. The check's first engines compute it from nothing, and vLLM
    writes each file atomically, so engines side by side may share it."""
    shared = os.environ.get(MODELINFOS)
    link = cache / "modelinfos"
    if not shared or link.is_symlink() or link.exists():
        return
    Path(shared).mkdir(parents=True, exist_ok=True)
    cache.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):  # the engine beside this one linked it first
        link.symlink_to(Path(shared).resolve(), target_is_directory=True)


def engine_env(cache: Path, counts: str = "", **extra: str) -> dict[str, str]:
    """The environment of one engine's process: the simulator as torch_npu, offline, vLLM's
    compile cache in ``cache`` (its model-inspection cache the check's: :func:`share_model_info`),
    its counts (release/ascend_site.py) into ``counts`` if given."""
    share_model_info(cache)
    return {
        **os.environ,
        "NPUGRAPH_SIM_TORCH_NPU": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CACHE_ROOT": str(cache),
        "NPUGRAPH_VLLM_COUNTS": counts,
        **extra,
    }


def run_to_the_end(
    args: list[str], out: Path, env: dict[str, str], what: str, limit_s: int
) -> tuple[dict[str, Any], str]:
    """Run a script that writes what its engine did to ``out`` (JSON) and exits 0 whatever the
    engine did (release/faults.py, release/graph_memory.py); return that and its output, kept
    beside ``out``.  A hang (no end within ``limit_s``) or another exit raises ``RuntimeError``
    naming ``what``."""
    try:
        done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=limit_s, cwd=out.parent)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"{what}: the engine hung: no end within {limit_s} s\n{str(exc.stderr)[-4000:]}") from None
    log = done.stdout + done.stderr
    out.with_suffix(".log").write_text(log)
    if done.returncode != 0:
        raise RuntimeError(f"{what}: {Path(args[1]).name} exited {done.returncode}\n{log[-6000:]}")
    return json.loads(out.read_text()), log
