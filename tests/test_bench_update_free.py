"""``npugraph bench``'s update-free rows: the sweep's document is consistent with itself, and
the modeled step charges the whole width's attention."""

from __future__ import annotations

import pytest

from npugraph.bench.modeled import SHAPES, WIDTH_LADDER, _width_of, frozen_attention_us
from npugraph.bench.sweep import update_free_sweep


def test_the_width_of_a_step_is_the_ladders_narrowest_that_holds_it():
    assert [_width_of(n) for n in (1, 128, 129, 1024, 1025, 2048)] == [128, 128, 256, 1024, 2048, 2048]
    with pytest.raises(StopIteration):
        _width_of(WIDTH_LADDER[-1] + 1)


def test_update_free_attention_is_charged_by_the_keys_it_reads_and_the_mask():
    shape = SHAPES[0]
    assert frozen_attention_us(shape, 1.0) == pytest.approx(shape.attention_us * 257 / 256)
    assert frozen_attention_us(shape, 2.0) == pytest.approx(2 * frozen_attention_us(shape, 1.0))


def test_the_sweep_document_holds_both_paths_the_choice_and_the_crossover():
    doc = update_free_sweep(repeats=1, batches=(4, 256), contexts=(128, 2048))
    assert [r["batch"] for r in doc["rows"]] == [4, 256]
    assert [r["updated_kernel"] for r in doc["rows"]] == ["pa", "fia"]
    worst = 1.0
    for row in doc["rows"]:
        assert [p["context"] for p in row["points"]] == [128, 2048]
        slower = [p["context"] for p in row["points"] if p["update_free_vs_updated"] < 1.0]
        assert row["crossover_context"] == (slower[0] if slower else None)
        for p in row["points"]:
            best = max(p["updated_steps_per_s"], p["update_free_steps_per_s"])
            got = p["update_free_steps_per_s"] if p["choice"] == "update_free" else p["updated_steps_per_s"]
            assert p["choice_vs_better"] == pytest.approx(got / best, abs=2e-3)
            assert p["width"] >= p["context"] and p["keys"] <= p["context"] * row["batch"]
            worst = min(worst, p["choice_vs_better"])
    assert doc["choice_vs_better_min"] == pytest.approx(worst)
    # reading 256 rows to 2048 keys costs more than the update saves: the updated graph wins there
    assert doc["rows"][1]["points"][1]["update_free_vs_updated"] < 1.0
