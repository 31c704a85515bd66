"""Stand-in of vllm_ascend/compilation/acl_graph.py as of Aug 2026: the names and signatures
npugraph replaces, with minimal bodies of our own that behave as the originals do."""

from __future__ import annotations

import torch
import torch_npu  # noqa: F401  (imported at module level, as the original does)
from vllm.config import CUDAGraphMode
from vllm.forward_context import get_forward_context


class GraphParams:
    """Per padded token count: the recorded events, workspaces, task handles and arguments."""

    def __init__(self, sizes):
        self.events = {s: [] for s in sizes}
        self.workspaces = dict.fromkeys(sizes)
        self.handles = {s: [] for s in sizes}
        self.attn_params = {s: [] for s in sizes}


_graph_params: GraphParams | None = None


def set_graph_params(aclgraph_capture_sizes):
    global _graph_params
    _graph_params = GraphParams(aclgraph_capture_sizes)


def get_graph_params():
    return _graph_params


def update_graph_params_workspaces(num_tokens, workspace):
    if _graph_params is not None:
        _graph_params.workspaces[num_tokens] = workspace


class ACLGraphWrapper:
    """Capture on the first call of a batch descriptor (forward context says ``capturing``), replay after."""

    def __init__(
        self, runnable, vllm_config, runtime_mode, cudagraph_options=None, *, use_eagle=False, enable_enpu=False
    ):
        self.runnable, self.vllm_config, self.runtime_mode = runnable, vllm_config, runtime_mode
        self.graphs = {}

    def __call__(self, *args, **kwargs):
        ctx = get_forward_context()
        mode, key = ctx.cudagraph_runtime_mode, ctx.batch_descriptor
        if mode == CUDAGraphMode.NONE or mode != self.runtime_mode:
            return self.runnable(*args, **kwargs)
        if key not in self.graphs:
            g = torch.npu.NPUGraph()
            ctx.capturing = True
            try:
                with torch.npu.graph(g):
                    out = self.runnable(*args, **kwargs)
            finally:
                ctx.capturing = False
            self.graphs[key] = (g, out)
            return out
        g, out = self.graphs[key]
        torch.npu.current_stream().synchronize()
        g.replay()
        return out


def update_full_graph_params(
    attn_backend,
    update_stream,
    forward_context,
    num_tokens,
    vllm_config,
    speculative_config=None,
    draft_attn_metadatas=None,
):
    impl_cls = attn_backend.get_impl_cls()
    impl_cls.update_graph_params(
        update_stream,
        forward_context,
        num_tokens,
        vllm_config,
        speculative_config,
        draft_attn_metadatas=draft_attn_metadatas,
    )
