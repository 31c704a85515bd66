"""Stand-in: the runner builds its FULL wrapper through vllm-ascend's name."""

from __future__ import annotations

from vllm_ascend.compilation.acl_graph import ACLGraphWrapper

__all__ = ["ACLGraphWrapper"]
