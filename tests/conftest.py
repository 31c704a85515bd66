from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

from npugraph import sim

# The oracle tests explore shapes at random; derandomized, every run checks the same
# examples, so a failure reproduces and CI cannot flake.
settings.register_profile("npugraph", derandomize=True, deadline=None)
settings.load_profile("npugraph")

if not os.environ.get("OMP_NUM_THREADS"):
    torch.set_num_threads(1)  # the simulator's kernels are small (the CLI does the same)


@pytest.fixture(autouse=True)
def fresh_device():
    """Every test starts on a fresh simulated device (no queues, zero counters)."""
    sim.configure()
    torch.manual_seed(0)
    yield
    sim.configure()
