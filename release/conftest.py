"""What the release checks' tests share (release/test_*.py, run by release/run.sh)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def generated_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """release/run.sh's generation folder (``NPUGRAPH_GENERATE_RESULTS``: its eager runs are
    there already), or a folder of this module's own."""
    given = os.environ.get("NPUGRAPH_GENERATE_RESULTS")
    return Path(given) if given else tmp_path_factory.mktemp("generate")
