"""vllm-ascend's ``tests/ut/conftest.py``, for running its NPU tests on npugraph's simulator.

The release's own conftest mocks ``torch_npu`` (and ``torch.npu``) with ``MagicMock`` when
``npu-smi`` is absent, so its kernels never run.  Here nothing is mocked: the environment
loads the simulator as ``torch_npu`` (``NPUGRAPH_SIM_TORCH_NPU=1``: ``import torch`` installs
it), and ``torch.device("npu")`` is the simulator's device.  The rest is the release's own
set-up: vllm-ascend's patches and custom-op registrations, as its conftest makes them.
"""

import os
import sys

import pytest
import torch_npu
from vllm_ascend.utils import adapt_patch, clear_enable_sp, register_ascend_customop

assert os.environ.get("NPUGRAPH_SIM_TORCH_NPU") == "1", "run through release/run.sh (make release-check)"
assert torch_npu.__name__ == "npusim", f"torch_npu is {torch_npu.__name__}, not npugraph's simulator"

adapt_patch()
adapt_patch(True)
register_ascend_customop()


@pytest.fixture(autouse=True)
def _clear_enable_sp_before_test():
    clear_enable_sp()
    yield


@pytest.fixture(autouse=True)
def _reset_stream_globals_before_test():
    """0.30's own set-up: the streams ``vllm_ascend.utils.current_stream()`` caches, dropped
    around each test (its tests patch streams).  0.23 caches none of them."""
    import vllm_ascend.utils as utils

    moe = sys.modules.get("vllm_ascend.ops.fused_moe.moe_utils")
    names = ("_CURRENT_STREAM", "_GLOBAL_STREAM", "_SHARED_EXPERTS_CALCULATION_STREAM")
    cached = [(m, n) for m, n in [*((utils, n) for n in names), (moe, "COMM_STREAM")] if hasattr(m, n)]

    def drop() -> None:
        for module, name in cached:
            setattr(module, name, None)

    drop()
    yield
    drop()
