"""``python -m npusim.bench``: the simulator's re-issue cost report (its figures are timings,
so only its shape and its refusals are checked here; ``make bench`` runs it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from npusim import bench


def test_report_has_each_loop_and_kernel_with_its_spread(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "reissue.json"
    assert bench.main(["--runs", "2", "--steps", "2", "--layers", "2", "--reissues", "3", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["runs"] == 2 and report["reissues_per_run"] == 3
    assert report["engine_steps_per_run"] == 2 and report["layers"] == 2
    for loop in ("engine", "tight"):
        for kernel, batch in (("pa", 4), ("fia", 16)):
            r = report[loop][kernel]
            assert r["batch"] == batch
            assert len(r["runs_us"]) == 2
            assert r["min_us"] <= r["median_us"] <= r["max_us"]
            assert r["min_us"] > 0
    printed = capsys.readouterr().out
    for line in ("re-issued  pa (batch  4), engine loop:", "re-issued fia (batch 16), tight loop:"):
        assert line in printed


def test_bad_counts_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--runs", "0"]) == 2
    assert (
        capsys.readouterr().err.strip() == "npusim.bench: --runs, --steps, --layers and --reissues must be at least 1"
    )
