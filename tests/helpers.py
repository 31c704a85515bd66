from __future__ import annotations

import contextlib
import random

import torch

from npugraph import AttentionMetadata, DecodeAttention, Runtime
from npugraph.errors import NpuGraphError
from npugraph.models import Decoder, DecoderConfig, Workload
from npugraph.models.engine import DecodeEngine
from npugraph.reference import paged_attention_reference

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


def assert_engine_serves(eng, steps=3, seed=99):
    """A decode engine's graphs serve good steps: equal to eager bitwise and, every step,
    close to the float64-attention reference (``Decoder.reference_logits``), which runs
    none of npugraph's padding or kernels.  An error an earlier bad step left for the
    device to report comes out at the first synchronize; it belongs to that step."""
    rt = eng.runtime
    with contextlib.suppress(NpuGraphError):
        rt.synchronize()
    if not rt.entries(eng.namespace):
        return
    for i, b in enumerate(Workload(eng.model.cfg, eng.sizes, seed=seed).steps(steps)):
        if not rt.has(b.size, namespace=eng.namespace):
            continue
        ref = eng.eager(b).clone()
        got = eng.step(b).clone()
        assert torch.equal(got, ref), f"serving step {i} differs from eager"
        lens = b.meta.seq_lens.tolist()
        ind = eng.model.reference_logits(
            b.input_ids, b.positions, b.slot_mapping, lens, [1] * len(lens), b.meta.block_table
        )
        assert (got - ind).abs().max() < 0.06 * ind.abs().max(), f"serving step {i} from the float64 reference"


def equal_on_host(a, b):
    """``torch.equal``, read on the host (a host read of device memory waits for the stream)."""
    return torch.equal(a.cpu(), b.cpu())


def close_on_host(a, b, **kw):
    """``torch.allclose``, read on the host."""
    return torch.allclose(a.cpu(), b.cpu(), **kw)


HEADS, KV_HEADS, HEAD, BLOCK, BLOCKS, MAX_LEN = 4, 2, 64, 16, 48, 128
TOL = {torch.float16: 4e-3, torch.bfloat16: 3e-2, torch.float32: 1e-4}


