"""The command line: arguments, exit codes, JSON outputs (no timing assertions)."""

from __future__ import annotations

import json

import pytest

from npugraph.cli import main


def test_demo_json_and_manifest(tmp_path, capsys):
    js, dump = tmp_path / "demo.json", tmp_path / "manifest.json"
    code = main(
        [
            "demo",
            "--layers",
            "2",
            "--sizes",
            "1,2,4",
            "--steps",
            "20",
            "--max-model-len",
            "128",
            "--num-blocks",
            "64",
            "--no-progress",
            "--json",
            str(js),
            "--dump",
            str(dump),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and "20 steps, 0 mismatches" in out
    doc = json.loads(js.read_text())
    for field in (
        "device",
        "layers",
        "capture_sizes",
        "steps",
        "mismatches",
        "kernel_by_size",
        "update_us_median",
        "replay_us_median",
    ):
        assert field in doc
    assert doc["device"] == "sim" and doc["layers"] == 2 and doc["capture_sizes"] == [1, 2, 4]
    assert doc["kernel_by_size"] == {"1": "pa", "2": "pa", "4": "pa"}
    assert json.loads(dump.read_text())["totals"]["graphs"] == 3
    assert main(["dump", "validate", str(dump)]) == 0


def test_demo_replay_first_adversarial_and_policy_flag(capsys):
    code = main(
        [
            "demo",
            "--layers",
            "2",
            "--sizes",
            "2,8",
            "--steps",
            "15",
            "--max-model-len",
            "128",
            "--num-blocks",
            "64",
            "--no-progress",
            "--order",
            "replay-first",
            "--adversarial",
            "7",
            "--policy",
            "pa-sizes=8",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and "15 steps, 0 mismatches" in out
    assert f"{8:>5} {'pa':>8}" in out and f"{2:>5} {'fia_sink':>8}" in out  # FIA: lengths on the device


@pytest.mark.parametrize("argv", [["demo", "--sizes", "0,2"], ["demo", "--sizes", "a"], ["bogus"], []])
def test_bad_arguments_exit_2(argv):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2


def test_demo_on_npu_without_torch_npu_says_what_is_missing(capsys):
    assert main(["demo", "--device", "npu", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, "one line, no traceback"
    assert err.startswith("npugraph: error: device='npu' needs torch_npu and the CANN toolkit")
    assert "device='sim'" in err


def test_bench_json_schema(tmp_path):
    path, trace, chart = tmp_path / "bench.json", tmp_path / "timeline.json", tmp_path / "bench.png"
    code = main(
        [
            *("bench", "--layers", "2,32", "--sizes", "1", "--cost-model", "off", "--repeats", "2", "--seeds", "2"),
            *("--json", str(path), "--timeline", str(trace), "--plot", str(chart)),
        ]
    )
    assert code == 0
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # its size: tests/test_plots.py
    doc = json.loads(path.read_text())
    assert len(doc["rows"]) == 4  # 2 layer counts x 1 size x 2 kernels
    for row in doc["rows"]:
        keys = {"layers", "size", "kernel", "cost_model", "npugraph_us", "unchecked_us", "baseline_us", "floor_us"}
        assert keys | {"calls", "minimal_us"} <= set(row)
        impls = {"npugraph", "unchecked", "baseline", "floor", "minimal"}
        assert row["cost_model"] == "off" and set(row["calls"]) == impls
        calls = row["calls"]
        assert calls["npugraph"] == calls["unchecked"] == calls["floor"] == calls["minimal"] == 5 * row["layers"]
    s = doc["summary"]["measured"]["off"]
    assert {"ratio_vs_baseline_median", "overhead_vs_floor_median"} <= set(s)
    assert doc["summary"]["measured_off"]["npugraph_vs_floor"] == s["overhead_vs_floor_median"]
    assert doc["summary"]["measured_off"]["unchecked_vs_floor"] == s["unchecked_vs_floor_median"]
    assert doc["summary"]["measured_off"]["minimal_vs_floor"] == s["minimal_vs_floor_median"]
    assert doc["summary"]["measured_off"]["npugraph_vs_minimal"] == s["npugraph_vs_minimal_median"]
    assert doc["summary"]["measured_off"]["npugraph_vs_minimal_paired"] == s["npugraph_vs_minimal_paired_median"]
    rows = [r for r in doc["rows"] if r["layers"] >= 32]
    assert s["npugraph_vs_minimal_worst"] == max(r["npugraph_us"] / r["minimal_us"] for r in rows)
    for row in rows:  # each round's ratio: the median lies within its quartiles
        lo, hi = row["npugraph_vs_minimal_paired_spread"]
        assert lo <= row["npugraph_vs_minimal_paired"] <= hi
    assert doc["machine"]["python_loop_ns"] > 0  # the modeled ratios depend on the host's Python speed
    modeled = doc["summary"]["modeled"]
    hb, sb, db = modeled["host_bound"], modeled["small_batch"], modeled["device_bound"]
    impls = {"npugraph", "npugraph_grouped", "api_floor", "updatable_mrv2", "updatable_mrv1", "legacy"}
    assert set(hb["steps_per_s"]) >= impls | {"torch_npu_update"}
    for row, goal in ((hb, 2.0), (sb, 1.2)):  # issue 45's goals over torch_npu's own update
        r = row["npugraph_vs_torch_npu_update"]
        assert {"median", "min", "max", "n", "claim"} <= set(r) and r["goal"] == goal
        assert r["meets_goal"] == (r["min"] >= goal)
        assert "median" in row["npugraph_grouped_vs_torch_npu_update"]
    assert not any("k4" in k for k in hb["steps_per_s"]), "CANN allows one updater at a time"
    assert (hb["layers"], hb["size"], hb["kernel"], hb["attention_us"] + hb["other_us"]) == (20, 16, "fia", 60.0)
    assert (sb["kernel"], sb["size"]) == ("pa", 4) and db["layers"] == 32 and db["other_us"] > 0
    for key in ("npugraph_vs_updatable", "latency_vs_updatable", "npugraph_vs_api_floor"):
        assert {"median", "min", "max", "n"} <= set(hb[key]) and hb[key]["n"] == 2
    assert isinstance(hb["npugraph_vs_updatable"]["claim"], bool)
    assert "median" in sb["npugraph_vs_updatable"] and "median" in db["npugraph_vs_device_limit"]
    assert 0 <= modeled["noise"] < 0.5 and modeled["seeds"] == 2
    assert [r["requests"] for r in doc["validation"]] == [64, 256]
    assert all("device_table_check_decode_us" in r for r in doc["validation"])
    threaded = hb["background_thread"]
    assert threaded["engine_us"] == [0.0, 250.0, 500.0, 1000.0] and threaded["handoff_us"] > 0
    for config in ("default", "grouped"):
        assert set(threaded[config]) == {"0", "250", "500", "1000"}
        assert {"median", "min", "max"} <= set(threaded[config]["500"]["steps_per_s"])
        assert {"median", "min", "max"} <= set(threaded[config]["500"]["latency"])
    assert not any("@" in k for k in hb["steps_per_s"]), "the background-thread rows are reported apart"
    for row in (hb, sb, db):  # each implementation's spread over the seeds: the chart's error bars
        assert set(row["steps_per_s_spread"]) == set(row["steps_per_s"])
        assert all(s["min"] <= s["median"] <= s["max"] and s["n"] == 2 for s in row["steps_per_s_spread"].values())
    events = json.loads(trace.read_text())["traceEvents"]
    processes = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert {f"{shape}: updatable_mrv2" for shape in ("host_bound", "small_batch", "device_bound")} <= processes
    assert any(e.get("name") == "device stream" or e.get("args", {}).get("name") == "device stream" for e in events)


def test_policy_measure_and_show(tmp_path, capsys):
    path = tmp_path / "p.json"
    assert (
        main(["policy", "measure", "--sizes", "1,2", "--repeats", "2", "--max-model-len", "64", "--out", str(path)])
        == 0
    )
    assert main(["policy", "show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "policy for 4 heads" in out and "measured: PA" in out


def test_selftest_on_the_simulator_passes(tmp_path, capsys):
    path = tmp_path / "selftest.json"
    assert main(["selftest", "--device", "sim", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "torch 2" in out and "0 failed" in out
    doc = json.loads(path.read_text())
    names = [c["name"] for c in doc["checks"]]
    assert len(names) == 10 and all(c["passed"] for c in doc["checks"])
    assert {"weak aliases after capture", "two graphs, one pool", "argument placement"} <= set(names)
    sink = next(c for c in doc["checks"] if c["name"] == "fia tiling sink, size 8")
    assert "no per-layer update" in sink["detail"], "the simulator has the tiling-sink pair: the check runs"


def test_demo_update_free_replays_width_graphs_equal_to_eager_and_the_reference(capsys, tmp_path):
    out_json = tmp_path / "demo.json"
    code = main(
        [
            "demo",
            "--layers",
            "2",
            "--sizes",
            "2,8",
            "--steps",
            "20",
            "--max-model-len",
            "128",
            "--num-blocks",
            "64",
            "--no-progress",
            "--update-free",
            "--json",
            str(out_json),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and "20 steps, 0 mismatches" in out and "0 beyond tolerance" in out
    rows = [cells for cells in map(str.split, out.splitlines()) if cells and "@w" in cells[0]]
    assert rows and all(r[1] == "fia_frozen" and int(r[2]) > 0 for r in rows), out
    summary = json.loads(out_json.read_text())
    assert summary["widths"] == [16, 32, 64, 128]
    assert summary["kernel_by_size"]["8@w128"] == "fia_frozen"
