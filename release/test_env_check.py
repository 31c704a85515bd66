"""The release environment's self-check stops the case that broke CI on 2026-12-03.

Then a fresh build resolved vLLM 0.23's loose transformers requirement to a newer transformers,
which brought `kernels` 0.19.1; pinning transformers 5.5.4 afterwards left that `kernels` behind,
and transformers 5.5.4 fails at import with any `kernels` from 0.13 on.  Every test then failed
at `import transformers`, after a build that said nothing.

Here: the release lock comes from one resolution and holds no such `kernels`; and in a scratch
environment layered on the release's, with `kernels` 0.19.1 installed, both halves of the check
(uv's consistency check, the imports) stop with one line naming `kernels`.  Run by
release/run.sh with the release environment's interpreter.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
RELEASE_SITE = sysconfig.get_paths()["purelib"]  # this interpreter is the release environment's


def _envs():
    spec = importlib.util.spec_from_file_location("envs_tool", ROOT / "envs" / "envs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_release_lock_holds_no_kernels_that_transformers_5_5_4_cannot_import():
    pins = _envs().pins(ROOT / "envs" / "release.lock")
    assert pins["transformers"] == "5.5.4"
    assert "kernels" not in pins or Version(pins["kernels"]) < Version("0.13")


@pytest.fixture(scope="module")
def with_bad_kernels(tmp_path_factory):
    """A scratch environment that sees the release's site-packages (and runs its .pth files), with
    kernels 0.19.1 of its own in front."""
    envs = _envs()
    venv = tmp_path_factory.mktemp("bad-kernels") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(site, "release.pth").write_text(f"import site; site.addsitedir({RELEASE_SITE!r})\n")
    subprocess.run(
        [envs.uv(), "pip", "install", "-q", "--python", str(python), "--no-deps", "kernels==0.19.1"], check=True
    )
    return envs, venv


def test_the_consistency_check_names_kernels(with_bad_kernels):
    envs, venv = with_bad_kernels
    with pytest.raises(envs.EnvError) as stop:
        envs.check_consistency("release", venv, envs.spec("release"))
    line = str(stop.value)
    assert "\n" not in line and "kernels" in line.split(":")[1], line


def test_the_import_check_names_kernels_and_what_to_do(with_bad_kernels):
    envs, venv = with_bad_kernels
    with pytest.raises(envs.EnvError) as stop:
        envs.check_imports("release", venv, envs.spec("release"))
    line = str(stop.value)
    assert "\n" not in line
    assert "fails in kernels 0.19.1" in line and "Either a revision or a version" in line, line
    assert "envs/release.toml" in line and "make lock" in line


def test_the_command_prints_one_line_and_exits_1(with_bad_kernels):
    _, venv = with_bad_kernels
    done = subprocess.run(
        [sys.executable, str(ROOT / "envs" / "envs.py"), "check", "release", str(venv)],
        capture_output=True,
        text=True,
        env={**os.environ},
    )
    assert done.returncode == 1
    assert done.stdout == "" and len(done.stderr.splitlines()) == 1 and "kernels" in done.stderr
