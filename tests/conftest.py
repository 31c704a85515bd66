from __future__ import annotations

import pytest
import torch

from npugraph import sim


@pytest.fixture(autouse=True)
def fresh_device():
    """Every test starts on a fresh simulated device (no queues, zero counters)."""
    sim.configure()
    torch.manual_seed(0)
    yield
    sim.configure()
