"""``npugraph bench``'s update-free sweep: over context length and batch, the modeled steps/s of
a size's update-free graph (the narrowest width of the ladder that holds the step) and of its
graph updated per layer, and of :class:`~npugraph.policy.UpdateFreeCosts`' choice between them.
A step at context ``c`` holds one request of ``c`` keys and the others drawn in ``[1, c]``
(seeded): a batch of long and short requests, which an update-free graph reads all to the width.

Both paths' host calls are recorded once per batch (npugraph's own step on a recording
device: they do not change with the context); the timeline model then runs them with the
device's attention at each context: the requests' own keys for the updated graph, the
width's for every request (and a mask byte a key) for the update-free one.  The choice is
calibrated as a deployment would: the host time a step of each path takes, the device's
other work and its time per key, all from the same model.
"""

from __future__ import annotations

import random
from typing import Any

import attrs

import npusim as sim
from npugraph.bench.measured import _MAX_MODEL_LEN, _setup
from npugraph.bench.modeled import _KV_BYTES_PER_KEY, _MASK_BYTES_PER_KEY, WIDTH_LADDER, _width_of
from npugraph.bench.rivals import _frozen_step, _implementations, _step_input
from npugraph.bench.timeline import Costs, StepLog, min_log, model_steps
from npugraph.policy import DEFAULT_PA_SIZES, UpdateFreeCosts

__all__ = ["SWEEP_BATCHES", "SWEEP_CONTEXTS", "update_free_sweep"]

SWEEP_BATCHES = (1, 4, 16, 64, 256)
SWEEP_CONTEXTS = (64, 128, 256, 512, 1024, 2048)
LAYERS = 20
OTHER_US = 40.0  # a layer's non-attention device work (the host_bound shape's)
# a layer's attention per key read: the host_bound shape's 20 us over its draw's keys
# (16 requests of 1024 on average); attention is bound by memory, so linear in the keys
ATTENTION_US_PER_KEY = 20.0 / (16 * 1024)


def _logs(size: int, repeats: int, rng: random.Random) -> tuple[StepLog, StepLog, str, list[int]]:
    """The updated graph's step (npugraph per layer, events grouped, as a user gets it without
    the tiling sink) and the update-free step at ``size``, each the fastest of ``repeats``."""
    kernel = "pa" if size in DEFAULT_PA_SIZES else "fia"
    rt, _, table, _q = _setup(LAYERS, size, kernel, cost=False, configure=False, event_group=10)
    frozen, _, _, _fq = _setup(LAYERS, size, "fia", cost=False, configure=False, table=table, widths=WIDTH_LADDER)
    udev, ustep = _implementations(rt, size, kernel)["npugraph"]
    fdev, fstep, frozen_by = _frozen_step(frozen, size)
    out = []
    for dev, step in ((udev, ustep), (fdev, fstep)):
        logs: list[StepLog] = []
        for _ in range(repeats + 2):
            inp = _step_input(rt, size, [rng.randint(1, _MAX_MODEL_LEN) for _ in range(size)], table)
            with dev.recording() as log:
                step(inp)
            logs += log
        out.append(min_log(logs[2:]))
    recorded_by = [next(j for j in range(i, LAYERS) if rt.entry(size).tasks[j].records) for i in range(LAYERS)]
    return out[0], out[1], kernel, recorded_by if kernel == "fia" else frozen_by


def update_free_sweep(
    *,
    repeats: int = 5,
    seed: int = 0,
    batches: tuple[int, ...] = SWEEP_BATCHES,
    contexts: tuple[int, ...] = SWEEP_CONTEXTS,
) -> dict[str, Any]:
    """The sweep's document: per batch, per context, both paths' modeled steps/s and the
    choice's, its share of the better path, and the crossover (the first context where the
    updated graph is faster)."""
    sim.configure()
    rng = random.Random(seed)
    base = Costs(other_us=OTHER_US)
    mask = _MASK_BYTES_PER_KEY / _KV_BYTES_PER_KEY
    out: dict[str, Any] = {"layers": LAYERS, "other_us": OTHER_US, "attention_us_per_key": ATTENTION_US_PER_KEY}
    rows, worst = [], 1.0
    for batch in batches:
        updated_log, free_log, kernel, by = _logs(batch, repeats, rng)
        points: list[dict[str, Any]] = []
        cross: int | None = None
        for ctx in contexts:
            # the step's requests: one of ``ctx`` keys, the others drawn in [1, ctx]
            lens = [ctx, *(rng.randint(1, ctx) for _ in range(batch - 1))]
            keys, width = sum(lens), _width_of(ctx)
            upd = model_steps(
                updated_log, attrs.evolve(base, attention_us=ATTENTION_US_PER_KEY * keys), kernel=kernel, layers=LAYERS
            )
            free = model_steps(
                free_log,
                attrs.evolve(base, attention_us=ATTENTION_US_PER_KEY * (1 + mask) * batch * width),
                kernel="fia",
                layers=LAYERS,
                recorded_by=by,
            )
            costs = UpdateFreeCosts(
                updated_host_us=upd.host_us_per_step,
                update_free_host_us=free.host_us_per_step,
                device_other_us=LAYERS * OTHER_US,
                attention_us_per_key=LAYERS * ATTENTION_US_PER_KEY,
                mask_bytes_per_key=mask,
            )
            chose_free = costs.prefers_update_free(width, batch, keys)
            chosen = free.steps_per_s if chose_free else upd.steps_per_s
            share = chosen / max(free.steps_per_s, upd.steps_per_s)
            worst = min(worst, share)
            if cross is None and free.steps_per_s < upd.steps_per_s:
                cross = ctx
            points.append(
                {
                    "context": ctx,
                    "keys": keys,
                    "width": width,
                    "updated_steps_per_s": round(upd.steps_per_s, 1),
                    "update_free_steps_per_s": round(free.steps_per_s, 1),
                    "update_free_vs_updated": round(free.steps_per_s / upd.steps_per_s, 4),
                    "choice": "update_free" if chose_free else "updated",
                    "choice_vs_better": round(share, 4),
                }
            )
        rows.append({"batch": batch, "updated_kernel": kernel, "points": points, "crossover_context": cross})
    out["rows"] = rows
    out["choice_vs_better_min"] = round(worst, 4)
    out["goal"] = 0.99
    out["meets_goal"] = worst >= 0.99
    return out
