"""One declaration per attention kernel (:class:`OpSpec`); capture and update use only these."""

from npugraph.ops.base import AttentionCall, OpSpec, StepLens, pad_lens
from npugraph.ops.fia import FIA
from npugraph.ops.pa import PA

__all__ = ["FIA", "PA", "SPECS", "AttentionCall", "OpSpec", "StepLens", "pad_lens"]

SPECS: dict[str, OpSpec] = {"pa": PA, "fia": FIA}
