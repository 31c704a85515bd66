"""Stand-in of vllm-ascend's speculative proposer (Aug 2026): like the original it imports
``ACLGraphWrapper`` by name from ``acl_graph`` and wraps its merged draft model (MTP, EAGLE)
in one FULL graph per batch descriptor, the target's descriptors."""

from __future__ import annotations

from vllm.config import CUDAGraphMode

from vllm_ascend.compilation.acl_graph import ACLGraphWrapper, update_full_graph_params

__all__ = ["ACLGraphWrapper", "AscendSpecDecodeBaseProposer", "update_full_graph_params"]


class AscendSpecDecodeBaseProposer:
    """Wraps the draft model as the original's ``_maybe_share_lm_head`` does in graph mode."""

    def __init__(self, draft_model, vllm_config):
        self.model = draft_model
        self._runnable = ACLGraphWrapper(
            draft_model, vllm_config, runtime_mode=CUDAGraphMode.FULL, use_eagle=True, enable_enpu=False
        )
