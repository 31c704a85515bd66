"""The CLI turns every bad input into one line on stderr and a non-zero exit, never a traceback."""

from __future__ import annotations

import json

import pydot
import pytest

from npugraph.cli import main


def _one_line_error(capsys, code: int, match: str) -> str:
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith("npugraph: error: ") and match in err, err
    return err


ARGPARSE_CASES = [
    (["demo", "--steps", "-5"], "expected a positive integer, got -5"),
    (["demo", "--steps", "0"], "expected a positive integer, got 0"),
    (["demo", "--layers", "0"], "--layers"),
    (["demo", "--block-size", "-1"], "--block-size"),
    (["demo", "--max-model-len", "abc"], "expected a positive integer, got 'abc'"),
    (["demo", "--sizes", "0,2"], "sizes must be positive integers"),
    (["demo", "--heads", "0"], "--heads"),
    (["demo", "--dtype", "int8"], "invalid choice: 'int8'"),
    (["demo", "--json", "/nonexistent-dir/x.json"], "folder /nonexistent-dir does not exist"),
    (["bench", "--repeats", "0"], "--repeats"),
    (["policy", "measure", "--margin", "2", "--out", "p.json"], "expected a fraction in [0, 1), got 2.0"),
    (["policy", "show", "/nonexistent.json"], "/nonexistent.json: no such file"),
    (["selftest", "--device", "gpu"], "invalid choice: 'gpu'"),
    (["demo", "--device", "tpu"], "invalid choice: 'tpu'"),
]


@pytest.mark.parametrize(("argv", "match"), ARGPARSE_CASES, ids=[" ".join(a) for a, _ in ARGPARSE_CASES])
def test_bad_arguments_are_refused_by_the_parser(argv, match, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err


SHAPE_CASES = [
    (["--heads", "3", "--kv-heads", "2"], "layer 'main.layers.0.attn': num_heads (3) must be a positive multiple"),
    (["--head-size", "3"], "head_size must be even"),
    (["--max-model-len", "2"], "max_model_len must be at least 3"),
    (["--sizes", "1,100000"], "--sizes 100000 exceeds --num-blocks 512"),
]


@pytest.mark.parametrize(("argv", "match"), SHAPE_CASES, ids=[" ".join(a) for a, _ in SHAPE_CASES])
def test_demo_refuses_shapes_it_cannot_run_before_capturing(argv, match, capsys):
    # refused when the model and workload are built, not by a kernel at capture nor mid-run
    code = main(["demo", "--no-progress", "--steps", "1", *argv])
    err = _one_line_error(capsys, code, match)
    assert "capture" not in err


def test_output_paths_are_checked_before_any_work(tmp_path, capsys):
    target = tmp_path / "victim"
    target.write_text("keep")
    link = tmp_path / "out.json"
    link.symlink_to(target)
    for argv in (
        ["demo", "--dump", str(link)],
        ["demo", "--json", str(tmp_path)],
        ["policy", "measure", "--out", str(link)],
    ):
        with pytest.raises(SystemExit):
            main(argv)
        err = capsys.readouterr().err
        assert "symbolic link" in err or "is a directory" in err
    assert target.read_text() == "keep"


def test_missing_policy_file(capsys, tmp_path):
    code = main(["demo", "--steps", "1", "--policy", str(tmp_path / "missing.json"), "--no-progress"])
    _one_line_error(capsys, code, "cannot read kernel policy")


def test_bad_policy_spec(capsys):
    code = main(["demo", "--steps", "1", "--policy", "pa-sizes=x", "--no-progress"])
    _one_line_error(capsys, code, "--policy 'pa-sizes=x'")


def test_policy_for_another_dtype_is_refused_naming_what_differs(capsys, tmp_path):
    path = tmp_path / "p.json"
    assert (
        main(
            [
                "policy",
                "measure",
                "--sizes",
                "1",
                "--repeats",
                "1",
                "--max-model-len",
                "64",
                "--dtype",
                "float16",
                "--out",
                str(path),
            ]
        )
        == 0
    )
    capsys.readouterr()
    code = main(
        ["demo", "--steps", "1", "--sizes", "1", "--policy", str(path), "--no-progress", "--max-model-len", "64"]
    )
    _one_line_error(capsys, code, "dtype: file has 'float16', this model has 'bfloat16'")


def test_the_readme_measure_then_use_flow_works(capsys, tmp_path):
    """`policy measure` defaults to the demo's dtype, so its file fits the demo."""
    path = tmp_path / "p.json"
    assert (
        main(["policy", "measure", "--sizes", "1,2", "--repeats", "1", "--max-model-len", "64", "--out", str(path)])
        == 0
    )
    assert (
        main(
            [
                "demo",
                "--steps",
                "3",
                "--sizes",
                "1,2",
                "--policy",
                str(path),
                "--no-progress",
                "--max-model-len",
                "64",
                "--layers",
                "2",
            ]
        )
        == 0
    )


@pytest.mark.parametrize(
    ("command", "doc", "match"),
    [
        ("inspect", None, "cannot read manifest"),
        ("validate", None, "cannot read manifest"),
        ("inspect", {"schema_version": 1}, "not a capture manifest: 'device' is missing"),
        ("validate", {"schema_version": 1}, "not a capture manifest"),
        ("inspect", [1], "the document is a JSON list"),
        ("dot", {"schema_version": 2}, "written by a newer npugraph (schema_version 2; this one reads 1)"),
        ("dot", {"schema_version": 0}, "schema_version is 0, expected 1"),
    ],
)
def test_dump_on_bad_files(command, doc, match, capsys, tmp_path):
    path = tmp_path / "m.json"
    if doc is not None:
        path.write_text(json.dumps(doc))
    argv = ["dump", command, str(path)] + (["--key", "8"] if command == "dot" else [])
    _one_line_error(capsys, main(argv), match)


def test_dump_inspect_of_a_missing_key_and_dot_escaping(capsys, tmp_path):
    path = tmp_path / "m.json"
    assert main(["demo", "--steps", "2", "--layers", "1", "--sizes", "2", "--no-progress", "--dump", str(path)]) == 0
    capsys.readouterr()
    _one_line_error(capsys, main(["dump", "inspect", str(path), "--key", "99"]), "no key '99' in the manifest")
    doc = json.loads(path.read_text())
    doc["namespaces"]["main"]["keys"][0]["tasks"][0]["layer"] = 'evil"];\nx -> y [label="'
    path.write_text(json.dumps(doc))
    assert main(["dump", "dot", str(path), "--key", "2"]) == 0
    out = capsys.readouterr().out
    (graph,) = pydot.graph_from_dot_data(out)
    nodes = {n.get_name(): n for g in [graph, *_subgraphs(graph)] for n in g.get_nodes()}
    assert "evil" in nodes["task0"].get("label"), "the name stays inside its label"
    assert not any(e.get_source() == "x" for g in [graph, *_subgraphs(graph)] for e in g.get_edges())


def _subgraphs(g):
    for sg in g.get_subgraphs():
        yield sg
        yield from _subgraphs(sg)


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.startswith("npugraph 0.")
