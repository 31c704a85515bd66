"""npugraph: capture Ascend NPU graphs for LLM decoding and rewrite their kernel lengths per step.

The public surface: :class:`Runtime` (capture / update / replay / step),
:class:`AttentionMetadata` (what a backend provides per step),
:class:`~npugraph.attention.DecodeAttention` (the thin attention client), and the
pieces it is made of: :mod:`npugraph.capture`, :mod:`npugraph.replay`,
:mod:`npugraph.ops`, :mod:`npugraph.device`, :mod:`npusim`.
"""

from npugraph._version import __version__
from npugraph.attention import DecodeAttention, MLAAttention
from npugraph.errors import NpuGraphError
from npugraph.metadata import AttentionMetadata
from npugraph.runtime import PAD_SLOT_ID, Runtime

__all__ = [
    "PAD_SLOT_ID",
    "AttentionMetadata",
    "DecodeAttention",
    "MLAAttention",
    "NpuGraphError",
    "Runtime",
    "__version__",
]
