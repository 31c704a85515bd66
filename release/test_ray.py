"""vLLM's Ray executor across two Ray nodes (release/run.sh runs this where the release's
environment has Ray: 0.30.0rc2's lock).

A user scaling vLLM out to several hosts starts a Ray cluster (``ray start --head``, then
``ray start --address=...`` on each further host) and passes
``distributed_executor_backend="ray"``: one Ray actor per rank, placed by the NPUs each node
offers.  Here the two nodes run on this machine (release/ray_cluster.py: one NPU each, so each
rank lands on its own node), started afresh for each engine with that engine's environment and
stopped by its processes' ids afterwards.  The engine is release/generate.py's, as a user
starts it (``vllm.LLM(model, dtype="bfloat16", FULL_DECODE_ONLY, distributed_executor_backend=
"ray")``, ``RAY_ADDRESS`` naming the cluster), on the Llama and its tensor-parallel requests:

* ``tp2-ray``: tensor parallel 2, a collective inside every captured graph;
* ``pp2-ray``: pipeline parallel 2, each rank capturing its own layers' graphs (vllm-ascend
  0.30 captures FULL graphs with pipeline parallelism; its intermediate tensors go between
  the ranks outside the graphs).

(``tp2-ray`` alone at ``CHECK_SCOPE=ci``.)  Each in eager mode and with npugraph's plugin: the
plugin's tokens are eager's, Hugging Face's float32 forward agrees, each rank's own Ray worker log holds npugraph's INFO line, both ranks
replayed and npugraph updated every graph step on each, the two ranks ran on different Ray
nodes, no run printed a traceback, and nothing of either cluster is left running.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm_ascend", reason="needs the release environment (release/env.sh)")

sys.path.insert(0, str(Path(__file__).parent))
import generate
import ray_cluster
from hf_reference import check_greedy_choices
from runs import check_scope, result_path

pytestmark = pytest.mark.skipif(
    not (Path(sys.executable).parent / "ray").is_file(), reason="a release environment without Ray"
)

# CI's check (CHECK_SCOPE=ci) runs tensor parallel alone, inside its time limit (each engine
# with its cluster takes about 85 s here); make release-check adds pipeline parallel
MODELS = ("tp2-ray", "pp2-ray") if check_scope() == "full" else ("tp2-ray",)
MODES = ("eager", "npugraph")
RANK_NAMES = {"tp2-ray": ("Worker_TP0", "Worker_TP1"), "pp2-ray": ("Worker_PP0", "Worker_PP1")}


def run_on_a_cluster(out_dir: Path, model: str, mode: str) -> dict[str, Any]:
    """``model`` in ``mode`` on a fresh two-node cluster, started with the engine's environment
    (Ray's workers are the raylets' children: what they read at interpreter start, the
    simulator's switch and release/ascend_site.py's counts folder, must be there); its result,
    with the nodes' sessions and what of them outlived the stop."""
    out = result_path(out_dir, model, mode)
    logs = out.with_suffix(".ray")
    with ray_cluster.cluster(Path(sys.executable).parent / "ray", generate.process_env(out_dir, out), logs) as c:
        generate.run_one(out_dir, model, mode, out, "Ray, two nodes", RAY_ADDRESS=c.address)
    result: dict[str, Any] = json.loads(out.read_text())
    result["left_running"] = ray_cluster.in_sessions(c.sessions)
    result["worker_logs"] = {p.name: p.read_text(errors="replace") for p in (logs / "ray-logs").glob("worker-*.out")}
    return result


@pytest.fixture(scope="module")
def results(generated_dir: Path) -> dict[tuple[str, str], dict[str, Any]]:
    for model in MODELS:
        generate.write_model(generated_dir / model)
    return {(model, mode): run_on_a_cluster(generated_dir, model, mode) for model in MODELS for mode in MODES}


@pytest.mark.parametrize("model", MODELS)
def test_npugraph_on_rays_workers_gives_eagers_tokens_and_hugging_faces(
    results: dict[tuple[str, str], dict[str, Any]], generated_dir: Path, model: str
) -> None:
    npg, eager = results[model, "npugraph"], results[model, "eager"]
    assert npg["tokens"] == eager["tokens"]
    check_greedy_choices(generated_dir / model, npg["prompts"], npg["tokens"], generate.MODELS[model].hf_tolerance)
    for mode in MODES:
        log = result_path(generated_dir, model, mode).with_suffix(".log").read_text()
        assert "Traceback" not in log, log[-4000:]
        assert not any("Traceback" in text for text in results[model, mode]["worker_logs"].values())


@pytest.mark.parametrize("model", MODELS)
def test_npugraph_is_active_in_every_ray_worker_each_on_its_own_node(
    results: dict[tuple[str, str], dict[str, Any]], model: str
) -> None:
    npg = results[model, "npugraph"]
    ranks = npg["ranks"]
    assert len(ranks) == 2, ranks
    assert all(r["graph_steps"] == r["npugraph_steps"] > 0 for r in ranks), ranks
    assert ranks[0]["graph_steps"] == ranks[1]["graph_steps"], ranks
    nodes = {r["ray_node"] for r in ranks}
    assert len(nodes) == 2 and "" not in nodes, f"the two ranks ran on one Ray node: {ranks}"
    # each rank's own worker log (Ray's worker-<id>-<job>-<pid>.out) holds its INFO line, its pid its own
    active = re.compile(r"\((Worker_\w+) pid=(\d+)\) INFO .*npugraph: active in this engine process \(pid (\d+)\)")
    seen = {}
    for name, text in npg["worker_logs"].items():
        for rank, pid, said in active.findall(text):
            assert pid == said == name.rsplit("-", 1)[1].removesuffix(".out"), (name, pid, said)
            seen[rank] = pid
    assert sorted(seen) == list(RANK_NAMES[model]), f"npugraph's INFO line per rank: {seen}"
    assert not any(r["npugraph_steps"] for r in results[model, "eager"]["ranks"])


@pytest.mark.parametrize("model", MODELS)
def test_every_cluster_was_stopped_by_its_processes_ids(
    results: dict[tuple[str, str], dict[str, Any]], model: str
) -> None:
    for mode in MODES:
        assert results[model, mode]["left_running"] == [], (mode, results[model, mode]["left_running"])
