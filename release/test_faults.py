"""Faults in a real engine end cleanly and say where (release/run.sh runs this in the
release environment; elsewhere it skips).

Each case (release/faults.py) starts vLLM's default engine with npugraph's plugin on the
release check's tiny Llama, as a user would, with one fault injected, and must end within
its time limit (never a hang) with:

* the caller getting vLLM's own engine error (the engine does not start, or it dies);
* the engine's log naming what failed: npugraph's graph (its namespace and key), the layer
  and the op;
* every token delivered before the fault being the eager run's (never a wrong token).

The kernel fault also runs under vLLM's model runner v2 where the release has one npugraph
serves (0.30.0rc2).
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm_ascend", reason="needs the release environment (release/env.sh)")

sys.path.insert(0, str(Path(__file__).parent))
import generate
from faults import CASES
from runs import engine_env, run_to_the_end, two_at_a_time

from npugraph.integrations.vllm import runner_v2

# a healthy run starts in about 90 s and serves in about 15 (docs/vllm-ascend-release.md)
LIMIT_S = 600
ERROR_WITHIN_S = 60

# what the engine's log must say, per case (the graph: npugraph's "<namespace>/<key>", the
# key vLLM's batch descriptor)
GRAPH = r"\[\w+/BatchDescriptor\(num_tokens=\d+[^\]]*\)\]"
LAYER = r"layer 'model\.layers\.\d+\.self_attn\.attn'"
SAYS = {
    "host-copy-in-capture": [
        r"CaptureFailed: capture of \w+/BatchDescriptor\(num_tokens=\d+.*\) failed (in|after) " + LAYER,
        r"npugraph_release::host_peek|host_peek",
    ],
    "kernel-fault-at-replay": [
        r"ReplayFault: replay of graph #\d+ " + GRAPH + r" failed at node \d+ \(_npu_paged_attention\S* at node",
        r"\[" + LAYER + r"\]\)\); the rest of the replay was cancelled: InjectedFault: AI core exception",
    ],
    # under vLLM's model runner v2 the key is its BatchExecutionDescriptor
    "kernel-fault-at-replay-v2": [
        r"ReplayFault: replay of graph #\d+ \[main/BatchExecutionDescriptor\(cg_mode=<CUDAGraphMode\.FULL: \d+>, "
        r"num_tokens=\d+[^\]]*\)\] failed at node \d+ \(_npu_paged_attention\S* at node",
        r"\[" + LAYER + r"\]\)\); the rest of the replay was cancelled: InjectedFault: AI core exception",
    ],
    "lost-event-record": [
        r"DeadlockError: .*would block forever",
        r"wait on <sim\.npu\.ExternalEvent #\d+> \[\w+/BatchDescriptor\(num_tokens=\d+[^\]]*\)/model\.layers\.\d+\.self_attn\.attn\], which is never "
        r"recorded \(it guards task group #\d+, _npu_paged_attention|npu_fused_infer_attention_score",
    ],
}


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get("NPUGRAPH_GENERATE_RESULTS")  # release/run.sh generated the eager run already
    if given:
        return Path(given)
    out = tmp_path_factory.mktemp("faults")
    generate.write_model(out / "llama")
    return out


@pytest.fixture(scope="module")
def eager_tokens(out_dir: Path) -> list[list[int]]:
    path = out_dir / "llama.eager.json"
    if not path.is_file():
        env = engine_env(out_dir / "vllm-cache")
        args = [sys.executable, generate.__file__, str(out_dir / "llama"), "eager", str(path)]
        subprocess.run(args, env=env, check=True, capture_output=True, timeout=LIMIT_S)
    return json.loads(path.read_text())["tokens"]


def _run(out_dir: Path, case: str) -> tuple[dict[str, Any], str]:
    out = out_dir / f"fault.{case}.json"
    args = [sys.executable, str(Path(__file__).parent / "faults.py"), str(out_dir / "llama"), case, str(out)]
    # a cache of its own: a compiled model with the fault's code must not serve other runs
    return run_to_the_end(args, out, engine_env(out_dir / f"vllm-cache.{case}", **CASES[case]), case, LIMIT_S)


# a case under the v2 runner is skipped before its fixtures run (the eager engine's tokens)
V2_SKIP = pytest.mark.skipif(
    not runner_v2.available(), reason="a vllm-ascend whose model runner v2 npugraph does not serve (0.23.0.post1's)"
)
RUN = [c for c in CASES if not c.endswith("-v2") or runner_v2.available()]


@pytest.fixture(scope="module")
def outcomes(out_dir: Path) -> dict[str, tuple[dict[str, Any], str] | Exception]:
    """Every case this release runs, two at a time (none is timed: a fault's seconds to the
    error have a bound ten times what they take), each case's result and log or what its run
    raised (a hang, an exit), each told to its own test."""
    got: dict[str, tuple[dict[str, Any], str] | Exception] = {}

    def one(case: str) -> None:
        try:
            got[case] = _run(out_dir, case)
        except Exception as exc:  # the case's own test says it; the others run on
            got[case] = exc

    two_at_a_time(functools.partial(one, c) for c in RUN)
    return got


@pytest.mark.parametrize("case", [pytest.param(c, marks=V2_SKIP) if c.endswith("-v2") else c for c in CASES])
def test_a_fault_ends_the_engine_cleanly_and_says_where(
    outcomes: dict[str, tuple[dict[str, Any], str] | Exception], eager_tokens: list[list[int]], case: str
) -> None:
    outcome = outcomes[case]
    if isinstance(outcome, Exception):
        raise outcome
    result, log = outcome
    error = result["error"]
    assert error is not None, f"{case}: the engine served on as if nothing happened"
    if case == "host-copy-in-capture":
        assert not result["started"] and error["type"] == "RuntimeError"
        assert "Engine core initialization failed" in error["message"]
    else:
        assert result["started"] and error["type"] == "EngineDeadError", error
        assert result["seconds_to_error"] < ERROR_WITHIN_S, result["seconds_to_error"]
        assert any(result["tokens"].values()), f"{case}: the fault came before serving began"
    for pattern in SAYS[case]:
        assert re.search(pattern, log), f"{case}: the log does not say {pattern!r}\n{log[-6000:]}"
    # what was delivered before the fault is what eager serves
    for rid, got in result["tokens"].items():
        assert got == eager_tokens[int(rid)][: len(got)], f"{case}: request {rid} got wrong tokens"
