"""release/ (make release-check) is CI's second command: its scripts parse, and its table is right.

The check itself needs the release's environment (7 GB, minutes); these run without it.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
RELEASE = ROOT / "release"


def test_the_scripts_parse_and_ci_runs_the_check():
    for script in ("env.sh", "run.sh", "compat.sh", "sglang/env.sh", "sglang/run.sh"):
        subprocess.run(["bash", "-n", str(RELEASE / script)], check=True)
    ci = (ROOT / ".ci" / "run").read_text()
    subprocess.run(["bash", "-n", str(ROOT / ".ci" / "run")], check=True)
    assert "make test" in ci and "make release-check" in ci and "make sglang-check" in ci
    assert "export CHECK_SCOPE=ci" in ci


def test_a_checks_scope_is_full_unless_ci_and_a_wrong_one_stops_it_in_one_line(monkeypatch):
    runs = _release_module("runs")
    monkeypatch.delenv("CHECK_SCOPE", raising=False)
    assert runs.check_scope() == "full"
    monkeypatch.setenv("CHECK_SCOPE", "ci")
    assert runs.check_scope() == "ci"
    monkeypatch.setenv("CHECK_SCOPE", "quick")
    with pytest.raises(SystemExit, match="CHECK_SCOPE must be one of full, ci, compat, not 'quick'"):
        runs.check_scope()


def test_each_engine_run_says_how_long_it_took_in_the_log_and_in_cis_list(tmp_path, monkeypatch, capsys):
    runs = _release_module("runs")
    times = tmp_path / "times.txt"
    monkeypatch.setenv("CHECK_TIMES", str(times))
    out = tmp_path / "llama.eager.json"
    runs.run_logged([sys.executable, "-c", "print('served')"], out, dict(os.environ), "llama eager (run 1)")
    assert out.with_suffix(".log").read_text() == "served\n"
    assert times.read_text().strip().startswith("llama eager (run 1): ")
    assert "llama eager (run 1): " in capsys.readouterr().err
    with pytest.raises(RuntimeError, match="generate.py llama npugraph .run 1. failed"):
        runs.run_logged([sys.executable, "-c", "raise SystemExit(3)"], out, dict(os.environ), "llama npugraph (run 1)")
    assert len(times.read_text().splitlines()) == 2  # a failed run's time is listed too


def test_a_failed_part_of_a_check_is_named_in_cis_list_of_steps(tmp_path):
    # CI's log keeps only its tail and the list of steps: a failure in the middle of a check must
    # name itself there, with its step, and fail the check
    times = tmp_path / "times.txt"
    script = (
        f"set -euo pipefail; RESULTS={tmp_path}; HERE={RELEASE}; status=0; source {RELEASE / 'step.sh'}; "
        "step 'a generation'; true || failed generate.py; "
        "(echo served; echo 'RuntimeError: generate.py llama npugraph (run 1) failed'; exit 1) 2>&1 "
        '| tee "$STEP_LOG" || failed generate.py; '
        "step 'a server'; echo status=$status"
    )
    done = subprocess.run(
        ["bash", "-c", script], env={**os.environ, "CHECK_TIMES": str(times)}, capture_output=True, text=True
    )
    listed = times.read_text().splitlines()
    assert [line.split("] ", 1)[-1].strip() for line in listed] == [
        "a generation",
        "FAILED: generate.py, in a generation",
        "RuntimeError: generate.py llama npugraph (run 1) failed",  # why, in the failure's own words
        "a server",
    ]
    assert done.stdout.strip().endswith("status=1")


def test_the_table_counts_what_junit_says(tmp_path):
    # two files in one pytest (run.sh's unit-test files), a third alone, as run.sh runs them
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "test_a.py").write_text("def test_ok():\n    pass\n\ndef test_bad():\n    assert False\n")
    (tmp_path / "x" / "test_b.py").write_text(
        "import pytest\n\ndef test_ok():\n    pass\n\ndef test_s():\n    pytest.skip()\n"
    )
    (tmp_path / "x" / "test_c.py").write_text("def test_ok():\n    pass\n")
    for name, files in (("ut", ["x/test_a.py", "x/test_b.py"]), ("test_c", ["x/test_c.py"])):
        pytest_args = ["-q", "-p", "no:cacheprovider", "-o", "junit_family=xunit1", f"--junitxml={tmp_path / name}.xml"]
        subprocess.run([sys.executable, "-m", "pytest", *pytest_args, *files], cwd=tmp_path, capture_output=True)
    done = subprocess.run(
        [
            sys.executable,
            str(RELEASE / "table.py"),
            str(tmp_path),
            "x/test_a.py",
            "x/test_b.py",
            "x/test_c.py",
            "x/test_missing.py",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    rows = done.stdout.splitlines()
    assert "| `x/test_a.py` | 2 | 1 | 1 | 0 |" in rows
    assert "| `x/test_b.py` | 2 | 1 | 0 | 1 |" in rows
    assert "| `x/test_c.py` | 1 | 1 | 0 | 0 |" in rows
    assert "| `x/test_missing.py` | not run | | | |" in rows


def test_the_hub_cache_is_laid_out_as_huggingface_hub_reads_it(tmp_path):
    subprocess.run([sys.executable, str(RELEASE / "hf_cache.py"), str(tmp_path)], check=True)
    repo = tmp_path / "models--Qwen--Qwen3-8B"
    snapshot = (repo / "refs" / "main").read_text()
    assert (repo / "snapshots" / snapshot / "config.json").is_file()


def _release_module(name):
    import importlib

    sys.path.insert(0, str(RELEASE))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(RELEASE))


def _write_run(tmp_path, run, ascend, npugraph):
    import json

    runs = _release_module("runs")
    runs.result_path(tmp_path, "llama", "aclgraph", run).write_text(json.dumps({"vllm_ascend_update_seconds": ascend}))
    runs.result_path(tmp_path, "llama", "npugraph", run).write_text(json.dumps({"npugraph_update_seconds": npugraph}))


def test_the_update_cost_row_is_a_ratio_of_medians_with_its_interval(tmp_path, capsys):
    import json

    update_cost = _release_module("update_cost")
    ascend = [300e-6 + i * 1e-6 for i in range(40)]  # median 319.5 us
    npugraph = [100e-6 + (i % 5) * 1e-6 for i in range(40)]  # median 102 us
    _write_run(tmp_path, 1, ascend, npugraph)
    assert update_cost.main(["update_cost.py", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "update-cost.json").read_text())
    (row,) = out["runs"]
    assert abs(row["speedup_median"] - 319.5 / 102) < 1e-9
    low, high = row["speedup_95"]
    assert low <= row["speedup_median"] <= high and high - low < 0.5
    assert row["steps"] == {"vllm_ascend": 40, "npugraph": 40}
    assert out["verdict"] == "npugraph's update is faster in every run"
    assert "1 run(s)" in capsys.readouterr().out


def test_the_frameworks_own_share_is_the_update_less_the_simulators_own(tmp_path, capsys):
    """Each step's update less the simulator's own seconds in it (npusim.own_seconds): a ratio
    of the frameworks alone; none where a run recorded no own seconds."""
    import json

    update_cost = _release_module("update_cost")
    runs = _release_module("runs")
    ascend = [300e-6 + (i % 4) * 1e-6 for i in range(40)]
    npugraph = [100e-6 + (i % 4) * 1e-6 for i in range(40)]
    # the simulator's own: 200 us of vllm-ascend's step, 50 of npugraph's (it re-issues cheaper
    # on the simulator: the same tensors every step), so the frameworks' are 100 and 50
    # the device calls of 40 steps: vllm-ascend records an event a layer (2 layers), npugraph
    # one a step, and vllm-ascend queries PA's workspace once in four steps
    calls = {
        "vllm_ascend": {
            "update_begin": 80,
            "op_launch": 80,
            "update_end": 80,
            "event_record": 80,
            "workspace_query": 10,
        },
        "npugraph": {"update_begin": 80, "op_launch": 80, "update_end": 80, "event_record": 40},
    }
    for mode, side, host, own in (
        ("aclgraph", "vllm_ascend", ascend, [200e-6] * 40),
        ("npugraph", "npugraph", npugraph, [50e-6] * 40),
    ):
        runs.result_path(tmp_path, "llama", mode).write_text(
            json.dumps(
                {f"{side}_update_seconds": host, f"{side}_update_own": own, f"{side}_update_device_calls": calls[side]}
            )
        )
    assert update_cost.main(["update_cost.py", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "update-cost.json").read_text())
    (row,) = out["runs"]
    assert abs(row["speedup_median"] - 301.5 / 101.5) < 1e-9
    fw = row["framework_only"]
    assert abs(fw["speedup_median"] - 101.5 / 51.5) < 1e-9
    assert fw["simulator_own_median_us"] == {"vllm_ascend": 200.0, "npugraph": 50.0}
    assert out["framework_only_verdict"] == "npugraph's update is faster in every run"
    # on A2's costs (begin 22, launch 120, end 30, record 12, workspace query 50 us) a step of
    # vllm-ascend's calls is 2 x 184 + 12.5 us, npugraph's 2 x 172 + 12: both about 4x the frameworks'
    a2 = row["a2_modeled"]
    assert abs(a2["vllm_ascend"]["api_us"] - 380.5) < 1e-9 and abs(a2["npugraph"]["api_us"] - 356.0) < 1e-9
    assert abs(a2["speedup_median"] - (101.5 + 380.5) / (51.5 + 356.0)) < 1e-9
    assert out["a2_modeled_range"] == [a2["speedup_median"]] * 2
    printed = capsys.readouterr().out
    assert "the frameworks' own share" in printed and "on A2's modelled API costs" in printed
    runs.result_path(tmp_path, "llama", "npugraph").write_text(json.dumps({"npugraph_update_seconds": npugraph}))
    assert update_cost.main(["update_cost.py", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "update-cost.json").read_text())
    assert "framework_only" not in out["runs"][0] and out["framework_only_verdict"] is None


def test_the_update_cost_breaks_a_deep_model_down_by_its_decode_batch(tmp_path, capsys):
    """The 32-layer benchmark is served at batches of 1, 4 and 16: a row per size both sides
    updated, each from its own steps; sizes not recorded beside the seconds give no breakdown."""
    import json

    update_cost = _release_module("update_cost")
    runs = _release_module("runs")
    sizes = [1] * 20 + [4] * 20 + [16] * 20
    ascend = [{1: 100e-6, 4: 200e-6, 16: 400e-6}[n] + (i % 3) * 1e-6 for i, n in enumerate(sizes)]
    npugraph = [{1: 100e-6, 4: 100e-6, 16: 100e-6}[n] + (i % 3) * 1e-6 for i, n in enumerate(sizes)]
    # the simulated device's seconds at each graph step: 40 ms of device work a step, one
    # prefill of 900 ms between two of them (the median leaves it out); none recorded in one mode
    device_at = [0.04 * i + (0.9 if i > 30 else 0.0) for i in range(60)]
    runs.result_path(tmp_path, "deep", "aclgraph").write_text(
        json.dumps({"vllm_ascend_update_seconds": ascend, "vllm_ascend_update_tokens": sizes})
    )
    runs.result_path(tmp_path, "deep", "npugraph").write_text(
        json.dumps(
            {"npugraph_update_seconds": npugraph, "npugraph_update_tokens": sizes, "graph_steps_device_at": device_at}
        )
    )
    assert update_cost.main(["update_cost.py", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "update-cost.json").read_text())["runs"]
    work = row["device_ms_per_graph_step"]
    assert work["vllm_ascend"] is None and abs(work["npugraph"] - 40.0) < 1e-6
    got = {int(size): r["speedup_median"] for size, r in row["by_size"].items()}
    assert got.keys() == {1, 4, 16} and abs(got[1] - 1) < 0.02 and abs(got[4] - 2) < 0.05 and abs(got[16] - 4) < 0.1
    assert all(r["steps"] == {"vllm_ascend": 20, "npugraph": 20} for r in row["by_size"].values())
    printed = capsys.readouterr().out
    assert "16 tokens a step" in printed and "device work on the simulator (median): {'npugraph': '40.0 ms'}" in printed
    assert update_cost.by_size(ascend, sizes[:-1], npugraph, sizes) == {}, "unaligned: no breakdown"


def test_the_slowed_kernel_check_compares_each_sides_host_figure_and_wall_per_batch(tmp_path, capsys):
    """release/generate.py's run with FIA slowed on the device: per side and batch, the update's
    host figure and wall in run 1 and in the slowed run, side by side (no verdict: a timing is
    the benchmark's, not a test's); nothing without the slowed runs or the walls."""
    import json

    update_cost = _release_module("update_cost")
    runs = _release_module("runs")
    sizes = [1] * 10 + [4] * 10
    fast = [100e-6] * 20
    for side, mode in (("vllm_ascend", "aclgraph"), ("npugraph", "npugraph")):
        for path, walls in (
            (runs.result_path(tmp_path, "deep", mode), [150e-6] * 20),
            (tmp_path / f"deep.{mode}.slowed.json", [150e-6] * 10 + [450e-6] * 10),
        ):
            result = {f"{side}_update_seconds": fast, f"{side}_update_tokens": sizes, f"{side}_update_walls": walls}
            path.write_text(json.dumps(result))
    assert update_cost.main(["update_cost.py", str(tmp_path)]) == 0
    got = json.loads((tmp_path / "update-cost.json").read_text())["slowed"]
    for side in ("vllm_ascend", "npugraph"):
        assert got[side]["1"]["host_slowed_over_normal"] == 1.0 == got[side]["1"]["wall_slowed_over_normal"]
        assert got[side]["4"]["host_slowed_over_normal"] == 1.0 and got[side]["4"]["wall_slowed_over_normal"] == 3.0
    said = (
        "FIA slowed (npugraph, 4 tokens a step): the update's host figure 100 -> 100 us (1.00x; the unslowed runs 100"
    )
    assert said in capsys.readouterr().out
    assert got["npugraph"]["4"]["host_within_unslowed_runs"] and got["npugraph"]["4"][
        "unslowed_runs_host_median_us"
    ] == [
        100.0,
        100.0,
    ]
    (tmp_path / "deep.npugraph.slowed.json").unlink()
    assert update_cost.slowed(tmp_path) == {}


def test_the_update_cost_verdict_takes_every_run(tmp_path):
    """One run's interval is not the noise between runs: a run that disagrees (or whose
    interval spans 1) takes the claim away."""
    import json

    update_cost = _release_module("update_cost")
    fast = [100e-6 + (i % 5) * 1e-6 for i in range(40)]
    slow = [300e-6 + (i % 7) * 1e-6 for i in range(40)]
    _write_run(tmp_path, 1, slow, fast)  # npugraph about 3x faster
    _write_run(tmp_path, 2, slow, fast)
    assert update_cost.main(["update_cost.py", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "update-cost.json").read_text())
    assert len(out["runs"]) == 2 and out["verdict"].startswith("npugraph's update is faster")
    _write_run(tmp_path, 3, fast, slow)  # this run: the other way round
    assert update_cost.main(["update_cost.py", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "update-cost.json").read_text())
    assert len(out["runs"]) == 3 and out["verdict"].startswith("no claim")
    low, high = out["speedup_median_range"]
    assert low < 1 < high
    for p in tmp_path.glob("*.json"):
        p.unlink()
    _write_run(tmp_path, 1, fast, slow)
    assert update_cost.main(["update_cost.py", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "update-cost.json").read_text())["verdict"].startswith(
        "vllm-ascend's update is faster"
    )


def test_update_cost_and_generate_refuse_what_they_cannot_use(tmp_path, capsys):
    update_cost = _release_module("update_cost")
    generate = _release_module("generate")
    assert update_cost.main(["update_cost.py", str(tmp_path)]) == 2  # no results there
    assert "no llama.aclgraph.json" in capsys.readouterr().err
    assert generate.main(["generate.py", str(tmp_path), "0"]) == 2  # zero runs: usage, nothing run
    assert generate.main(["generate.py", str(tmp_path), "x", "y", "z"]) == 2
    assert not list(tmp_path.iterdir())
    # a second run's name does not shadow the first's, and results() stops at a gap
    _write_run(tmp_path, 1, [1e-6, 2e-6], [1e-6, 2e-6])
    _write_run(tmp_path, 3, [1e-6, 2e-6], [1e-6, 2e-6])
    assert [p.name for p in _release_module("runs").results(tmp_path, "llama", "aclgraph")] == ["llama.aclgraph.json"]


def test_a_generation_plans_eager_once_and_the_repeated_models_graph_modes_in_turn():
    runs = _release_module("runs")
    plan = runs.order(("llama", "qwen3"), ("aclgraph", "npugraph"), 2, "llama")
    assert plan == [
        ("llama", "eager", 1),
        ("qwen3", "eager", 1),
        ("qwen3", "aclgraph", 1),
        ("qwen3", "npugraph", 1),
        ("llama", "aclgraph", 1),
        ("llama", "npugraph", 1),
        ("llama", "aclgraph", 2),
        ("llama", "npugraph", 2),
    ]
    assert runs.order(("llama", "deep"), ("aclgraph", "npugraph"), 1, "deep", eager=("llama",)) == [
        ("llama", "eager", 1),
        ("llama", "aclgraph", 1),
        ("llama", "npugraph", 1),
        ("deep", "aclgraph", 1),
        ("deep", "npugraph", 1),
    ], "a model left out of eager= runs its graph modes only"
    with pytest.raises(ValueError, match="runs must be at least 1"):
        runs.order(("llama",), ("aclgraph",), 0, "llama")


def test_the_timed_runs_have_the_machine_alone_and_a_models_graph_modes_are_not_neighbours():
    runs = _release_module("runs")
    plan = runs.order(("llama", "qwen3", "ngram", "mla"), ("aclgraph", "npugraph"), 2, "llama")
    shared, alone = runs.side_by_side(plan, ("llama", "ngram"))
    assert sorted(shared + alone) == sorted(plan) and len(shared + alone) == len(plan)
    assert alone == [
        ("ngram", "aclgraph", 1),
        ("ngram", "npugraph", 1),
        ("llama", "aclgraph", 1),
        ("llama", "npugraph", 1),
        ("llama", "aclgraph", 2),
        ("llama", "npugraph", 2),
    ]
    assert shared == [
        ("llama", "eager", 1),
        ("qwen3", "eager", 1),
        ("ngram", "eager", 1),
        ("mla", "eager", 1),
        ("qwen3", "aclgraph", 1),
        ("mla", "aclgraph", 1),
        ("qwen3", "npugraph", 1),
        ("mla", "npugraph", 1),
    ]
    # two at a time: no two neighbours are the same model's graph modes
    graph = [r for r in shared if r[1] != "eager"]
    assert all(a[0] != b[0] for a, b in itertools.pairwise(graph))


def test_at_cis_scope_the_32_layer_side_by_side_alone_is_timed_where_it_runs(monkeypatch):
    runs = _release_module("runs")
    monkeypatch.setenv("CHECK_SCOPE", "full")
    assert runs.timed(["llama", "ngram", "mla", "deep"]) == ("llama", "ngram", "deep")
    monkeypatch.setenv("CHECK_SCOPE", "ci")
    assert runs.timed(["llama", "ngram", "mla", "deep"]) == ("deep",)
    assert runs.timed(["llama", "ngram", "mla"]) == ("llama", "ngram"), "without it, the two-layer models are"


def test_engine_counts_are_written_by_the_process_that_counts_and_read_back_one_per_rank(tmp_path):
    import json
    import os

    engine_counts = _release_module("engine_counts")

    class Updater:
        def update(self, n: int) -> int:
            return n + 1

    counts = engine_counts.EngineCounts(str(tmp_path))
    Updater.update = counts.time(Updater, "update", "probe")
    assert Updater().update(1) == 2 and Updater().update(2) == 3
    path = tmp_path / f"counts-{os.getpid()}.json"
    written = json.loads(path.read_text())  # after each call: an engine process is killed at shutdown
    assert len(written["probe_seconds"]) == 2 and written["npugraph_steps"] == 0
    assert engine_counts.read(tmp_path) == [written]
    (tmp_path / "counts-1.json").write_text("{}")  # a second model process: not one engine
    with pytest.raises(RuntimeError, match="2 model processes counted in .*, not 1"):
        engine_counts.read(tmp_path)
    assert engine_counts.read(tmp_path, 2) == [{}, written]  # two ranks' workers (by name)


def test_a_traceback_counts_as_npugraphs_only_where_npugraphs_code_raised_it():
    """The server checks' rule: npugraph adds no traceback to a server's log.  One raised in
    npugraph's code counts, whatever the log's prefixes; one that only passes through one of
    npugraph's wrappers (the server's own refusal, or its shutdown) does not."""
    import npugraph

    npugraph_raised = _release_module("serving").npugraph_raised
    ours = f'  File "{Path(npugraph.__file__).parent}/integrations/vllm/plugin.py", line 1, in wrapper'
    theirs = '  File "/venv/site-packages/vllm/renderers/base.py", line 399, in render_prompts_async'
    server = "(APIServer pid=12) "
    core = "(EngineCore pid=13) ERROR 12-04 16:27:51 [core.py:1197] "

    def log(prefix, *frames, exc="ValueError: You must pass at least one prompt"):
        lines = ["INFO: served", "Traceback (most recent call last):", *frames, "    raise it", exc, "INFO: next"]
        return "\n".join(prefix + line for line in lines)

    assert npugraph_raised(log(server, theirs, ours)) == ["ValueError: You must pass at least one prompt"]
    assert npugraph_raised(log(core, theirs, ours, exc="IndexError: index out of range")) == [
        "IndexError: index out of range"
    ]
    assert npugraph_raised(log(server, ours, theirs)) == [], "passing through a wrapper is not raising"
    assert npugraph_raised(log("", theirs, exc="KeyboardInterrupt")) == []
    assert npugraph_raised(log(server, theirs) + "\n" + log(server, ours)) == [
        "ValueError: You must pass at least one prompt"
    ]


def test_a_ray_clusters_stop_ends_every_process_of_its_sessions_by_their_ids():
    """release/ray_cluster.py stops what it started by the processes' ids: each node's leader
    first (SIGTERM), then whatever is left in its session, however deep (Ray's workers each
    in a process group of their own), and nothing outside those sessions."""
    cluster = _release_module("ray_cluster")
    # a leader that ignores SIGTERM, a grandchild in a process group of its own, as Ray's workers are
    # (this interpreter by its path: a bare python3 may be a shim, pyenv's, whose own
    # processes pass through the session while it starts)
    grandchild = f"{sys.executable} -c 'import os, time; os.setpgrp(); time.sleep(300)'"
    node = subprocess.Popen(["bash", "-c", f"trap '' TERM; {grandchild} & sleep 300"], start_new_session=True)
    bystander = subprocess.Popen(["sleep", "300"])
    try:
        deadline = time.monotonic() + 30
        while len(cluster.in_sessions((node.pid,))) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(cluster.in_sessions((node.pid,))) == 3  # bash, its sleep, the regrouped python
        original = cluster.STOP_S
        cluster.STOP_S = 1
        try:
            cluster.stop([node])
        finally:
            cluster.STOP_S = original
        assert cluster.in_sessions((node.pid,)) == []
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


def test_two_at_a_time_runs_two_at_once_and_the_first_failure_drops_what_has_not_started():
    """release/runs.py's pool for engines that may share the machine: never more than two at
    once, and a failure raises, leaving the jobs not started unrun."""
    import threading

    runs = _release_module("runs")
    lock, running, most, ran = threading.Lock(), [0], [0], []

    def job(i, fail=False):
        def run():
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
            time.sleep(0.05)
            with lock:
                running[0] -= 1
                ran.append(i)
            if fail:
                raise RuntimeError(f"job {i} failed")

        return run

    runs.two_at_a_time(job(i) for i in range(5))
    assert sorted(ran) == list(range(5)) and most[0] == 2
    ran.clear()
    with pytest.raises(RuntimeError, match="job 0 failed"):
        runs.two_at_a_time([job(0, fail=True), job(1), *(job(i) for i in range(2, 8))])
    assert 0 in ran and len(ran) < 8


def test_every_engine_of_a_check_shares_vllms_model_inspection_cache(tmp_path, monkeypatch):
    """release/runs.py links each compile cache's ``modelinfos`` to the check's one folder, as a
    user's ~/.cache/vllm keeps it; unset, each cache keeps its own."""
    runs = _release_module("runs")
    monkeypatch.delenv(runs.MODELINFOS, raising=False)
    env = runs.engine_env(tmp_path / "alone")
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "alone") and not (tmp_path / "alone").exists()
    shared = tmp_path / "check" / "modelinfos"
    monkeypatch.setenv(runs.MODELINFOS, str(shared))
    for name in ("vllm-cache", "vllm-cache.fault"):
        runs.engine_env(tmp_path / name)
        runs.engine_env(tmp_path / name)  # again: the link stays
    (tmp_path / "vllm-cache" / "modelinfos" / "llama.json").write_text("{}")
    assert (tmp_path / "vllm-cache.fault" / "modelinfos" / "llama.json").read_text() == "{}"
    assert [p.name for p in shared.iterdir()] == ["llama.json"]


