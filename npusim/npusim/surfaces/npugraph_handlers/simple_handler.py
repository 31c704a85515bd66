"""PA and MLA (torch_npu's ``_npugraph_handlers/simple_handler.py``): captured as called,
their host lengths (``context_lens``, a positional argument) rewritten by an update."""

from __future__ import annotations

from npusim.surfaces.npugraph_handlers.npugraph_handler import NpuGraphOpHandler, register_npu_graph_handler

__all__: list[str] = []


@register_npu_graph_handler(["_npu_paged_attention.default", "npu_multi_head_latent_attention.out"])
class _SimpleGraphHandler(NpuGraphOpHandler):
    UPDATE_SPECS = {
        "_npu_paged_attention.default": [("arg", 7, "context_lens")],
        "npu_multi_head_latent_attention.out": [("arg", 5, "context_lens")],
    }
