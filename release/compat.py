"""make compat's records and the README's matrix made from them (release/compat.sh).

    compat.py record JSON vllm VERSION VLLM_VERSION RESULTS RC SECONDS TIMES   a vllm-ascend release's
    compat.py record JSON sglang VERSION RESULTS RC SECONDS TIMES             an SGLang release's
    compat.py table JSON                                                       the matrix, as markdown

A record is read off what release/run.sh (or release/sglang/run.sh) left in the release's
results folder at CHECK_SCOPE=compat: its own tests' and the plugin test's JUnit XML
(release/table.py), each generation's result and log, and the failed steps it wrote into its
CHECK_TIMES file.  Each mode's
tokens are compared here with its reference's (``REFERENCE``); that they are Hugging Face's
choices is release/test_generate.py's, whose failure is a failed step.  Standard library only: it runs on
the machine's python3.
"""

from __future__ import annotations

import datetime
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from table import outcomes  # a sibling script, not a package

MODELS = ("llama", "qwen3")  # release/generate.py's COMPAT_MODELS, release/sglang/generate.py's MODELS
# each engine's modes (release/generate.py's and release/sglang/generate.py's MODES)
MODES = {"vllm": ("eager", "aclgraph", "npugraph"), "sglang": ("eager", "sglang", "npugraph")}
# vLLM's default compilation config (release/test_default_mode.py) and the v2 runner
# (release/test_runner_v2.py), each beside eager's Llama
OTHER_MODES = ("vllm-default", "vllm-default-npugraph", "aclgraph-v2", "npugraph-v2")
INSTALLED = re.compile(r"npugraph: vllm-ascend \(([^)]+)\) installed; replaced (.*?)(?:\\n|\"|$)", re.M)
REFUSED = re.compile(r"npugraph: vllm-ascend \S+ has no (.*?), which npugraph replaces")


def _tokens(generated: Path, model: str, mode: str) -> list | None:
    path = generated / f"{model}.{mode}.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text())["tokens"]


# what each mode's tokens are compared with: a graph mode with eager, npugraph's with the graph
# mode it stands in for (the plugin's promise: identical tokens; the Qwen3's graph modes run
# vllm-ascend's fused q/k-norm + rope kernel, not eager's ops, so theirs may differ from eager's,
# and release/test_generate.py holds each mode to Hugging Face's choices)
REFERENCE = {
    "aclgraph": "eager",
    "sglang": "eager",
    "npugraph": None,  # the engine's own graph mode: aclgraph or sglang
    "vllm-default": "eager",
    "vllm-default-npugraph": "vllm-default",
    "aclgraph-v2": "eager",
    "npugraph-v2": "aclgraph-v2",
}


def _compared(generated: Path, model: str, mode: str, engine: str) -> str:
    """What ``mode``'s run of ``model`` gave: ``ran`` (eager), ``same as REF``, ``differs from REF``
    or ``no result``."""
    tokens = _tokens(generated, model, mode)
    if tokens is None:
        return "no result"
    if mode == "eager":
        return "ran"
    reference = REFERENCE[mode] or MODES[engine][1]
    return f"{'same as' if tokens == _tokens(generated, model, reference) else 'differs from'} {reference}"


def _plugin(engine: str, generated: Path) -> dict:
    """What npugraph did in the Llama's npugraph run: under vLLM, its INFO line's vllm-ascend
    generation and count of names replaced, or the names its refusal line says are missing;
    under SGLang (whose log shows no INFO line), the steps npugraph updated."""
    if engine == "sglang":
        result = generated / "llama.npugraph.json"
        steps = json.loads(result.read_text()).get("npugraph_steps", 0) if result.is_file() else 0
        return {"npugraph_steps": steps}
    log = generated / "llama.npugraph.log"
    text = log.read_text(errors="replace") if log.is_file() else ""
    found = INSTALLED.search(text)
    refused = REFUSED.search(text)
    return {
        "generation": found.group(1) if found else None,
        "replaced": len(found.group(2).split(", ")) if found else 0,
        "missing": refused.group(1).split(", ") if refused else [],
    }


def _counts(results: Path) -> dict:
    by_file = outcomes(results)
    return {
        "files": len(by_file),
        **{k: sum(c[k] for c in by_file.values()) for k in ("tests", "passed", "failed", "skipped")},
    }