def test_hugging_faces_check_forwards_a_text_served_twice_once_with_the_same_answer(tmp_path):
    """release/hf_reference.py: a repeated (prompt, text) gets the answer its first forward gave,
    and texts that differ, if only in where the prompt ends, are each forwarded."""
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoModelForCausalLM

    tiny = _release_module("tiny_model")
    hf = _release_module("hf_reference")
    tiny.write(tmp_path, *_llama_classes(), torch.float32, 64, head_dim=16)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()

    def argmax(ids):
        with torch.no_grad():
            return int(model(torch.tensor([ids])).logits[0, -1].argmax())

    # a third token that is not the argmax after the first two, then the greedy text after it
    third = (argmax([3, 4]) + 1) % 64
    greedy = [argmax([3, 4, third])]
    greedy.append(argmax([3, 4, third, *greedy]))
    prompts = [[3, 4, third], [3, 4], [3, 4, third], [9]]
    texts = [greedy, [third, *greedy], greedy, [8, 8, 8]]
    got = hf.greedy_choices(tmp_path, prompts, texts)
    assert got == [hf.greedy_choices(tmp_path, [p], [t])[0] for p, t in zip(prompts, texts)]
    assert got[0] == got[2] == (0.0, 2)
    assert got[1][0] > 0  # the same ids as the first, split elsewhere: its own forward


