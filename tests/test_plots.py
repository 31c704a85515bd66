"""``npugraph bench --plot``: the chart drawn from a bench JSON (recorded: tests/data/, docs/),
checked as a PNG of the expected size (no pixel comparisons); matplotlib stays out of
``import npugraph``; a missing matplotlib or a JSON that is not a bench's is one line."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from npugraph.bench import plot
from npugraph.cli import main

ROOT = Path(__file__).resolve().parent.parent
RECORDED = ROOT / "tests" / "data" / "bench-small.json"


def png_size(path: Path) -> tuple[int, int]:
    """A PNG's width and height, from its header (the file must be a PNG)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG"
    return struct.unpack(">II", data[16:24])


EXPECTED = (int(plot.FIGSIZE[0] * plot.DPI), int(plot.FIGSIZE[1] * plot.DPI))


def test_the_chart_of_a_recorded_bench_json_is_a_png_of_its_size(tmp_path, capsys):
    out = tmp_path / "bench.png"
    assert main(["bench", "--plot", str(out), "--from-json", str(RECORDED)]) == 0
    assert capsys.readouterr().out.strip() == f"chart of {RECORDED}: {out}"
    assert png_size(out) == EXPECTED == (1400, 1000)


@pytest.mark.parametrize(
    "name",
    [
        "bench-sim-2026-12-02-torch-npu.json",  # the chart in docs/benchmarks.md: no per-seed spread yet
        "bench-sim-2026-12-01.json",  # before torch_npu's update and the tiling-sink rows
        "bench-sim-2026-12-08-update-free.json",  # with the update-free bars and sweep
    ],
)
def test_older_committed_bench_jsons_draw_with_what_they_hold(tmp_path, name):
    doc = json.loads((ROOT / "docs" / name).read_text())
    assert ("steps_per_s_spread" in doc["summary"]["modeled"]["host_bound"]) == ("update-free" in name)
    plot.plot_bench(doc, str(tmp_path / "old.png"))
    assert png_size(tmp_path / "old.png") == EXPECTED


def _one_line(capsys, code: int, match: str) -> None:
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith("npugraph: error: ") and match in err, err


def test_without_matplotlib_plot_is_refused_in_one_line_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    # no --from-json: the refusal comes before the benchmark's minutes
    _one_line(capsys, main(["bench", "--plot", str(tmp_path / "b.png")]), "pip install 'npugraph[plot]'")
    assert not (tmp_path / "b.png").exists()


def test_a_json_that_is_not_a_benchs_or_a_missing_plot_path_is_one_line(tmp_path, capsys):
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"summary": {"measured": {}}}))
    _one_line(capsys, main(["bench", "--plot", str(tmp_path / "x.png"), "--from-json", str(other)]), "no modeled rows")
    _one_line(capsys, main(["bench", "--from-json", str(RECORDED)]), "give --plot PATH alone")
    args = ["bench", "--plot", str(tmp_path / "x.png"), "--from-json", str(RECORDED), "--json", str(other)]
    _one_line(capsys, main(args), "give --plot PATH alone")
    assert not (tmp_path / "x.png").exists()


def test_import_npugraph_and_its_cli_load_no_matplotlib():
    code = (
        "import sys, npugraph, npugraph.cli, npugraph.bench.plot\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib'))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
