from __future__ import annotations

import torch

from npugraph import Runtime
from npugraph.models import Decoder, DecoderConfig, Workload
from npugraph.models.engine import DecodeEngine

SIZES = [1, 2, 4, 8, 16]


def build(sizes=SIZES, layers=4, order="update-first", policy=None, **rt_kwargs):
    cfg = DecoderConfig(layers=layers, num_blocks=160, max_model_len=256)
    rt = Runtime("sim", max_model_len=cfg.max_model_len, order=order, policy=policy, **rt_kwargs)
    model = Decoder(cfg, rt)
    eng = DecodeEngine(rt, model, sizes)
    eng.capture()
    return cfg, rt, model, eng


def run(eng, cfg, steps, seed=0, adversarial=False):
    """Replay ``steps`` continuous-batching steps; return the number of mismatches vs eager."""
    wl = Workload(cfg, eng.sizes, seed=seed, adversarial=adversarial)
    mismatches = 0
    for batch in wl.steps(steps):
        ref = eng.eager(batch).clone()
        out = eng.step(batch).clone()
        if not torch.equal(ref, out):
            mismatches += 1
        wl.feedback(batch.rids, out.argmax(-1).tolist())
    return mismatches