def _llama_classes():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaConfig, LlamaForCausalLM


def test_the_checks_count_each_of_npugraphs_steps_once_and_a_refused_one_not(tmp_path, monkeypatch):
    """release/engine_counts.py counts npugraph's steps where every caller's step goes
    (Runtime.step_graph: vLLM's wrapper calls it, Runtime.step too); a step refused by the
    padding rule (the wrapper then runs the batch eagerly) is no graph step and has no update."""
    import attrs
    import torch

    import npugraph.replay.updater as updater_module
    import npugraph.runtime as runtime_module
    from npugraph.errors import BatchRefused

    from .helpers import Harness, query_for

    monkeypatch.setattr(runtime_module.Runtime, "step_graph", runtime_module.Runtime.step_graph)  # restored after
    monkeypatch.setattr(updater_module.ReplayUpdater, "_write", updater_module.ReplayUpdater._write)
    engine_counts = _release_module("engine_counts")
    counts = engine_counts.EngineCounts(str(tmp_path))
    modules = {"npugraph.replay.updater": updater_module, "npugraph.runtime": runtime_module}
    counts.npugraph(lambda name, hook: hook(modules[name]), write_each_step=False)
    h = Harness([2], layers=2, tokens_per_request=2)
    h.step(2, {"default": h.random_meta(1, [50])}, query_for(h, 2, 0))
    spare = attrs.evolve(h.random_meta(2, [40, 70]), query_start_loc=torch.tensor([0, 1, 3], dtype=torch.int32))
    with pytest.raises(BatchRefused):
        h.rt.step(2, {"default": spare}, refusable=True)
    h.step(2, {"default": h.random_meta(1, [60])}, query_for(h, 2, 1))
    assert counts.values["npugraph_steps"] == 2
    assert len(counts.values["npugraph_update_seconds"]) == 2 == len(counts.values["npugraph_update_tokens"])
    assert len(counts.values["npugraph_capture_report"]) == 1


