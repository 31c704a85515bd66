"""Stand-in of the Sept 2026 wrapper: captures into an UpdatableGraph; after each replay the
graph's tasks are resolved from the forward context and updated (synchronize first: MRV1)."""

from __future__ import annotations

import torch
from vllm.config import CUDAGraphMode
from vllm.forward_context import get_forward_context

from vllm_ascend.compilation.updatable_graph import ContextSource, UpdatableGraph


class ACLGraphWrapper:
    def __init__(
        self, runnable, vllm_config, runtime_mode, cudagraph_options=None, *, use_eagle=False, enable_enpu=False
    ):
        self.runnable, self.vllm_config, self.runtime_mode = runnable, vllm_config, runtime_mode
        self.graphs = {}
        self.update_stream = torch.npu.Stream()

    def __call__(self, *args, **kwargs):
        ctx = get_forward_context()
        mode, key = ctx.cudagraph_runtime_mode, ctx.batch_descriptor
        if mode == CUDAGraphMode.NONE or mode != self.runtime_mode:
            return self.runnable(*args, **kwargs)
        if key not in self.graphs:
            g = UpdatableGraph()
            with torch.npu.graph(g):
                out = self.runnable(*args, **kwargs)
            self.graphs[key] = (g, out)
            return out
        g, out = self.graphs[key]
        torch.npu.current_stream().synchronize()
        g.replay()
        g.update(self.update_stream, g.resolve_tasks(ContextSource(ctx.attn_metadata)))
        return out
