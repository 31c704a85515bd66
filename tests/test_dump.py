"""Capture manifests, validation, diff, DOT output, and post-mortems."""

from __future__ import annotations

import copy
import json
import os

import pydot
import pytest
import torch

import npusim as sim
from npugraph import AttentionMetadata
from npugraph.cli import main
from npugraph.dump.cli import inspect, to_dot
from npugraph.dump.manifest import SCHEMA_VERSION, load_manifest
from npugraph.dump.validate import diff_manifests, validate_manifest
from npugraph.errors import GraphDeadlock, MetadataError
from npugraph.models import Workload

from .helpers import build, run


@pytest.fixture
def captured():
    cfg, rt, model, eng = build(sizes=[1, 4, 8], layers=3)
    run(eng, cfg, 12, seed=2)
    return cfg, rt, model, eng


def test_manifest_describes_what_the_test_knows_independently(tmp_path):
    """Every field checked against what the test itself did, not against the runtime's records."""
    cfg, rt, model, eng = build(sizes=[1, 4, 8], layers=3)
    last: dict[int, object] = {}
    count: dict[int, int] = {}
    for b in Workload(cfg, eng.sizes, seed=2).steps(12):
        eng.step(b)
        last[b.size] = b
        count[b.size] = count.get(b.size, 0) + 1
    path = tmp_path / "m.json"
    rt.save_manifest(str(path))
    doc = load_manifest(str(path))
    assert doc["schema_version"] == SCHEMA_VERSION and doc["device"] == "sim"
    assert doc["max_model_len"] == cfg.max_model_len == 256
    keys = doc["namespaces"]["main"]["keys"]
    assert [k["tokens"] for k in keys] == [1, 4, 8] and [k["batch"] for k in keys] == [1, 4, 8]
    assert doc["namespaces"]["main"]["configured_sizes"] == [1, 4, 8]
    assert doc["totals"]["graphs"] == 3 and doc["totals"]["tasks"] == 9
    assert doc["totals"]["pool_bytes"] == sim.pool_bytes(rt.manager.pool) > 0
    layer_names = [layer.attn.layer_name for layer in model.layers]
    for k in keys:
        size = k["tokens"]
        assert k["kernel"] == ("pa" if size in (1, 4) else "fia_sink"), "the static policy: PA for 1-4"
        assert k["replays"] == k["steps"] == count.get(size, 0)
        assert k["output_bytes"] >= size * cfg.vocab_size * 4, "float32 logits of every padded row"
        assert [t["layer"] for t in k["tasks"]] == layer_names
        ws_need = k["workspace"]["bytes"]
        for t, layer in zip(k["tasks"], model.layers):
            name = "key_cache" if t["op"] == "pa" else "key"
            arg = t["args"][name]
            assert arg["address"] == layer.k_cache.data_ptr(), "the model's own cache, by address"
            assert arg["bytes"] == layer.k_cache.numel() * layer.k_cache.element_size() and arg["dtype"] == "bfloat16"
            assert t["workspace_required"] <= ws_need
            assert t["host_at_capture"] == (
                {"context_lens": [1] * size} if t["op"] == "pa" else {}  # tiling sink: no host lengths captured
            )
            assert (t["lens_on_device"] is None) == (t["op"] == "pa") and (t["task_group"] is None) == (t["op"] != "pa")
            b = last.get(size)
            if b is None:
                assert t["last_update"] is None
                continue
            mine = b.meta.seq_lens.tolist() + [0] * (size - b.num_reqs)  # padding requests: 0
            host = t["last_update"]["host"]
            assert (host.get("context_lens") or host["actual_seq_kvlen"]) == mine
            assert t["num_reqs"] == b.num_reqs
        if size in last:
            rec = k["trace"][-1]
            assert rec["step"] == count[size] and rec["groups"]["default"]["num_reqs"] == last[size].num_reqs


def test_validate_passes_on_a_healthy_capture(captured):
    assert validate_manifest(captured[1].manifest()) == []


