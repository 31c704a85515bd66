"""npugraph as vLLM's static graph wrapper and per-step updater (ACL graph mode).

Install without patching vLLM: the ``vllm.general_plugins`` entry point
``npugraph = npugraph.integrations.vllm:register`` runs :func:`register` in every vLLM
process.  With ``NPUGRAPH_ENABLE=1`` it makes the platform's
``get_static_graph_wrapper_cls()`` return :class:`NpuGraphWrapper` and, when
vllm-ascend is installed, replaces its graph wrapper and parameter-update functions
(see :func:`install`).  On a platform without NPU graphs it leaves vLLM untouched and
says so once in the log (``NPUGRAPH_DEVICE=sim`` forces the simulator, for testing).

The attention metadata contract (what a backend must put in
``forward_context.attn_metadata[layer_name]`` each step): either an
:class:`npugraph.AttentionMetadata`, or any object with

* ``seq_lens_list`` (list[int]) or ``seq_lens_cpu`` / ``seq_lens`` (CPU int tensor [R]),
  the key length of each request including this step's tokens;
* ``block_tables`` / ``block_table`` / ``block_table_tensor`` ([R, cols] int32);
* optionally ``query_start_loc_cpu`` / ``query_start_loc`` (CPU int [R + 1]).

MLA layers (vllm-ascend's MLA metadata): the same fields under ``decode``
(``decode.seq_lens_list``, ``decode.block_table``), and for speculative steps the
cumulative query ends ``actual_seq_lengths_q``.  Sliding-window layers belong to their
own KV-cache group: their metadata (a block table of that group's blocks) is keyed by
their layer names or by the group name.

Layers of one KV-cache group may share one metadata object; it is converted once
per step.  :class:`npugraph.attention.DecodeAttention` is the reference client.
"""

from npugraph.integrations.common import (  # noqa: F401 (the settings keep their names here)
    ENV_DEVICE,
    ENV_DEVICE_LENGTHS,
    ENV_ENABLE,
    ENV_EVENT_GROUP,
    ENV_REPORT_DIR,
    report_path,
)
from npugraph.integrations.vllm.kv_budget import GraphMemoryEstimate, estimate_graph_memory, kv_budget_missing
from npugraph.integrations.vllm.metadata import step_metadata, to_attention_metadata
from npugraph.integrations.vllm.plugin import WRAPPER_PATH, install, register, say_captured, uninstall
from npugraph.integrations.vllm.wrapper import DraftNpuGraphWrapper, NpuGraphWrapper, attach_runtime, runtime_for

__all__ = [
    "WRAPPER_PATH",
    "DraftNpuGraphWrapper",
    "GraphMemoryEstimate",
    "NpuGraphWrapper",
    "attach_runtime",
    "estimate_graph_memory",
    "install",
    "kv_budget_missing",
    "register",
    "report_path",
    "runtime_for",
    "say_captured",
    "step_metadata",
    "to_attention_metadata",
    "uninstall",
]
