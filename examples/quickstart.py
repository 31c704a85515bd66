"""Capture a model, then decode with replay: the README's 15 lines, runnable."""

import torch

from npugraph import AttentionMetadata, Runtime
from npugraph.models import Decoder, DecoderConfig, Workload

cfg = DecoderConfig(layers=4)
rt = Runtime("sim", max_model_len=cfg.max_model_len)  # "npu" on an Ascend host
model = Decoder(cfg, rt)  # its attention layers are npugraph DecodeAttention clients
dev = rt.device.memory  # where the device's memory is: npu:0 (the simulator's npu device too)
bufs = {name: torch.zeros(8, dtype=torch.int64, device=dev) for name in ("input_ids", "positions", "slot_mapping")}
table = torch.zeros(8, cfg.max_blocks_per_seq, dtype=torch.int32, device=dev)  # the graphs' block-table buffer
for size in (8, 4, 2, 1):  # largest first: smaller graphs reuse the shared pool
    ins = {name: buf[:size] for name, buf in bufs.items()}
    meta = AttentionMetadata(seq_lens=torch.ones(size, dtype=torch.int32), block_table=table[:size])
    rt.capture(model, *ins.values(), meta, key=size, static_inputs=ins)
worst = 0.0
for b in Workload(cfg, [1, 2, 4, 8]).steps(50):  # continuous batching, padded to a captured size
    inputs = {"input_ids": b.input_ids, "positions": b.positions, "slot_mapping": b.slot_mapping}
    logits = rt.step(b.size, {"default": b.meta}, inputs=inputs)[: b.num_reqs]
    rt.synchronize()  # before reading logits on the host
    lens = b.meta.seq_lens.tolist()  # the same step with float64 attention, no npugraph on its path:
    ref = model.reference_logits(b.input_ids, b.positions, b.slot_mapping, lens, [1] * len(lens), b.meta.block_table)
    worst = max(worst, float((logits - ref).abs().max() / ref.abs().max()))  # read on the host, synchronized
for row in rt.summary():
    print(f"size {row['key']}: {row['kernel']} ({row['reason']}), {row['replays']} replays")
print(
    f"50 steps; worst error against the float64 reference {worst:.3f} of the largest logit:",
    "OK" if worst < 0.05 else "TOO LARGE",
)
