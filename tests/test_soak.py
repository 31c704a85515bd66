"""The soak's own logic (release/soak.py, release/soak_probe.py), without a server: the
requests it plans, the flatness and variant judgements it makes, and the probe's counting.
The soak itself runs servers (make soak)."""

from __future__ import annotations

import json
import struct
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

RELEASE = Path(__file__).parent.parent / "release"
# a report cut down to what the plot reads (its series made up: tests/data/soak-small.json's note)
SMALL_REPORT = Path(__file__).parent / "data" / "soak-small.json"


@pytest.fixture(scope="module")
def soak():
    sys.path.insert(0, str(RELEASE))
    try:
        import soak

        yield soak
    finally:
        sys.path.remove(str(RELEASE))


@settings(max_examples=200, deadline=None)
@given(worker=st.integers(0, 15), n=st.integers(0, 10_000))
def test_a_planned_request_fits_the_context_and_is_the_same_in_every_mode(soak, worker, n):
    r = soak.plan(worker, n, context=1024, vocab=1024)
    assert r == soak.plan(worker, n, context=1024, vocab=1024)  # every mode is sent the same request
    assert len(r.prompt) >= 1 and len(r.prompt) + r.max_tokens < 1024
    assert 1 <= r.max_tokens <= soak.MAX_NEW
    assert all(1 <= t < 1024 for t in r.prompt)
    assert r.walk_after == 0 or (r.stream and r.walk_after < r.max_tokens)


def test_the_plan_runs_from_one_token_to_near_the_context_across_pages_from_a_pool(soak):
    lengths = [len(soak.pooled_prompt(i, 1024, 1024)[0]) for i in range(soak.POOL)]
    assert min(lengths) <= 4 and max(lengths) > 800
    assert sum(length > 128 for length in lengths) > soak.POOL // 5  # crossing SGLang's 128-token page
    drawn = {soak.plan(w, n, 1024, 1024).prompt_index for w in range(16) for n in range(20)}
    assert drawn == set(range(soak.POOL)), "steady traffic: every prompt of the pool, again and again"
    requests = [soak.plan(w, n, 1024, 1024) for w in range(16) for n in range(100)]
    streamed = sum(r.stream for r in requests)
    assert 0.4 < streamed / len(requests) < 0.6
    assert 0 < sum(bool(r.walk_after) for r in requests) < streamed / 5


def test_the_warm_up_is_one_prompt_of_each_length_none_a_prefix_of_another_nor_of_the_pools(soak):
    warm = soak.sweep(context=1024, vocab=1024)
    assert [len(r.prompt) for r in warm] == list(range(soak.SWEEP_TOP, 0, -1))  # longest first
    assert all(r.max_tokens == 1 and not r.stream and not r.walk_after for r in warm)
    assert all(1 <= t < 1024 for r in warm for t in r.prompt)
    # a shared first block would let the engine's prefix cache shorten a prefill, and the
    # shape it runs would not be the length's own
    firsts = [tuple(r.prompt[:8]) for r in warm if len(r.prompt) >= 8]
    pool = {tuple(soak.pooled_prompt(i, 1024, 1024)[0][:8]) for i in range(soak.POOL)}
    assert len(set(firsts)) == len(firsts) and not set(firsts) & pool
    assert len(soak.sweep(context=200, vocab=1024)) == 198  # below a short context


def _samples(n, rss=lambda i: 1000, device=lambda i: 500, graphs=lambda i: 4):
    return [
        {
            "t": float(i),
            "rss": rss(i),
            "host_rss": rss(i),
            "device_bytes": device(i),
            "graphs": graphs(i),
            "npugraph_graphs": graphs(i),
            "external_events": 8,
            "streams": 3,
            "forwards": {"FULL:4": i},
        }
        for i in range(n)
    ]


def test_flat_memory_and_counts_pass_and_growth_or_a_recapture_fails(soak):
    def judged(samples):
        run = {
            "summary": {"failed": [], "completed": 5},
            "flat": soak.flatness(samples, since=50.0),
            "stopped_by_sigint": True,
            "npugraph_raised": [],
        }
        choices = {"beyond_tolerance": [], "exact_share": 1.0}
        return soak.failures("vllm", run, choices)

    assert judged(_samples(100)) == []
    # growing 2% over the second half: a leak
    leak = judged(_samples(100, rss=lambda i: 1000 + max(0, i - 50) * 0.4))
    assert leak == ["vllm: host_rss grew 1.96% over the second half"]
    # a server's memory jumping between two levels 4% apart as requests come and go, the
    # half's first samples on the lower, its last on the upper: no growth (its line is level)
    jumping = soak.flatness(_samples(100, rss=lambda i: 1040 if i % 2 else 1000), since=50.0)
    assert jumping["host_rss"]["tenths_medians"] == [1000, 1040]
    assert judged(_samples(100, rss=lambda i: 1040 if i % 2 else 1000)) == []
    # a step up that stays (memory taken and kept) is growth, wherever in the half it comes
    assert judged(_samples(100, rss=lambda i: 1000 if i < 80 else 1030))
    # warm-up growth in the first half does not count
    assert judged(_samples(100, device=lambda i: 100 + min(i, 40) * 10)) == []
    recapture = judged(_samples(100, graphs=lambda i: 4 if i < 80 else 5))
    assert recapture == [
        "vllm: graphs changed over the second half: [4, 5]",
        "vllm: npugraph_graphs changed over the second half: [4, 5]",
    ]
    assert judged(_samples(12)) == ["vllm: 0 samples in the second half: too few to judge"]


