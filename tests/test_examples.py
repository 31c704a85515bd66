"""The README's example runs as written, and its logits are right."""

from __future__ import annotations

import runpy
from pathlib import Path

import torch


def test_quickstart_runs_and_its_last_logits_are_right(capsys):
    ns = runpy.run_path(str(Path(__file__).parent.parent / "examples" / "quickstart.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "size 4: pa (" in out and "size 8: fia_sink (" in out
    assert out.rstrip().endswith("OK"), out
    model, b, logits = ns["model"], ns["b"], ns["logits"]
    dev = ns["rt"].device.memory
    eager = model(b.input_ids.to(dev), b.positions.to(dev), b.slot_mapping.to(dev), b.padded_meta)[: b.num_reqs]
    ns["rt"].synchronize()
    assert torch.equal(logits, eager), "the replayed step equals the same step run eagerly"
    lens = b.meta.seq_lens.tolist()
    ind = model.reference_logits(b.input_ids, b.positions, b.slot_mapping, lens, [1] * len(lens), b.meta.block_table)
    assert (logits - ind).abs().max() < 0.05 * ind.abs().max(), "and the float64-attention reference"
