"""Continuous-batching decode workload: requests arrive, decode and finish.

Blocks come from a free list and go back to it when a request finishes, so block
tables are non-contiguous and blocks are reused.  Every block, block 0 included, may
belong to a request: padding tokens get the padding slot ``PAD_SLOT_ID = -1``, which
the KV-cache write skips.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

import attrs
import torch

from npugraph.errors import ConfigError
from npugraph.metadata import AttentionMetadata
from npugraph.models.llama import DecoderConfig
from npugraph.runtime import PAD_SLOT_ID

__all__ = ["Request", "StepBatch", "Workload"]


@attrs.define
class Request:
    """One request: its prompt length, how many tokens it will decode, its blocks."""

    rid: int
    context: int  # tokens already in the cache
    remaining: int
    blocks: list[int]
    last_token: int


@attrs.frozen(kw_only=True, eq=False)
class StepBatch:
    """One decode step: R requests, one new token each, padded to ``size`` tokens."""

    size: int
    num_reqs: int
    input_ids: torch.Tensor  # [size] int64
    positions: torch.Tensor  # [size] int64
    slot_mapping: torch.Tensor  # [size] int64 (padding → PAD_SLOT_ID, written nowhere)
    meta: AttentionMetadata  # seq_lens [R], block_table [R, cols] (host)
    padded_meta: AttentionMetadata  # the same, padded to [size] (for eager reference)
    rids: tuple[int, ...]


class Workload:
    """Generate decode steps for a stream of requests under continuous batching."""

    def __init__(
        self,
        cfg: DecoderConfig,
        sizes: Sequence[int],
        *,
        seed: int = 0,
        max_batch: int | None = None,
        adversarial: bool = False,
        device: torch.device | str = "cpu",
    ) -> None:
        if cfg.max_model_len < 3:
            # a prompt token and up to two output tokens: the least a request of this workload asks
            raise ConfigError(f"max_model_len must be at least 3 for this workload, got {cfg.max_model_len}")
        self.cfg = cfg
        self.device = torch.device(device)  # where token inputs live (the model's device)
        self.sizes = sorted(sizes)
        self.rng = random.Random(seed)
        self.max_batch = max_batch or self.sizes[-1]
        self.adversarial = adversarial
        self.free = list(range(cfg.num_blocks))
        self.rng.shuffle(self.free)
        self.running: list[Request] = []
        self._next = 0
        self._target = self.rng.choice(self._targets())

    @staticmethod
    def blocks_per_request(cfg: DecoderConfig) -> int:
        """The most blocks one request of this workload takes (prompt and output together)."""
        longest = min(cfg.max_model_len - 1, cfg.max_model_len // 3 + max(2, cfg.max_model_len // 8))
        return -(-longest // cfg.block_size)

    def _admit(self) -> None:
        cfg = self.cfg
        # the load drifts between near-idle and full so that every size is visited
        if self.rng.random() < 0.15:
            self._target = self.rng.choice(self._targets())
        target = max(1, min(self.max_batch, self._target))
        while len(self.running) > target and self.rng.random() < 0.5:
            # preemption: the scheduler evicts a request and frees its blocks
            victim = self.running.pop(self.rng.randrange(len(self.running)))
            self.free.extend(victim.blocks)
        while len(self.running) < target:
            prompt = self.rng.randint(1, cfg.max_model_len // 3)
            out = self.rng.randint(1, max(2, cfg.max_model_len // 8))
            if self.adversarial and self.rng.random() < 0.3:
                prompt = self.rng.choice([1, cfg.max_model_len - out - 1])
            prompt = max(1, min(prompt, cfg.max_model_len - out - 1))
            need = -(-(prompt + out) // cfg.block_size)
            if need > len(self.free):
                break
            blocks = [self.free.pop() for _ in range(need)]
            self.running.append(Request(self._next, prompt, out, blocks, self.rng.randrange(cfg.vocab_size)))
            self._next += 1

    def _targets(self) -> list[int]:
        return [1, 2, 3, 4, max(1, self.max_batch // 4), max(1, self.max_batch // 2), self.max_batch]

    def _retire(self) -> None:
        keep = []
        for r in self.running:
            if r.remaining <= 0:
                self.free.extend(r.blocks)
            else:
                keep.append(r)
        self.running = keep

    def steps(self, n: int) -> Iterator[StepBatch]:
        """Yield ``n`` decode steps; :meth:`feedback` may set each step's sampled tokens."""
        for _ in range(n):
            self._retire()
            self._admit()
            if self.rng.random() < 0.2:
                self.rng.shuffle(self.running)
            yield self._batch()
            for r in self.running:
                r.context += 1
                r.remaining -= 1

    def feedback(self, rids: Sequence[int], tokens: Sequence[int]) -> None:
        by = {r.rid: r for r in self.running}
        for rid, tok in zip(rids, tokens):
            if rid in by:
                by[rid].last_token = int(tok)

    def _batch(self) -> StepBatch:
        cfg = self.cfg
        reqs = self.running
        r = len(reqs)
        size = next(s for s in self.sizes if s >= r)
        cols = cfg.max_blocks_per_seq
        # Built on the host (seq_lens must stay there; the block table may live on either side).
        ids = torch.zeros(size, dtype=torch.int64, device="cpu")
        pos = torch.zeros(size, dtype=torch.int64, device="cpu")
        slots = torch.full((size,), PAD_SLOT_ID, dtype=torch.int64, device="cpu")
        bt = torch.zeros(r, cols, dtype=torch.int32, device="cpu")
        lens = torch.zeros(r, dtype=torch.int32, device="cpu")
        for i, q in enumerate(reqs):
            p = q.context  # position of the new token
            ids[i] = q.last_token
            pos[i] = p
            slots[i] = q.blocks[p // cfg.block_size] * cfg.block_size + p % cfg.block_size
            bt[i, : len(q.blocks)] = torch.tensor(q.blocks, dtype=torch.int32, device="cpu")
            lens[i] = p + 1
        padded_bt = torch.zeros(size, cols, dtype=torch.int32, device="cpu")
        padded_bt[:r] = bt
        padded_lens = torch.zeros(size, dtype=torch.int32, device="cpu")
        padded_lens[:r] = lens
        dev = self.device
        return StepBatch(
            size=size,
            num_reqs=r,
            input_ids=ids.to(dev),
            positions=pos.to(dev),
            slot_mapping=slots.to(dev),
            meta=AttentionMetadata(seq_lens=lens, block_table=bt),
            padded_meta=AttentionMetadata(seq_lens=padded_lens, block_table=padded_bt),
            rids=tuple(q.rid for q in reqs),
        )
