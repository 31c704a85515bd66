"""Which attention kernel each captured graph uses: PA for small batches, FIA above.

Choosing is pure (no device work) and sits below capture; two policies, both consulted
once per attention shape of a graph at capture:

* :class:`StaticPolicy` (the default) — PA for padded sizes in ``pa_sizes``
  (default ``{1, 2, 3, 4}``, vllm-ascend's ``pa_shape_list``), FIA otherwise;
* :class:`MeasuredPolicy` — the faster kernel per size, as timed by
  :func:`npugraph.tools.measure.measure_policy` and saved to / loaded from a JSON file so that
  every rank (and the next start) makes the same choice without measuring.

Per step, :class:`UpdateFreeCosts` weighs a key's update-free graph (lengths frozen to a
width) against its graph updated per layer.

Both pick FIA whenever PA cannot run the graph: more than one query token per
request (speculative verification), or a head size or dtype PA does not support.
"""

from npugraph.policy.choice import KernelChoice, KernelPolicy
from npugraph.policy.fixed import FixedPolicy
from npugraph.policy.measured import POLICY_SCHEMA, MeasuredPolicy, PolicySignature, SizeMeasurement, load_policy
from npugraph.policy.static import DEFAULT_PA_SIZES, StaticPolicy
from npugraph.policy.width import UpdateFreeCosts, default_widths

__all__ = [
    "DEFAULT_PA_SIZES",
    "POLICY_SCHEMA",
    "FixedPolicy",
    "KernelChoice",
    "KernelPolicy",
    "MeasuredPolicy",
    "PolicySignature",
    "SizeMeasurement",
    "StaticPolicy",
    "UpdateFreeCosts",
    "default_widths",
    "load_policy",
]
