"""release/ (make release-check) is CI's second command: its scripts parse, and its table is right.

The check itself needs the release's environment (7 GB, minutes); these run without it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
RELEASE = ROOT / "release"


def test_the_scripts_parse_and_ci_runs_the_check():
    for script in ("env.sh", "run.sh"):
        subprocess.run(["bash", "-n", str(RELEASE / script)], check=True)
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci and "make release-check" in ci


def test_the_table_counts_what_junit_says(tmp_path):
    (tmp_path / "test_a.py").write_text("def test_ok():\n    pass\n\ndef test_bad():\n    assert False\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={tmp_path / 'test_a.xml'}",
            "test_a.py",
        ],
        cwd=tmp_path,
        capture_output=True,
    )
    done = subprocess.run(
        [sys.executable, str(RELEASE / "table.py"), str(tmp_path), "x/test_a.py", "x/test_missing.py"],
        capture_output=True,
        text=True,
        check=True,
    )
    rows = done.stdout.splitlines()
    assert "| `x/test_a.py` | 2 | 1 | 1 | 0 |" in rows
    assert "| `x/test_missing.py` | not run | | | |" in rows


def test_the_hub_cache_is_laid_out_as_huggingface_hub_reads_it(tmp_path):
    subprocess.run([sys.executable, str(RELEASE / "hf_cache.py"), str(tmp_path)], check=True)
    repo = tmp_path / "models--Qwen--Qwen3-8B"
    snapshot = (repo / "refs" / "main").read_text()
    assert (repo / "snapshots" / snapshot / "config.json").is_file()


def test_the_update_cost_row_is_a_ratio_of_medians_with_its_interval(tmp_path):
    import json

    sys.path.insert(0, str(RELEASE))
    try:
        from update_cost import main
    finally:
        sys.path.remove(str(RELEASE))
    ascend = [300e-6 + i * 1e-6 for i in range(40)]  # median 319.5 us
    npugraph = [100e-6 + (i % 5) * 1e-6 for i in range(40)]  # median 102 us
    (tmp_path / "aclgraph.json").write_text(json.dumps({"vllm_ascend_update_seconds": ascend}))
    (tmp_path / "npugraph.json").write_text(json.dumps({"npugraph_update_seconds": npugraph}))
    assert main(["update_cost.py", str(tmp_path)]) == 0
    row = json.loads((tmp_path / "update-cost.json").read_text())
    assert abs(row["speedup_median"] - 319.5 / 102) < 1e-9
    low, high = row["speedup_95"]
    assert low <= row["speedup_median"] <= high and high - low < 0.5
    assert row["steps"] == {"vllm_ascend": 40, "npugraph": 40}
