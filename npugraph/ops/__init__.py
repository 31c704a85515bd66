"""One declaration per attention kernel (:class:`OpSpec`); capture and update use only these."""

from npugraph.ops.base import AttentionCall, OpSpec, StepLens, batch_refusal, pad_lens
from npugraph.ops.fia import FIA
from npugraph.ops.fia_v2 import FIA_V2
from npugraph.ops.mla import MLA
from npugraph.ops.pa import PA

__all__ = ["FIA", "FIA_V2", "MLA", "PA", "SPECS", "AttentionCall", "OpSpec", "StepLens", "batch_refusal", "pad_lens"]

SPECS: dict[str, OpSpec] = {"pa": PA, "fia": FIA, "fia_v2": FIA_V2, "mla": MLA}