def _broken(doc, how):
    d = copy.deepcopy(doc)
    keys = d["namespaces"]["main"]["keys"]
    if how == "layers":
        keys[1]["tasks"][0]["layer"] = keys[1]["tasks"][1]["layer"]
    elif how == "handles":
        keys[1]["tasks"][1]["task_group"] = keys[0]["tasks"][0]["task_group"]
    elif how == "events":
        keys[2]["tasks"][0]["event"] = keys[0]["tasks"][2]["event"]  # another graph's (sharing is per graph)
    elif how == "lengths":
        t = keys[0]["tasks"][0]
        name = next(iter(t["host_at_capture"]))
        t["host_at_capture"][name] = [d["max_model_len"] + 1]
    elif how == "workspace":
        keys[2]["tasks"][1]["workspace_required"] = 10**12
    elif how == "padding":
        rec = next(k for k in keys if k["trace"])["trace"][-1]
        g = rec["groups"]["default"]
        g["num_reqs"] = 0
        g["kv_lens"] = [5] * len(g["kv_lens"])
    elif how == "sorted":
        keys.reverse()
    elif how == "coverage":
        d["namespaces"]["main"]["configured_sizes"] = [1, 2, 4, 8]
    return d


@pytest.mark.parametrize(
    ("how", "rule"),
    [
        ("layers", "one-task-per-layer"),
        ("handles", "unique-handles"),
        ("events", "unique-events"),
        ("lengths", "lengths"),
        ("workspace", "workspace"),
        ("padding", "padding-zero"),
        ("sorted", "keys-sorted"),
        ("coverage", "keys-cover-sizes"),
    ],
)
def test_validate_reports_each_broken_rule(captured, how, rule, tmp_path):
    doc = _broken(captured[1].manifest(), how)
    violations = validate_manifest(doc)
    assert rule in {v.rule for v in violations}, violations
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    assert main(["dump", "validate", str(path)]) == 1


def test_diff_finds_a_changed_kernel_and_a_changed_shape(captured, tmp_path):
    a = captured[1].manifest()
    b = copy.deepcopy(a)
    kb = b["namespaces"]["main"]["keys"]
    kb[0]["kernel"] = "fia"
    kb[1]["tasks"][2]["args"]["query"]["shape"] = [4, 4, 128]
    lines = diff_manifests(a, b)
    assert any("main/1: kernel pa -> fia" in x for x in lines)
    assert any("main/4 task 2" in x and "query" in x and "128" in x for x in lines)
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    assert main(["dump", "diff", str(pa), str(pb)]) == 1
    assert main(["dump", "diff", str(pa), str(pa)]) == 0


def test_dot_output_parses(captured):
    dot = to_dot(captured[1].manifest(), "4")
    graphs = pydot.graph_from_dot_data(dot)
    assert graphs and len(graphs[0].get_subgraphs()) == 4  # update stream + 3 task groups
    assert "wait event" in dot and "task group #" in dot


def test_deadlock_writes_a_postmortem_that_inspect_reads(tmp_path, capsys):
    cfg, rt, model, eng = build(sizes=[2], layers=2, postmortem_dir=str(tmp_path), order="replay-first")
    rt.replay(2)  # the update never comes
    with pytest.raises(GraphDeadlock) as info:
        rt.synchronize()
    path = info.value.postmortem
    assert path is not None and path in str(info.value)
    doc = load_manifest(path)
    assert doc["error"]["type"] == "GraphDeadlock"
    text = inspect(doc, None)
    assert "POST-MORTEM: GraphDeadlock" in text and "main.layers.0.attn" in text
    assert main(["dump", "inspect", path, "--key", "2"]) == 0
    assert "main.layers.1.attn" in capsys.readouterr().out


def test_failed_update_writes_a_postmortem(tmp_path):
    cfg, rt, model, eng = build(sizes=[2], layers=2, postmortem_dir=str(tmp_path))
    bad = AttentionMetadata(
        seq_lens=torch.tensor([10**6], dtype=torch.int32), block_table=torch.zeros(1, 16, dtype=torch.int32)
    )
    with pytest.raises(MetadataError, match="post-mortem written to") as info:
        rt.update(2, {"default": bad})
    assert load_manifest(info.value.postmortem)["error"]["type"] == "MetadataError"


def test_an_engines_runtime_writes_its_postmortems_beside_its_capture_report(tmp_path, monkeypatch):
    """The plugins' runtimes (integrations/common.runtime_from_env) write a failed step's
    post-mortem where the capture report goes: ``$NPUGRAPH_REPORT_DIR``, else the temporary
    directory; one file per process and failure (docs/multi-host.md)."""
    import tempfile

    from npugraph.integrations.common import report_path, runtime_from_env

    monkeypatch.setenv("NPUGRAPH_REPORT_DIR", str(tmp_path))
    rt = runtime_from_env(512, "sim")
    assert rt.postmortem.folder == str(tmp_path) == os.path.dirname(report_path())
    monkeypatch.delenv("NPUGRAPH_REPORT_DIR")
    assert runtime_from_env(512, "sim").postmortem.folder == tempfile.gettempdir()
