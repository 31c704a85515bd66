"""MTP with two draft tokens, in a real engine (release/run.sh runs this in the release
environment; elsewhere it skips): the DeepSeek-V3 of release/generate.py's "mla-mtp" with
``num_speculative_tokens=2`` ("mla-mtp2").

* vllm-ascend's own graph mode serves it, as eager does: its draft's later steps update an
  FIA task captured for 3-token requests to one-token requests (another block-table size),
  which hardware takes and the simulator now does too;
* npugraph's plugin refuses it at start-up, saying why and what to do, within seconds: its
  draft graphs record one draft token's attention only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm_ascend", reason="needs the release environment (release/env.sh)")

sys.path.insert(0, str(Path(__file__).parent))
import generate
from hf_reference import check_greedy_choices
from runs import result_path

MODEL = "mla-mtp2"
LIMIT_S = 600
REFUSED_WITHIN_S = 120  # a healthy start takes about 20 s here
LOGIT_TOLERANCE = 0.15  # release/test_generate.py's


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get("NPUGRAPH_GENERATE_RESULTS")  # release/run.sh: beside the generation's results
    out = Path(given) if given else tmp_path_factory.mktemp("drafts")
    generate.write_model(out / MODEL)
    return out


def _run(out_dir: Path, mode: str) -> tuple[subprocess.CompletedProcess[str], Path, float]:
    out = result_path(out_dir, MODEL, mode)
    args = [sys.executable, generate.__file__, str(out_dir / MODEL), mode, str(out)]
    t0 = time.monotonic()
    try:
        done = subprocess.run(
            args, env=generate.process_env(out_dir, out), capture_output=True, text=True, timeout=LIMIT_S
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{MODEL} {mode}: no end within {LIMIT_S} s (a hang)\n{str(exc.stderr)[-4000:]}")
    out.with_suffix(".log").write_text(done.stdout + done.stderr)
    return done, out, time.monotonic() - t0


def test_vllm_ascends_own_graph_mode_serves_two_draft_tokens_as_eager_does(out_dir: Path) -> None:
    runs = {}
    for mode in ("eager", "aclgraph"):
        done, out, _ = _run(out_dir, mode)
        assert done.returncode == 0, f"{mode}: {(done.stdout + done.stderr)[-6000:]}"
        runs[mode] = json.loads(out.read_text())
    eager, graph = runs["eager"], runs["aclgraph"]
    assert [len(t) for t in eager["tokens"]] == [new for *_, new in generate.REQUESTS[MODEL]]
    assert graph["tokens"] == eager["tokens"]
    # the target's graph and the draft's, each step vllm-ascend ran as graphs, each updated
    assert graph["graph_steps"] and graph["draft_graph_steps"]
    assert len(graph["vllm_ascend_update_seconds"]) == graph["graph_steps"] + graph["draft_graph_steps"]
    check_greedy_choices(out_dir / MODEL, eager["prompts"], eager["tokens"], LOGIT_TOLERANCE)


def test_npugraphs_plugin_refuses_two_draft_tokens_at_start_up_saying_why(out_dir: Path) -> None:
    done, _, seconds = _run(out_dir, "npugraph")
    log = done.stdout + done.stderr
    assert done.returncode != 0, "the plugin served two draft tokens: its draft graphs record one"
    assert seconds < REFUSED_WITHIN_S, seconds
    assert "Engine core initialization failed" in log, log[-4000:]
    said = "ConfigError: npugraph's plugin captures a draft model's graph for one draft token"
    assert said in log and "num_speculative_tokens=2" in log and "NPUGRAPH_ENABLE=0" in log, log[-4000:]