class Harness:
    """Attention layers over caches the test wrote, captured at ``sizes``; outputs per layer.

    ``groups`` maps layer name to its KV-cache group; each group has its own block-table
    buffer.  ``ubatches`` > 1 runs every layer once per micro-batch in one forward.
    ``windows`` maps a layer to its sliding window; ``blocks`` to its KV cache's block count.
    """

    def __init__(
        self,
        sizes,
        *,
        layers=2,
        groups=None,
        policy=None,
        dtype=torch.float16,
        tokens_per_request=1,
        ubatches=1,
        seed=0,
        windows=None,
        blocks=None,
        capture=True,
        **rt_kwargs,
    ):
        self.rt = Runtime("sim", max_model_len=MAX_LEN, policy=policy, **rt_kwargs)
        self.dtype, self.tpr, self.ubatches = dtype, tokens_per_request, ubatches
        self.names = [f"layer{i}" for i in range(layers)]
        self.groups = groups or dict.fromkeys(self.names, "default")
        self.windows = windows or {}
        gen = torch.Generator().manual_seed(seed)
        shapes = {n: ((blocks or {}).get(n, BLOCKS), BLOCK, KV_HEADS, HEAD) for n in self.names}
        dev = self.dev = self.rt.device.memory  # the caches, query and tables live in device memory
        self.caches = {
            n: (
                torch.randn(shapes[n], generator=gen).to(dtype).to(dev),
                torch.randn(shapes[n], generator=gen).to(dtype).to(dev),
            )
            for n in self.names
        }
        self.attn = {
            n: DecodeAttention(
                self.rt,
                n,
                num_heads=HEADS,
                num_kv_heads=KV_HEADS,
                head_size=HEAD,
                group=self.groups[n],
                tokens_per_request=tokens_per_request,
                window=self.windows.get(n),
            )
            for n in self.names
        }
        top = max(sizes)
        self.query = torch.zeros(ubatches, top * tokens_per_request, HEADS, HEAD, dtype=dtype, device=dev)
        self.tables = {
            g: torch.zeros(ubatches, top, MAX_LEN // BLOCK, dtype=torch.int32, device=dev)
            for g in set(self.groups.values())
        }
        self.rng = random.Random(seed)
        if capture:
            self.capture(sizes)

    def capture(self, sizes):
        """Capture every size, largest first (the host lengths are the test's: on the CPU)."""
        tokens_per_request, ubatches = self.tpr, self.ubatches

        def make(size):
            t = size * tokens_per_request
            metas = [
                {
                    g: AttentionMetadata(
                        seq_lens=torch.full((size,), tokens_per_request, dtype=torch.int32, device="cpu"),
                        block_table=tb[u, :size],
                    )
                    for g, tb in self.tables.items()
                }
                for u in range(ubatches)
            ]
            q = self.query[:, :t]
            return self.forward, (q, metas), {"tokens": t, "static_inputs": {"query": q}}

        self.rt.capture_all(sizes, make)

    def forward(self, query, metas):
        outs = []
        for u in range(self.ubatches):
            row = []
            for n in self.names:
                k, v = self.caches[n]
                row.append(self.attn[n](query[u], k, v, metas[u][self.groups[n]], ubatch=u))
            outs.append(torch.stack(row))
        return torch.stack(outs)  # [ubatch, layer, T, N, D]

    def random_meta(self, r, lens=None, *, rng=None, blocks=BLOCKS):
        """R requests with random lengths (at least their query tokens) and distinct blocks
        among the first ``blocks`` (drawn from ``rng``, default the harness's own)."""
        rng = rng or self.rng
        lens = lens or [rng.randint(self.tpr, MAX_LEN) for _ in range(r)]
        table = torch.zeros(r, MAX_LEN // BLOCK, dtype=torch.int32)
        for i, n in enumerate(lens):
            used = -(-n // BLOCK)
            table[i, :used] = torch.tensor(rng.sample(range(blocks), used), dtype=torch.int32)
        qsl = None if self.tpr == 1 else torch.arange(0, (r + 1) * self.tpr, self.tpr, dtype=torch.int32)
        return AttentionMetadata(seq_lens=torch.tensor(lens, dtype=torch.int32), block_table=table, query_start_loc=qsl)

    def reference(self, name, q, meta):
        k, v = self.caches[name]
        r = meta.num_reqs
        qlens = [self.tpr] * r
        return paged_attention_reference(
            q[: r * self.tpr],
            k,
            v,
            meta.block_table,
            meta.seq_lens.tolist(),
            self.attn[name].scale,
            qlens,
            window=self.windows.get(name),
        )

    def step(self, size, metadata, q):
        out = self.rt.step(size, metadata, inputs={"query": q})
        self.rt.synchronize()
        return out

    def check(self, out, q, metas_by_layer, ubatch=0):
        """Every layer's real rows match the reference; padding rows are zeros."""
        for li, n in enumerate(self.names):
            meta = metas_by_layer[n]
            real = meta.num_reqs * self.tpr
            ref = self.reference(n, q[ubatch], meta)
            got = out[ubatch, li, :real].cpu().double()  # read on the host (synchronized)
            err = (got - ref).abs().max().item() if real else 0.0
            assert err < TOL[self.dtype], f"layer {n} ubatch {ubatch}: {err} from the float64 reference"
            assert not out[ubatch, li, real:].any(), f"layer {n}: padding rows must be zeros"

    def assert_serves(self, seed=1234):
        """Every captured graph serves a good step, right against the float64 reference.

        The conftest runs it after every passing test that built a harness: whatever the
        test did (bad steps, faults, half steps), serving goes on.  An error an earlier bad
        step left for the device to report comes out at the first synchronize, as documented;
        it belongs to that step, not to this one.
        """
        with contextlib.suppress(NpuGraphError):
            self.rt.synchronize()
        rng = random.Random(seed)
        blocks = min(int(k.shape[0]) for k, _ in self.caches.values())
        for entry in self.rt.entries("main"):
            size = entry.key
            if not isinstance(size, int) or not entry.tasks:
                continue
            meta = self.random_meta(1 if size == 1 else size - 1, rng=rng, blocks=blocks)
            groups = {g: meta for g in set(self.groups.values())}
            metadata = groups if self.ubatches == 1 else [groups] * self.ubatches
            q = query_for(self, size, seed)
            out = self.step(size, metadata, q)
            layers = [t.layer for t in entry.tasks[: len(entry.tasks) // self.ubatches]]
            for u in range(self.ubatches):
                for li, name in enumerate(layers):  # the graph's own layers (a test may trim self.names)
                    real = meta.num_reqs * self.tpr
                    got = out[u, li, :real].cpu().double()
                    err = (got - self.reference(name, q[u], meta)).abs().max().item()
                    assert err < TOL[self.dtype], f"{name} of graph {size}: {err} from the float64 reference"
                    assert not out[u, li, real:].any(), f"{name} of graph {size}: padding rows must be zeros"


def query_for(h, size, seed):
    """A random query of ``size`` requests for harness ``h``, in its device memory (drawn on the host)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(h.ubatches, size * h.tpr, HEADS, HEAD, generator=g).to(h.dtype).to(h.dev)
