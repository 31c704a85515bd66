"""A soak: a server as users start it, under sustained load for minutes (make soak).

    soak.py vllm|sglang OUT_DIR [SECONDS] [MODES]   MODES: a comma list (default every mode)
    soak.py plot REPORT.json OUT.png                a report's plot drawn again

Each mode's server (eager, the engine's own graphs, npugraph's plugin) starts on 127.0.0.1
(release/serving.py) and serves 16 concurrent ``openai``-client streams for SECONDS (default
600): prompts of 1 token to near the context, crossing pages, streamed and not, some clients
walking away mid-stream; requests arrive while others decode.  Every worker's requests come
from its own seeded generator, so every mode is sent the same requests in the same order.
Before it, SGLang's soak warms up: one request of each prompt length from ``SWEEP_TOP`` down,
one at a time, to fill the engine's bounded per-shape caches (why: ``SWEEP_TOP``; not
vLLM's: ``WARMED``).  The load loop
is bounded in count and time and stops by itself.  The engine's process samples itself
(release/soak_probe.py, ``NPUGRAPH_SOAK_SAMPLES``).

It fails (exit 1, the reasons listed) unless, for npugraph's server:

* every completed greedy text is Hugging Face's float32 choice, every token within 0.1 of the
  best logit and 95% exactly it;
* over the load's second half, the engine process's resident memory (outside the
  simulated card's KV-cache blocks, which the host backs as they are first written) and the
  simulated device's allocated bytes grow by under 1%, and the captured graphs, the
  ExternalEvents alive and the streams do not change (no re-capture, no leak);
* SIGINT ends the server and its log holds no traceback raised in npugraph's code.

It reports, per mode, into ``OUT_DIR/soak-ENGINE.json``: requests served and walked away,
output tokens/s and time per output token (p50, p99) on the simulator, the memory and graph
figures, the forward passes by graph mode and batch size (a decode batch run eagerly is a
fallback, explained by its size), and how many texts differ from the eager server's and how
many variants a request had (concurrent batches differ from run to run, and bfloat16 can
break a near tie either way; a variant that is not a near tie fails the check above), and the
series it plots.  The plot, ``OUT_DIR/soak-ENGINE.png`` (matplotlib, npugraph's ``plot`` extra,
in the soak's environments' locks): memory and time per output token over the run, the second
half shaded with each mode's fitted growth (:func:`plot`).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# this folder's (on sys.path as the script's folder, or put there by the server checks that import this)
from hf_reference import greedy_choices
from serving import SGLANG_READY, Served, npugraph_raised, started
from soak_probe import PERIOD_S

HERE = Path(__file__).resolve().parent

STREAMS = 16
MAX_REQUESTS = 100_000  # the loop's bound in count, beside its time
MAX_NEW = 48
POOL = 48  # the distinct prompts (lengths from 1 to near the context)
TOLERANCE, EXACT = 0.1, 0.95
GROWTH = 0.01  # memory growth allowed over the second half
# The warm-up's longest prompt.  The engine's process keeps per-shape caches in host memory,
# each bounded, each filling as new shapes arrive: on the simulator, the CPU math library's
# (oneDNN's primitive cache and ideep's, 1024 kernels each, about half a MiB per shape here,
# one per linear layer's shape, so a prefill of a new length adds several); on a card,
# CANN's op cache (aclnn's, ACLNN_CACHE_LIMIT).  Under the load, new prefill lengths grow
# them for minutes, fast and then slower (2026-12-05: SGLang's scheduler, ten minutes,
# every mode).  One request of each length up to this, one at a time, fills them first.
SWEEP_TOP = 768
# The engines whose soak warms up first.  vLLM's does not: on the simulator its prefill runs
# vllm-ascend's rope through Triton's interpreter, about 5 s for a 760-token prompt alone
# (2026-12-05), so the sweep would take about half an hour per mode; and its graph modes held
# flat without it (ten minutes: npugraph's +0.07%, vllm-ascend's +0.15%).  Its eager mode
# rose in steps (+3.9%), likely the same caches (it pads no batch), not measured.
WARMED = {"vllm": False, "sglang": True}
START_S, STOP_S = 1200, 90
# the soak inside the server checks (release/test_server.py, release/sglang/test_server.py):
# CI's two-minute variant; SOAK_S sets it there too
CHECK_SOAK_S = float(os.environ.get("SOAK_S", "120"))
# What the server checks' soak judges of memory: the device's bytes.  The engine's host memory
# is reported there, not judged: it holds the per-shape caches that the warm-up fills
# (SWEEP_TOP), which those checks leave out to stay inside CI's time (make soak judges it)
CHECK_MEMORY = ("device_bytes",)
ENGINES = ("vllm", "sglang")
# "npugraph-update-free": npugraph's plugin with NPUGRAPH_UPDATE_FREE=1 (not a default mode:
# name it; judged as npugraph's mode is)
UPDATE_FREE = "npugraph-update-free"
MODES = {"vllm": ("eager", "vllm-ascend", "npugraph"), "sglang": ("eager", "sglang", "npugraph")}


@dataclass
class Request:
    """One request of the load, and what came back."""

    key: str  # "<worker>.<n>": the same request in every mode
    prompt: list[int]
    max_tokens: int
    stream: bool
    walk_after: int  # a streamed request's client leaves after this many chunks (0: it stays)
    prompt_index: int = 0  # its prompt in the pool
    tokens: list[int] = field(default_factory=list)
    sent: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    ended: str = ""  # "length", "walked away", or the error


def pooled_prompt(index: int, context: int, vocab: int, seed: int = 0) -> tuple[list[int], int]:
    """Prompt ``index`` of the soak's pool and its ``max_tokens``: a length from 1 to near
    ``context`` (most short, some long enough to cross many pages)."""
    rng = random.Random(seed * 1_000_003 + index)
    new = rng.randint(1, MAX_NEW)
    top = context - new - 1
    band = rng.random()
    length = (
        rng.randint(1, 16)
        if band < 0.4
        else rng.randint(17, 200)
        if band < 0.7
        else rng.randint(201, top // 2)
        if band < 0.9
        else rng.randint(top // 2, top)
    )
    return [rng.randint(1, vocab - 1) for _ in range(length)], new


def plan(worker: int, n: int, context: int, vocab: int, seed: int = 0) -> Request:
    """Request ``n`` of ``worker``: a prompt of the pool (``POOL`` prompts, each served many
    times, as steady traffic repeats itself: the engine's prefix cache fills during warm-up and
    then holds, and a prompt's texts can be compared), a streamed one in two, one stream in
    ten walked away from."""
    rng = random.Random(seed * 1_000_003 + worker * 10_007 + n + 7)
    index = rng.randrange(POOL)
    prompt, new = pooled_prompt(index, context, vocab, seed)
    stream = rng.random() < 0.5
    walk = rng.randint(1, max(1, new - 1)) if stream and new > 4 and rng.random() < 0.1 else 0
    return Request(
        key=f"{worker}.{n}", prompt=prompt, max_tokens=new, stream=stream, walk_after=walk, prompt_index=index
    )


async def _one(client: Any, model: str, r: Request) -> None:
    r.sent = time.monotonic()
    body = {"ignore_eos": True, "return_token_ids": True}
    try:
        if not r.stream:
            c = await client.completions.create(
                model=model, prompt=r.prompt, max_tokens=r.max_tokens, temperature=0.0, extra_body=body
            )
            (choice,) = c.choices
            r.tokens = list(choice.model_extra["token_ids"])
            r.chunk_times.append(time.monotonic())
            r.ended = str(choice.finish_reason)
            return
        stream = await client.completions.create(
            model=model, prompt=r.prompt, max_tokens=r.max_tokens, temperature=0.0, stream=True, extra_body=body
        )
        chunks, text = 0, ""
        async for chunk in stream:
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            ids = (choice.model_extra or {}).get("token_ids") or []
            r.tokens.extend(ids)
            text += choice.text or ""
            if ids:
                r.chunk_times.append(time.monotonic())
            if choice.finish_reason:
                r.ended = str(choice.finish_reason)
            chunks += 1
            if r.walk_after and chunks >= r.walk_after:
                r.ended = "walked away"
                await stream.close()
                return
        if text and not r.tokens:  # a text the check could not judge must not pass unjudged
            r.ended = "error: the stream gave text without its token ids (return_token_ids)"
    except Exception as exc:  # a request that fails is reported (and fails the soak), the load goes on
        r.ended = f"error: {type(exc).__name__}: {str(exc)[:200]}"


def _client(served: Served) -> Any:
    """An ``openai`` client of ``served``: no retries (a failure is the soak's to report)."""
    import openai

    return openai.AsyncOpenAI(base_url=f"{served.base}/v1", api_key="none", timeout=600, max_retries=0)


def drive(served: Served, seconds: float, context: int, vocab: int, streams: int = STREAMS) -> list[Request]:
    """``streams`` workers, each sending its planned requests one after another until
    ``seconds`` have passed (or ``MAX_REQUESTS`` were sent): every request sent, in order."""
    sent: list[Request] = []
    deadline = time.monotonic() + seconds

    async def run() -> None:
        client = _client(served)

        async def worker(w: int) -> None:
            n = 0
            while time.monotonic() < deadline and len(sent) < MAX_REQUESTS:
                r = plan(w, n, context, vocab)
                n += 1
                sent.append(r)
                await _one(client, served.model, r)

        try:
            await asyncio.gather(*(worker(w) for w in range(streams)))
        finally:
            await client.close()

    asyncio.run(run())
    return sent


def sweep(context: int, vocab: int, seed: int = 0) -> list[Request]:
    """The warm-up: one prompt of each length from ``SWEEP_TOP`` (below the context) down to
    1, its own tokens (no prefix of the pool's, nor of another's), one token each.

    Longest first: each later prefill's buffers fit in the blocks the longer ones freed.
    In the other order each is a little larger than any freed block, and glibc's heap grew
    by 900 MiB that it then held free (SGLang's scheduler, 2026-12-05)."""
    top = min(SWEEP_TOP, context - 2)
    out = []
    for length in range(top, 0, -1):
        rng = random.Random(seed * 1_000_003 + 500_009 + length)
        prompt = [rng.randint(1, vocab - 1) for _ in range(length)]
        out.append(Request(key=f"warm.{length}", prompt=prompt, max_tokens=1, stream=False, walk_after=0))
    return out


def warm_up(served: Served, context: int, vocab: int) -> dict[str, Any]:
    """Fill the engine process's per-shape caches before the load (:data:`SWEEP_TOP`): the
    sweep's requests one at a time, so that each prefill is a shape of its own."""
    requests = sweep(context, vocab)

    async def run() -> None:
        client = _client(served)
        try:
            for r in requests:
                await _one(client, served.model, r)
        finally:
            await client.close()

    t0 = time.monotonic()
    asyncio.run(run())
    return {
        "requests": len(requests),
        "seconds": round(time.monotonic() - t0, 1),
        "failed": [f"{r.key}: {r.ended}" for r in requests if r.ended != "length"][:20],
    }


def engine_samples(folder: Path) -> list[dict[str, Any]]:
    """The samples of the process that ran the model (the one with the most forward passes)."""
    best: list[dict[str, Any]] = []
    for path in folder.glob("samples-*.jsonl"):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        rows = [r for r in rows if "error" not in r]
        if rows and sum(rows[-1]["forwards"].values()) > (sum(best[-1]["forwards"].values()) if best else -1):
            best = rows
    return best


def trend(times: list[float], values: list[float]) -> tuple[float, float]:
    """The least-squares line through ``values`` over ``times``: its values at the first and
    the last time."""
    n = len(times)
    mean_t, mean_v = sum(times) / n, sum(values) / n
    spread = sum((t - mean_t) ** 2 for t in times)
    slope = sum((t - mean_t) * (v - mean_v) for t, v in zip(times, values)) / spread if spread else 0.0
    return mean_v + slope * (times[0] - mean_t), mean_v + slope * (times[-1] - mean_t)


def flatness(samples: list[dict[str, Any]], since: float) -> dict[str, Any]:
    """Over the samples after ``since`` (the run's second half): each memory figure's growth,
    the rise of its least-squares line over the half relative to where the line starts, and
    the counts' distinct values.

    Not the last samples against the first: a server's memory, sampled while it serves,
    holds whatever its requests in flight hold, and jumps between levels tens of MiB apart
    as they come and go (2026-12-05: vLLM's engine under npugraph, ten minutes, floor and
    ceiling unchanged over the half, yet its last tenth's median 2.8% above its first's,
    as one level or the other fell there).  A leak raises the line; such jumps do not.  The
    tenths' medians, the floor (minimum) and ceiling (maximum) of the first and last quarter
    are reported beside."""
    late = [s for s in samples if s["t"] >= since]
    if len(late) < 10:
        return {"error": f"{len(late)} samples in the second half: too few to judge"}
    tenth, quarter = max(1, len(late) // 10), max(1, len(late) // 4)
    times = [s["t"] for s in late]
    out: dict[str, Any] = {"samples": len(late)}
    for name in ("host_rss", "rss", "device_bytes"):
        values = [float(s[name]) for s in late]
        first, last = trend(times, values)
        out[name] = {
            "first": first,
            "last": last,
            "growth": (last - first) / first if first else 0.0,
            "tenths_medians": [statistics.median(values[:tenth]), statistics.median(values[-tenth:])],
            "floor": [min(values[:quarter]), min(values[-quarter:])],
            "ceiling": [max(values[:quarter]), max(values[-quarter:])],
        }
    for name in ("graphs", "npugraph_graphs", "external_events", "streams"):
        out[name] = sorted({s[name] for s in late})
    return out


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def tpot(r: Request) -> float | None:
    """A completed stream's time per output token after its first (seconds), or None where
    there is none: not streamed, not completed, or fewer than two tokens."""
    if r.ended != "length" or not r.stream or len(r.tokens) < 2 or len(r.chunk_times) < 2:
        return None
    return (r.chunk_times[-1] - r.chunk_times[0]) / (len(r.tokens) - 1)


def summarize(requests: list[Request], seconds: float) -> dict[str, Any]:
    """Throughput and time per output token (streamed requests with two tokens or more)."""
    done = [r for r in requests if r.ended == "length"]
    per_token = [t for t in map(tpot, done) if t is not None]
    return {
        "requests": len(requests),
        "completed": len(done),
        "walked_away": sum(r.ended == "walked away" for r in requests),
        "failed": [f"{r.key}: {r.ended}" for r in requests if r.ended not in ("length", "walked away")][:20],
        "output_tokens_per_s": sum(len(r.tokens) for r in requests) / seconds,
        "tpot_ms": {
            "p50": _ms(_percentile(per_token, 0.5)),
            "p99": _ms(_percentile(per_token, 0.99)),
            "n": len(per_token),
        },
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def check_choices(model_dir: Path, requests: list[Request]) -> dict[str, Any]:
    """Hugging Face's float32 forward on every completed text: the worst gap and the exact share."""
    done = [r for r in requests if r.ended == "length" and r.tokens]
    choices = greedy_choices(model_dir, [r.prompt for r in done], [r.tokens for r in done])
    gaps = [g for g, _ in choices]
    exact = sum(n for _, n in choices)
    total = sum(len(r.tokens) for r in done)
    far = [f"{r.key}: {g:.3f}" for r, (g, _) in zip(done, choices) if g > TOLERANCE]
    return {
        "texts": len(done),
        "tokens": total,
        "worst_gap": max(gaps, default=0.0),
        "exact_share": exact / total if total else 1.0,
        "beyond_tolerance": far[:20],
    }


def variants(by_mode: dict[str, list[Request]]) -> dict[str, Any]:
    """Per mode: the prompts it completed, the most distinct texts one prompt had, and how many
    completed texts differ from the eager server's text for the same prompt (its first)."""
    texts: dict[str, dict[int, list[tuple[int, ...]]]] = {}
    for mode, rs in by_mode.items():
        per: dict[int, list[tuple[int, ...]]] = {}
        for r in rs:
            if r.ended == "length":
                per.setdefault(r.prompt_index, []).append(tuple(r.tokens))
        texts[mode] = per
    eager = {i: ts[0] for i, ts in texts.get("eager", {}).items()}
    out: dict[str, Any] = {}
    for mode, per in texts.items():
        compared = [(i, t) for i, ts in per.items() if i in eager for t in ts]
        out[mode] = {
            "prompts": len(per),
            "most_variants_of_one_prompt": max((len(set(ts)) for ts in per.values()), default=0),
            "compared_with_eager": len(compared),
            "differ_from_eager": sum(t != eager[i] for i, t in compared),
        }
    return out


PLOT_SIZE, PLOT_DPI = (13.0, 10.0), 100  # the PNG: 1300 x 1000 pixels
COLORS = {"eager": "#757575", "npugraph": "#c62828", UPDATE_FREE: "#ff8f00"}  # the engine's own graphs: OTHER
OTHER = "#1565c0"
PANELS = (
    ("host_rss", "engine's resident memory\noutside the card's KV blocks (MiB)"),
    ("device_bytes", "device bytes allocated (MiB)"),
    ("tpot", "time per output token (ms)"),
)


def plot(path: Path, report: dict[str, Any]) -> None:
    """The run's picture, drawn from its report (``soak-ENGINE.json``, each mode's ``series``)
    with matplotlib (Agg, no display): the engine's resident memory, the device's allocated
    bytes and the time per output token against seconds since the load began, one panel each,
    one line (TPOT: a point per completed stream, at its end) per mode.  The second half, the
    one the check judges, is shaded; each memory line's least-squares fit over it (:func:`trend`,
    the judge's own) is drawn, its growth in the legend; TPOT's p50 and p99 are lines."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import ScalarFormatter

    modes = report["modes"]
    unrecorded = [mode for mode, m in modes.items() if "series" not in m]
    if unrecorded:
        raise ValueError(
            f"modes {unrecorded} of this report have no series (reports before 2026-12-06 kept none): no plot"
        )
    fig = Figure(figsize=PLOT_SIZE, dpi=PLOT_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(PANELS), 1, sharex=True)
    half_from = min(m["second_half_from_s"] for m in modes.values())
    # the load's end, or the last sample (the engine's, taken after the last request) if later
    end = max(max([m["load_s"]] + [p[0] for points in m["series"].values() for p in points]) for m in modes.values())
    for k, (ax, (name, label)) in enumerate(zip(axes, PANELS)):
        ax.axvspan(half_from, end, color="#fff3c4", zorder=0, label="second half: judged" if k == 0 else None)
        for mode, m in modes.items():
            color = COLORS.get(mode, OTHER)
            points = m["series"][name]
            if not points:
                continue
            ts, vs = [p[0] for p in points], [p[1] for p in points]
            if name == "tpot":
                ax.scatter(ts, vs, s=9, alpha=0.6, color=color, lw=0, label=f"{mode}: a completed stream")
                for q, style in (("p50", "--"), ("p99", ":")):
                    if m["tpot_ms"].get(q) is not None:
                        ax.axhline(
                            m["tpot_ms"][q], color=color, ls=style, lw=1.2, label=f"{mode} {q}: {m['tpot_ms'][q]:g} ms"
                        )
                continue
            ax.plot(ts, vs, color=color, lw=1, label=mode)
            fit = second_half_fit(points, m["second_half_from_s"])
            if fit is not None:
                xs, ys, growth = fit
                fitted = f"{mode}: fit over the second half, {growth:+.2%}"
                ax.plot(xs, ys, color=color, ls="--", lw=2.2, label=fitted)
        ax.set_ylabel(label)
        formatter = ScalarFormatter(useOffset=False)
        formatter.set_scientific(False)
        ax.yaxis.set_major_formatter(formatter)
        ax.grid(alpha=0.35)
        ax.set_axisbelow(True)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    axes[-1].set_xlim(0, end)
    axes[-1].set_xlabel("seconds since the load began (each mode its own run)")
    verdict = "passed" if report.get("passed") else "FAILED"
    fig.suptitle(
        f"soak of {report['engine']}, {report['date']}: {report['seconds']:g} s of load per mode, "
        f"{report['streams']} concurrent streams; {verdict}\nshaded: the second half, judged: npugraph's memory "
        f"must grow under {GROWTH:.0%} over it\n(the rise of its least-squares line, relative to where the line "
        "starts); the other modes are its comparison",
        fontsize=11,
    )
    fig.savefig(path, format="png")


def second_half_fit(points: list[list[float]], since: float) -> tuple[list[float], list[float], float] | None:
    """The judge's line (:func:`trend`, as :func:`flatness` fits it) through the points from
    ``since`` on: its two ends' times and values, and its growth; None under two points."""
    late = [(t, v) for t, v in points if t >= since]
    if len(late) < 2:
        return None
    first, last = trend([t for t, _ in late], [v for _, v in late])
    return [late[0][0], late[-1][0]], [first, last], (last - first) / first if first else 0.0


def _series(run: dict[str, Any]) -> dict[str, list[list[float]]]:
    """The run's series for its report, rounded (0.1 KiB, 1 ms, 1 us): what the plot draws."""
    digits = {"host_rss": 4, "device_bytes": 4, "tpot": 3}
    return {name: [[round(t, 3), round(v, digits[name])] for t, v in points] for name, points in run["series"].items()}


def _server(engine: str, mode: str, model_dir: Path, folder: Path) -> tuple[list[str], dict[str, str]]:
    env = {
        **os.environ,
        "NPUGRAPH_SIM_TORCH_NPU": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "NPUGRAPH_SOAK_SAMPLES": str(folder),
        "NPUGRAPH_ENABLE": "1" if mode.startswith("npugraph") else "0",
        "NPUGRAPH_UPDATE_FREE": "1" if mode == UPDATE_FREE else "0",
    }
    if engine == "vllm":
        env["VLLM_CACHE_ROOT"] = str(folder / "vllm-cache")
        args = [str(Path(sys.executable).parent / "vllm"), "serve", str(model_dir), "--dtype", "bfloat16"]
        return args + (["--enforce-eager"] if mode == "eager" else []), env
    args = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir), "--device", "npu"]
    return args + (["--disable-cuda-graph"] if mode == "eager" else []), env


def _model(engine: str, out: Path) -> tuple[Path, int, int]:
    """The engine's check model (its tiny Llama with a real tokenizer): path, context, vocabulary."""
    if engine == "vllm":
        import generate  # release/'s

        path = out / "llama"
        generate.write_model(path)
        return path, 1024, generate.MODELS["llama"].vocab
    sys.path.insert(0, str(HERE / "sglang"))
    from generate import VOCAB, write_model  # release/sglang/'s

    path = out / "llama"
    write_model(path, "llama")
    return path, 1024, VOCAB


def under_load(
    served: Served, seconds: float, context: int, vocab: int, samples_folder: Path, *, warm: bool = True
) -> dict[str, Any]:
    """Drive a started server (its engine sampling into ``samples_folder``) for ``seconds``:
    what it served, how flat it stayed, its forward passes and the series to plot.  The
    warm-up (:func:`warm_up`) comes first, outside the load's time and samples (``warm``:
    the server checks' soak, which judges no host memory, leaves it out)."""
    warmed = warm_up(served, context, vocab) if warm else {"requests": 0, "seconds": 0.0, "failed": []}
    t0 = time.time()
    requests = drive(served, seconds, context, vocab)
    elapsed = time.time() - t0
    time.sleep(2 * PERIOD_S)  # the engine's sample after the last request
    samples = engine_samples(samples_folder)
    starts = min((r.sent for r in requests), default=0.0)
    return {
        "warm_up": warmed,
        "requests": requests,
        "elapsed": elapsed,
        "second_half_from_s": elapsed / 2,  # what flatness judges, in the series' seconds
        "summary": summarize(requests, elapsed),
        "flat": flatness(samples, t0 + elapsed / 2),
        "forwards": samples[-1]["forwards"] if samples else {},
        "series": {
            "host_rss": [(s["t"] - t0, s["host_rss"] / 2**20) for s in samples if s["t"] >= t0],
            "device_bytes": [(s["t"] - t0, s["device_bytes"] / 2**20) for s in samples if s["t"] >= t0],
            "tpot": [(r.chunk_times[-1] - starts, 1000 * t) for r in requests if (t := tpot(r)) is not None],
        },
    }


def soak_one(
    engine: str, mode: str, model_dir: Path, context: int, vocab: int, seconds: float, out: Path
) -> dict[str, Any]:
    """One mode's server started, under the load, and stopped by SIGINT."""
    folder = out / f"{engine}-{mode}"
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("samples-*.jsonl"):
        stale.unlink()
    args, env = _server(engine, mode, model_dir, folder)
    ready = SGLANG_READY if engine == "sglang" else None
    with started(args, folder / "server.log", env, START_S, ready=ready) as served:
        run = under_load(served, seconds, context, vocab, folder, warm=WARMED[engine])
        ended, shutdown = served.interrupt(STOP_S)
    run["stopped_by_sigint"] = ended
    run["npugraph_raised"] = npugraph_raised(served.log.read_text())
    run["shutdown_tail"] = shutdown[-2000:]
    return run


def failures(
    engine: str, run: dict[str, Any], choices: dict[str, Any], memory: tuple[str, ...] = ("host_rss", "device_bytes")
) -> list[str]:
    """Why a run fails the soak (nothing: it passes); ``memory``: the memory figures judged."""
    why = []
    s, flat = run["summary"], run["flat"]
    if run.get("warm_up", {}).get("failed"):
        why.append(f"{engine}: warm-up requests failed: {run['warm_up']['failed'][:5]}")
    if s["failed"]:
        why.append(f"{engine}: requests failed: {s['failed'][:5]}")
    if not s["completed"]:
        why.append(f"{engine}: no request completed")
    if choices["beyond_tolerance"]:
        why.append(f"{engine}: tokens beyond {TOLERANCE} of Hugging Face's best: {choices['beyond_tolerance'][:5]}")
    if choices["exact_share"] < EXACT:
        why.append(f"{engine}: {choices['exact_share']:.3f} of tokens are Hugging Face's choice, under {EXACT}")
    if "error" in flat:
        why.append(f"{engine}: {flat['error']}")
    else:
        for name in memory:  # (rss: reported; it counts the card's first-touched pages)
            if flat[name]["growth"] >= GROWTH:
                why.append(f"{engine}: {name} grew {flat[name]['growth']:.2%} over the second half")
        for name in ("graphs", "npugraph_graphs", "external_events", "streams"):
            if len(flat[name]) != 1:
                why.append(f"{engine}: {name} changed over the second half: {flat[name]}")
    if not run.get("stopped_by_sigint", True):  # (a soak inside a server check stops it later)
        why.append(f"{engine}: SIGINT did not end the server within {STOP_S} s")
    if run.get("npugraph_raised"):
        why.append(f"{engine}: tracebacks raised in npugraph's code: {run['npugraph_raised'][:3]}")
    return why


def replot(report_path: Path, png: Path) -> int:
    """``soak.py plot REPORT PNG``: a report's plot drawn again (one line and exit 2 if it cannot be)."""
    try:
        plot(png, json.loads(report_path.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"soak.py plot: {report_path}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(f"soak.py plot: {png}", file=sys.stderr)
    return 0


def main(argv: list[str]) -> int:
    if len(argv) == 4 and argv[1] == "plot":
        return replot(Path(argv[2]), Path(argv[3]))
    if len(argv) not in (3, 4, 5) or argv[1] not in ENGINES:
        print(__doc__.splitlines()[2].strip(), file=sys.stderr)
        return 2
    engine, out = argv[1], Path(argv[2])
    seconds = float(argv[3]) if len(argv) > 3 else 600.0
    modes = argv[4].split(",") if len(argv) > 4 else list(MODES[engine])
    if not modes or not set(modes) <= {*MODES[engine], UPDATE_FREE}:
        print(f"soak.py: MODES from {', '.join(MODES[engine])}, {UPDATE_FREE}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    model_dir, context, vocab = _model(engine, out)
    runs = {}
    for mode in modes:
        print(f"soak {engine} {mode}: {seconds:.0f} s of load", file=sys.stderr, flush=True)
        runs[mode] = soak_one(engine, mode, model_dir, context, vocab, seconds, out)
        print(f"  {json.dumps(runs[mode]['summary'])}", file=sys.stderr, flush=True)
    choices = {mode: check_choices(model_dir, run["requests"]) for mode, run in runs.items()}
    # the judgement is npugraph's; the other modes are its comparison (a soak of them alone
    # reports, and fails on what would fail npugraph's, as a baseline)
    why = [line for mode, run in runs.items() for line in failures(f"{engine} {mode}", run, choices[mode])]
    judged = [m for m in runs if m.startswith("npugraph")]
    why = [line for line in why if any(f" {m}:" in line for m in judged)] if judged else why
    report = {
        "engine": engine,
        "date": time.strftime("%Y-%m-%d"),
        "seconds": seconds,
        "streams": STREAMS,
        "passed": not why,
        "failures": why,
        "variants": variants({m: r["requests"] for m, r in runs.items()}),
        "modes": {
            mode: {
                **run["summary"],
                "warm_up": run["warm_up"],
                "hugging_face": choices[mode],
                "flat": run["flat"],
                "forwards": run["forwards"],
                "stopped_by_sigint": run["stopped_by_sigint"],
                # what the plot draws: soak.py plot REPORT PNG draws it again from this report
                "load_s": round(run["elapsed"], 3),
                "second_half_from_s": round(run["second_half_from_s"], 3),
                "series": _series(run),
            }
            for mode, run in runs.items()
        },
        "relative_to_eager": {
            mode: {
                "output_tokens_per_s": run["summary"]["output_tokens_per_s"]
                / runs["eager"]["summary"]["output_tokens_per_s"]
            }
            for mode, run in runs.items()
            if "eager" in runs and mode != "eager" and runs["eager"]["summary"]["output_tokens_per_s"]
        },
    }
    (out / f"soak-{engine}.json").write_text(json.dumps(report, indent=1))
    (out / f"soak-{engine}.requests.json").write_text(
        json.dumps({m: [asdict(r) for r in run["requests"]] for m, run in runs.items()})
    )
    plot(out / f"soak-{engine}.png", report)
    for line in why:
        print(line, file=sys.stderr)
    print(f"soak {engine}: {'passed' if not why else 'FAILED'} ({out / f'soak-{engine}.json'})", file=sys.stderr)
    return 0 if not why else 1


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a killed soak still stops its server
    sys.exit(main(sys.argv))