def test_a_wrong_token_or_a_failed_request_fails_the_soak(soak):
    run = {
        "summary": {"failed": ["3.4: error: APIConnectionError: x"], "completed": 5},
        "flat": soak.flatness(_samples(100), since=50.0),
        "stopped_by_sigint": False,
        "npugraph_raised": ["npugraph.errors.ReplayFault: x"],
        "warm_up": {"requests": 768, "seconds": 60.0, "failed": ["warm.700: error: BadRequestError: x"]},
    }
    why = soak.failures("sglang", run, {"beyond_tolerance": ["1.2: 0.400"], "exact_share": 0.9})
    assert len(why) == 6
    assert "warm-up requests failed" in why[0] and "requests failed" in why[1]
    assert "0.1 of Hugging Face's best" in why[2] and "under 0.95" in why[3]
    assert "SIGINT" in why[4] and "npugraph's code" in why[5]


def test_variants_count_texts_that_differ_from_eagers_and_the_most_of_one_prompt(soak):
    def req(index, tokens, ended="length"):
        return soak.Request(
            key="k",
            prompt=[1],
            max_tokens=2,
            stream=False,
            walk_after=0,
            tokens=tokens,
            ended=ended,
            prompt_index=index,
        )

    by_mode = {
        "eager": [req(0, [1, 2]), req(1, [3, 4]), req(0, [1, 2])],
        "sglang": [req(0, [1, 2]), req(1, [3, 9]), req(1, [3, 4]), req(2, [5], ended="walked away")],
        "npugraph": [req(0, [1, 7]), req(1, [3, 4]), req(3, [8, 8])],
    }
    out = soak.variants(by_mode)
    assert out["eager"] == {
        "prompts": 2,
        "most_variants_of_one_prompt": 1,
        "compared_with_eager": 3,
        "differ_from_eager": 0,
    }
    assert out["sglang"] == {
        "prompts": 2,
        "most_variants_of_one_prompt": 2,
        "compared_with_eager": 3,
        "differ_from_eager": 1,
    }
    assert out["npugraph"] == {
        "prompts": 3,
        "most_variants_of_one_prompt": 1,
        "compared_with_eager": 2,
        "differ_from_eager": 1,
    }


def test_throughput_and_time_per_output_token_come_from_completed_streams(soak):
    streamed = soak.Request(key="0.0", prompt=[1], max_tokens=3, stream=True, walk_after=0)
    streamed.tokens, streamed.chunk_times, streamed.ended = [1, 2, 3], [10.0, 10.1, 10.3], "length"
    whole = soak.Request(key="0.1", prompt=[1], max_tokens=2, stream=False, walk_after=0)
    whole.tokens, whole.chunk_times, whole.ended = [4, 5], [11.0], "length"
    left = soak.Request(key="0.2", prompt=[1], max_tokens=9, stream=True, walk_after=2)
    left.tokens, left.ended = [6], "walked away"
    s = soak.summarize([streamed, whole, left], seconds=2.0)
    assert s["completed"] == 2 and s["walked_away"] == 1 and s["failed"] == []
    assert s["output_tokens_per_s"] == 3.0
    assert s["tpot_ms"] == {"p50": 150.0, "p99": 150.0, "n": 1}


def test_the_engine_process_is_the_one_with_the_most_forward_passes(soak, tmp_path):
    (tmp_path / "samples-1.jsonl").write_text(json.dumps({"t": 1.0, "forwards": {}}) + "\n")
    rows = _samples(3)
    (tmp_path / "samples-2.jsonl").write_text(
        "\n".join(json.dumps(r) for r in rows) + "\n" + json.dumps({"t": 9.0, "error": "x"}) + "\n"
    )
    assert soak.engine_samples(tmp_path) == rows


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG"
    return struct.unpack(">II", data[16:24])


