"""The README's example runs as written."""

from __future__ import annotations

import runpy
from pathlib import Path


def test_quickstart_runs(capsys):
    runpy.run_path(str(Path(__file__).parent.parent / "examples" / "quickstart.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "'kernel': 'pa'" in out and "'kernel': 'fia'" in out
