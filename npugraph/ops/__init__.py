"""One declaration per attention kernel (:class:`OpSpec`); capture and update use only these."""

from npugraph.ops.base import MIN_BLOCK, AttentionCall, DeviceLengths, LensArena, LensGroup, OpSpec
from npugraph.ops.fia import FIA
from npugraph.ops.fia_frozen import FIA_FROZEN
from npugraph.ops.fia_sink import FIA_SINK
from npugraph.ops.fia_v2 import FIA_V2
from npugraph.ops.mla import MLA
from npugraph.ops.pa import PA

__all__ = [
    "MIN_BLOCK",
    "FIA",
    "FIA_FROZEN",
    "FIA_SINK",
    "FIA_V2",
    "MLA",
    "PA",
    "SPECS",
    "AttentionCall",
    "DeviceLengths",
    "LensArena",
    "LensGroup",
    "OpSpec",
]

SPECS: dict[str, OpSpec] = {
    "pa": PA,
    "fia": FIA,
    "fia_v2": FIA_V2,
    "mla": MLA,
    "fia_sink": FIA_SINK,
    "fia_frozen": FIA_FROZEN,
}