def test_the_plot_of_a_small_report_is_a_png_of_its_size(soak, tmp_path):
    # drawn again from the report alone, as soak.py plot REPORT PNG does (no pixel comparisons)
    assert soak.main(["soak.py", "plot", str(SMALL_REPORT), str(tmp_path / "s.png")]) == 0
    assert _png_size(tmp_path / "s.png") == (1300, 1000)
    assert (soak.PLOT_SIZE[0] * soak.PLOT_DPI, soak.PLOT_SIZE[1] * soak.PLOT_DPI) == (1300, 1000)


def test_a_report_without_series_is_refused_in_one_line(soak, tmp_path, capsys):
    old = Path(__file__).parent.parent / "docs" / "soak" / "2026-12-05-vllm-600s.json"  # written before the series
    assert soak.main(["soak.py", "plot", str(old), str(tmp_path / "s.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "have no series" in err and not (tmp_path / "s.png").exists()


def test_the_plots_growth_is_the_judges(soak):
    # the judge fits bytes against the probe's clock; the plot, MiB against seconds since the
    # load began, from the report's series: the same line, so the same growth
    t0 = 1_700_000_000.0
    samples = _samples(100, rss=lambda i: 2**30 + (i % 3) * 2**20 + max(0, i - 40) * 2**18)
    for s in samples:
        s["t"] += t0
    judged = soak.flatness(samples, since=t0 + 50.0)["host_rss"]["growth"]
    points = [[s["t"] - t0, s["host_rss"] / 2**20] for s in samples]
    xs, ys, growth = soak.second_half_fit(points, 50.0)
    assert judged > soak.GROWTH and growth == pytest.approx(judged, rel=1e-9)
    assert xs == [50.0, 99.0]
    assert soak.second_half_fit(points, 99.0) is None
    # the report keeps the series as JSON lists, rounded finer than the 1% the check judges
    run = {"series": {"host_rss": [(1.23456, 1024.123456)], "device_bytes": [], "tpot": [(2.0, 30.12345)]}}
    assert soak._series(run) == {"host_rss": [[1.235, 1024.1235]], "device_bytes": [], "tpot": [[2.0, 30.123]]}


def test_the_probe_counts_what_is_alive_and_writes_a_line_a_period(tmp_path, monkeypatch):
    sys.path.insert(0, str(RELEASE))
    try:
        import soak_probe
    finally:
        sys.path.remove(str(RELEASE))

    class Thing:
        def __init__(self) -> None:
            self.alive = True

    probe = soak_probe._Probe(tmp_path)
    soak_probe._tracked(Thing, "__init__", probe.events.add)
    kept = [Thing() for _ in range(3)]
    Thing()  # dropped at once: not alive
    assert len(probe.events) == 3 and kept
    monkeypatch.setattr(soak_probe, "PERIOD_S", 0.05)
    monkeypatch.setattr(probe, "_sample", lambda: {"t": time.time(), "events": len(probe.events)})
    probe.forward("FULL", 4)  # the first forward pass starts the sampler, once
    probe.forward("FULL", 4)
    probe.forward("NONE", 300)
    assert probe.forwards == {"FULL:4": 2, "NONE:300": 1}
    deadline = time.time() + 10
    path = next(iter(tmp_path.glob("samples-*.jsonl")), None)
    while (path is None or len(path.read_text().splitlines()) < 2) and time.time() < deadline:
        time.sleep(0.05)
        path = next(iter(tmp_path.glob("samples-*.jsonl")), None)
    probe.stopped.set()
    assert path is not None
    assert json.loads(path.read_text().splitlines()[0])["events"] == 3
    assert [t.name for t in __import__("threading").enumerate()].count("npugraph-soak-probe") <= 1


def test_the_cards_large_blocks_are_told_from_the_hosts_memory(tmp_path):
    sys.path.insert(0, str(RELEASE))
    try:
        import soak_probe
    finally:
        sys.path.remove(str(RELEASE))
    big = 0x7F0000000000
    smaps = tmp_path / "smaps"
    smaps.write_text(
        f"{big:x}-{big + (128 << 20):x} rw-p 00000000 00:00 0 \n"
        "Size:             131072 kB\nRss:               40960 kB\n"
        "55d0c0000000-55d0c0100000 rw-p 00000000 00:00 0          [heap]\nRss:                1024 kB\n"
        "7f1000000000-7f1005000000 r--p 00000000 08:01 1234       /usr/lib/libbig.so\nRss:                2048 kB\n"
        "7f2000000000-7f2000200000 rw-p 00000000 00:00 0 \nRss:                 512 kB\n"
    )
    # only the anonymous mapping of 128 MiB counts: not the heap, a file, or a small mapping
    assert soak_probe._large_anonymous_resident(str(smaps)) == 40960 * 1024
    assert soak_probe._large_anonymous_resident() >= 0  # this process's own
