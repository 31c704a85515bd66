"""conftest.py for vllm-ascend's own kernel tests from its nightly e2e suite (release/run.sh
copies both into a folder of their own): the e2e suite's conftest downloads models with
modelscope, which these kernel tests do not use.  What they need of it is what vllm-ascend's
worker does at start-up on a device: its ops imported in the order that closes their import
cycle (as npugraph's plugin imports them), and Triton's device properties read (the vector
core count the kernels size their grids with)."""

import vllm_ascend.ops  # noqa: F401
from vllm_ascend.ops.triton.triton_utils import init_device_properties_triton

init_device_properties_triton()