def record(
    out: Path, engine: str, version: str, results: Path, rc: int, seconds: int, times: Path, vllm: str | None = None
) -> None:
    """Write ``engine``'s (``vllm``: a vllm-ascend release, beside vLLM ``vllm``; ``sglang``)
    ``version`` record into ``out``, keeping the other releases' records."""
    generated = results / "generate" if engine == "vllm" else results
    failed = (
        [ln.strip() for ln in times.read_text().splitlines() if ln.startswith("FAILED:")] if times.is_file() else []
    )
    entry = {
        "date": datetime.date.today().isoformat(),
        "status": "passed" if rc == 0 else "failed",
        "minutes": round(seconds / 60, 1),
        "failed_steps": failed,
        "plugin_test": _counts(results / "plugin"),
        "generation": {m: {mode: _compared(generated, m, mode, engine) for mode in MODES[engine]} for m in MODELS},
        "plugin": _plugin(engine, generated),
    }
    if engine == "vllm":
        entry["vllm"] = vllm
        entry["own_tests"] = _counts(results)
        entry["llama_other_modes"] = {mode: _compared(generated, "llama", mode, engine) for mode in OTHER_MODES}
    data = json.loads(out.read_text()) if out.is_file() else {}
    releases = data.setdefault(engine, {})
    releases[version] = entry
    data[engine] = dict(sorted(releases.items(), key=lambda kv: _order(kv[0])))
    out.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")


def _order(version: str) -> tuple:
    """0.30.0rc1 before 0.30.0rc2 before 0.30.0; 0.23.0.post1 after 0.23.0."""
    parts = re.findall(r"\d+|[a-z]+", version)
    # a release's end sorts between its rc (-1) and its post (1)
    return (*((int(p), "") if p.isdigit() else (-1 if p == "rc" else 1, p) for p in parts), (0, ""))


def _cell(modes: dict[str, str]) -> str:
    """✓ where a mode ran and gave its reference's tokens, ``≠ REF`` where not, — where it did not run."""

    def short(value: str) -> str:
        if value in ("ran",) or value.startswith("same as"):
            return "✓"
        return "—" if value == "no result" else "≠ " + value.removeprefix("differs from ")

    return " / ".join(short(v) for v in modes.values())


def _run(r: dict) -> str:
    return f"{r['date']}, {r['status']}, {r['minutes']} min"


def _passed(counts: dict) -> str:
    return f"{counts['passed']} / {counts['tests']}"


def table(data: dict) -> str:
    """The README's matrix: a row per vllm-ascend release, then a row per SGLang release."""
    lines = [
        "| vllm-ascend (vLLM) | run | own graph-path tests passed / collected | plugin test | Llama: eager, "
        "ACL graph (= eager), npugraph (= ACL graph) | Qwen3: the same | Llama: vLLM's default mode (= eager, "
        "npugraph = it); v2 runner (the same) | plugin: vllm-ascend generation, names replaced (missing) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for version, r in data.get("vllm", {}).items():
        other = r["llama_other_modes"]
        default = _cell({k: other[k] for k in ("vllm-default", "vllm-default-npugraph")})
        v2 = {k: other[k] for k in ("aclgraph-v2", "npugraph-v2")}
        served = "not served" if set(v2.values()) == {"no result"} else _cell(v2)
        plugin = r["plugin"]
        missing = f" (missing {', '.join(plugin['missing'])})" if plugin["missing"] else ""
        lines.append(
            f"| {version} ({r['vllm']}) | {_run(r)} | {_passed(r['own_tests'])} ({r['own_tests']['files']} files) "
            f"| {_passed(r['plugin_test'])} | {_cell(r['generation']['llama'])} | {_cell(r['generation']['qwen3'])} "
            f"| {default}; {served} | {plugin['generation']}, {plugin['replaced']}{missing} |"
        )
    if data.get("sglang"):
        lines += [
            "",
            "| SGLang | run | plugin test | Llama: eager, SGLang's graphs (= eager), npugraph (= SGLang's) "
            "| Qwen3: the same | steps npugraph updated (Llama) |",
            "|---|---|---|---|---|---|",
        ]
        for version, r in data["sglang"].items():
            lines.append(
                f"| {version} | {_run(r)} | {_passed(r['plugin_test'])} | {_cell(r['generation']['llama'])} "
                f"| {_cell(r['generation']['qwen3'])} | {r['plugin']['npugraph_steps']} |"
            )
    return "\n".join(lines)


USAGE = "usage:\n" + "\n".join(__doc__.splitlines()[2:5])


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[1] == "table":
        print(table(json.loads(Path(argv[2]).read_text())))
        return 0
    args = argv[2:] if argv[1:2] == ["record"] else []
    if len(args) == 8 and args[1] == "vllm":
        out, engine, version, vllm, results, rc, seconds, times = args
    elif len(args) == 7 and args[1] == "sglang":
        (out, engine, version, results, rc, seconds, times), vllm = args, None
    else:
        print(USAGE, file=sys.stderr)
        return 2
    record(Path(out), engine, version, Path(results), int(rc), int(seconds), Path(times), vllm)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
