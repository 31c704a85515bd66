"""Stand-in of the model runner's per-step graph update (Aug 2026): it imports
``update_full_graph_params`` by name, so a replacement must reach this module too."""

from __future__ import annotations

from vllm_ascend.compilation.acl_graph import ACLGraphWrapper, update_full_graph_params

__all__ = ["ACLGraphWrapper", "_update_full_graph_params_if_needed"]


def _update_full_graph_params_if_needed(attn_backend, update_stream, forward_context, num_tokens, vllm_config):
    """After each FULL replay the runner re-issues every attention task with this step's lengths."""
    update_full_graph_params(attn_backend, update_stream, forward_context, num_tokens, vllm_config)