def _generated(folder: Path, model: str, mode: str, tokens: list, log: str = "") -> None:
    import json

    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{model}.{mode}.json").write_text(json.dumps({"tokens": tokens}))
    if log:
        (folder / f"{model}.{mode}.log").write_text(log)


def test_make_compat_records_a_release_and_the_readme_matrix_is_made_from_the_records(tmp_path):
    """A release's record, read off what run.sh left at CHECK_SCOPE=compat: a graph mode whose
    tokens differ from eager's is said, a mode that never ran is a dash, the v2 runner a release
    does not serve is 'not served', the plugin's INFO line is counted, the failed steps kept;
    records accumulate, in release order, vllm-ascend's and SGLang's apart, one row each."""
    import json

    compat = _release_module("compat")
    generate_py = _release_module("generate")
    assert compat.MODELS == generate_py.COMPAT_MODELS and compat.MODES["vllm"] == generate_py.MODES
    results = tmp_path / "results"
    gen = results / "generate"
    info = "INFO npugraph: vllm-ascend (aug-2026) installed; replaced a.b.forward, a.b.c, d.e\n"
    for mode in ("eager", "aclgraph", "vllm-default", "vllm-default-npugraph"):
        _generated(gen, "llama", mode, [[1, 2]])
    _generated(gen, "llama", "npugraph", [[1, 2]], log=info)
    _generated(gen, "qwen3", "eager", [[3]])
    _generated(gen, "qwen3", "npugraph", [[4]])
    times = tmp_path / "times"
    times.write_text("  generate: 3 min\nFAILED: release/test_generate.py, in a real generation\n")
    out = tmp_path / "compat.json"
    for version, rc in (("0.30.0rc1", 1), ("0.24.0rc1", 0)):
        compat.record(out, "vllm", version, results, rc, 600, times, version[:6])
    sglang = tmp_path / "sglang"
    for model in ("llama", "qwen3"):
        for mode in ("eager", "sglang"):
            _generated(sglang, model, mode, [[5]])
    (sglang / "llama.npugraph.json").write_text(json.dumps({"tokens": [[5]], "npugraph_steps": 41}))
    done = subprocess.run(
        [
            sys.executable,
            str(RELEASE / "compat.py"),
            "record",
            str(out),
            "sglang",
            "0.5.22",
            str(sglang),
            "0",
            "60",
            "-",
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    assert list(data["vllm"]) == ["0.24.0rc1", "0.30.0rc1"] and list(data["sglang"]) == ["0.5.22"]
    r = data["vllm"]["0.30.0rc1"]
    assert r["status"] == "failed" and r["minutes"] == 10.0 and r["vllm"] == "0.30.0"
    assert r["failed_steps"] == ["FAILED: release/test_generate.py, in a real generation"]
    assert r["generation"]["llama"] == {"eager": "ran", "aclgraph": "same as eager", "npugraph": "same as aclgraph"}
    assert r["generation"]["qwen3"] == {"eager": "ran", "aclgraph": "no result", "npugraph": "differs from aclgraph"}
    assert r["llama_other_modes"]["vllm-default-npugraph"] == "same as vllm-default"
    assert r["plugin"] == {"generation": "aug-2026", "replaced": 3, "missing": []}
    s = data["sglang"]["0.5.22"]
    assert s["generation"]["qwen3"] == {"eager": "ran", "sglang": "same as eager", "npugraph": "no result"}
    assert s["plugin"] == {"npugraph_steps": 41} and s["status"] == "passed"
    rows = compat.table(data).splitlines()
    assert len(rows) == 8 and rows[2].startswith("| 0.24.0rc1 (0.24.0) |") and rows[3].startswith("| 0.30.0rc1")
    assert "| ✓ / — / ≠ aclgraph |" in rows[3] and "| ✓ / ✓; not served |" in rows[3]
    assert rows[7].startswith("| 0.5.22 |") and rows[7].endswith("| ✓ / ✓ / ✓ | ✓ / ✓ / — | 41 |")
    assert compat._order("0.30.0rc1") < compat._order("0.30.0rc2") < compat._order("0.30.0")
    assert compat._order("0.23.0") < compat._order("0.23.0.post1") < compat._order("0.24.0rc1")
    wrong = subprocess.run(
        [sys.executable, str(RELEASE / "compat.py"), "record", str(out), "tgi", "1"], capture_output=True, text=True
    )
    assert wrong.returncode == 2 and wrong.stderr.startswith("usage:")


def test_the_readmes_release_matrix_is_the_committed_records_table():
    import json

    records = ROOT / "docs" / "compat.json"
    if not records.is_file():
        pytest.skip("no make compat records committed yet")
    matrix = _release_module("compat").table(json.loads(records.read_text()))
    assert matrix in (ROOT / "README.md").read_text(), "README's matrix: release/compat.py table docs/compat.json"


def test_every_release_the_check_knows_has_its_environment_and_a_vllm_version():
    known = subprocess.run(
        [
            "bash",
            "-c",
            f"source {RELEASE / 'versions.sh'}; for r in $RELEASES; do release_of $r; echo $r $VLLM_VERSION $LOCK; done",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    rows = [line.split() for line in known if line]
    assert len(rows) == 9 and rows[0] == ["0.23.0.post1", "0.23.0", "release"]
    for version, vllm, lock in rows:
        assert (ROOT / "envs" / f"{lock}.toml").is_file() and (ROOT / "envs" / f"{lock}.lock").is_file(), version
        assert version.startswith(vllm.rsplit(".", 1)[0]), (version, vllm)
    stop = subprocess.run(
        ["bash", "-c", f"source {RELEASE / 'versions.sh'}; release_of 0.22.1rc1"], capture_output=True, text=True
    )
    assert stop.returncode == 1 and "0.22.1rc1 is not a release it knows" in stop.stderr
    sglang = subprocess.run(
        [
            "bash",
            "-c",
            f"source {RELEASE / 'sglang' / 'versions.sh'}; for r in $SGLANG_RELEASES; do sglang_release_of $r; echo $LOCK; done",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert sglang == ["sglang-0.5.21", "sglang-0.5.22", "sglang"]
    assert all((ROOT / "envs" / f"{lock}.lock").is_file() for lock in sglang)
