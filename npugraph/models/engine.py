"""A minimal decode engine: static buffers, capture of every size, replayed steps.

It is what an inference engine does around npugraph, small enough to read: the
demo, the benchmarks and the end-to-end tests drive the decoder through it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from npugraph.metadata import AttentionMetadata
from npugraph.models.llama import Decoder
from npugraph.models.workload import StepBatch
from npugraph.runtime import Runtime

__all__ = ["DecodeEngine"]


class DecodeEngine:
    """Own the static input buffers of ``model`` and capture it at ``sizes``.

    Persistent buffers are sized for the largest capture; each graph reads the
    first ``size`` rows.  The block table buffer is refreshed by the runtime.
    """

    def __init__(
        self,
        runtime: Runtime,
        model: Decoder,
        sizes: Sequence[int],
        *,
        namespace: str = "main",
        widths: Sequence[int] = (),
        updated: bool = True,
    ) -> None:
        self.runtime = runtime
        self.model = model
        self.sizes = sorted(set(sizes))
        self.namespace = namespace
        # update-free graphs of every size at these widths; ``updated``: also each size's
        # graph updated per step (the steps longer than the widest width run it)
        self.widths = sorted(set(widths))
        self.updated = updated
        cfg = model.cfg
        n = self.sizes[-1]
        dev = runtime.device.memory
        self.buffers = {
            "input_ids": torch.zeros(n, dtype=torch.int64, device=dev),
            "positions": torch.zeros(n, dtype=torch.int64, device=dev),
            "slot_mapping": torch.zeros(n, dtype=torch.int64, device=dev),
        }
        self.block_table = torch.zeros(n, cfg.max_blocks_per_seq, dtype=torch.int32, device=dev)

    def capture(self) -> None:
        """Capture every size, largest first (its widths too, widest first)."""

        def make(size: object) -> tuple:
            assert isinstance(size, int)
            views = {k: v[:size] for k, v in self.buffers.items()}
            meta = AttentionMetadata(
                seq_lens=torch.ones(size, dtype=torch.int32, device="cpu"), block_table=self.block_table[:size]
            )
            args = (views["input_ids"], views["positions"], views["slot_mapping"], meta)
            return self.model, args, {"static_inputs": views}

        if not self.widths:
            self.runtime.capture_all(self.sizes, make, namespace=self.namespace)
            return
        for size in reversed(self.sizes):  # each size's graphs before the next smaller size's
            fn, args, kwargs = make(size)
            if self.updated:
                self.runtime.capture(fn, *args, key=size, namespace=self.namespace, **kwargs)
            for w in reversed(self.widths):
                self.runtime.capture(fn, *args, key=size, namespace=self.namespace, width=w, **kwargs)

    def step(self, batch: StepBatch) -> torch.Tensor:
        """Replay one step; return the logits of its real requests (synchronized)."""
        logits = self.runtime.step(
            batch.size,
            self.metadata(batch.meta),
            inputs={
                "input_ids": batch.input_ids,
                "positions": batch.positions,
                "slot_mapping": batch.slot_mapping,
            },
            namespace=self.namespace,
        )
        self.runtime.synchronize()
        return logits[: batch.num_reqs]

    def metadata(self, meta: AttentionMetadata) -> dict[str, AttentionMetadata]:
        """The step's metadata keyed by the model's KV-cache groups (they share one table here)."""
        return dict.fromkeys(self.model.groups, meta)

    def eager(self, batch: StepBatch) -> torch.Tensor:
        """Run the same (padded) step eagerly; return the real requests' logits.

        The step's inputs are the host's (the workload's); the model reads them on the
        device, as :meth:`step` does from its buffers."""
        dev = self.runtime.device.memory
        ids, pos, slots = (t.to(dev) for t in (batch.input_ids, batch.positions, batch.slot_mapping))
        out = self.model(ids, pos, slots, batch.padded_meta)
        self.runtime.synchronize()
        return out[: batch.num_reqs]
