"""``npusim.own_seconds()``: the simulator's own host time, apart from the device's work it
runs on the host (``device_seconds``) and from the modelled cost of the real call, so that
a step's wall time splits into the program's, the simulator's and the device's."""

from __future__ import annotations

import time

import torch

import npusim as torch_npu
from npusim import npu
from npusim.runtime.config import HostCostModel

SCALE = 0.125


def _pa_args(t: int = 4, blocks: int = 64, block: int = 128, cols: int = 16) -> tuple:
    q = torch.randn(t, 8, 128, dtype=torch.float16, device="npu")
    kc = torch.randn(blocks, block, 2, 128, dtype=torch.float16, device="npu")
    vc = torch.randn(blocks, block, 2, 128, dtype=torch.float16, device="npu")
    bt = torch.randint(0, blocks, (t, cols), dtype=torch.int32, device="npu")
    return q, kc, vc, bt, torch.empty_like(q)


def _pa(q, kc, vc, bt, out, lens) -> None:
    torch_npu._npu_paged_attention(q, kc, vc, 2, 8, SCALE, bt, lens, out)


def test_the_device_work_a_launch_runs_is_not_the_simulators_own_time() -> None:
    q, kc, vc, bt, out = _pa_args()
    lens = torch.full((4,), 2048, dtype=torch.int32)
    _pa(q, kc, vc, bt, out, lens)  # warm-up
    npu.synchronize()
    own, device = torch_npu.own_seconds(), torch_npu.device_seconds()
    t0 = time.perf_counter()
    for _ in range(5):
        _pa(q, kc, vc, bt, out, lens)  # nothing queued before it: it runs inside the launch
    wall = time.perf_counter() - t0
    own, device = torch_npu.own_seconds() - own, torch_npu.device_seconds() - device
    assert device > 0 and own > 0
    assert own + device <= wall * 1.001
    assert own < device, "a long context's attention is the device's time, not the launch's"


def test_a_modelled_host_cost_is_the_callers_not_the_simulators() -> None:
    torch_npu.configure(cost_model=HostCostModel(op_launch_us=20_000.0))
    q, kc, vc, bt, out = _pa_args()
    lens = torch.full((4,), 16, dtype=torch.int32)
    own, device = torch_npu.own_seconds(), torch_npu.device_seconds()
    t0 = time.perf_counter()
    _pa(q, kc, vc, bt, out, lens)
    wall = time.perf_counter() - t0
    own, device = torch_npu.own_seconds() - own, torch_npu.device_seconds() - device
    assert wall >= 0.02
    assert 0 < own < wall - 0.02 - device + 1e-6


def test_nested_entry_points_count_once_and_a_reset_starts_from_zero() -> None:
    a, b = npu.Stream(), npu.Stream()
    own = torch_npu.own_seconds()
    t0 = time.perf_counter()
    for _ in range(2000):
        a.wait_stream(b)  # an entry point calling others (an event made, recorded, waited on)
    wall = time.perf_counter() - t0
    own = torch_npu.own_seconds() - own
    assert 0.5 * wall < own <= wall, "the loop is the simulator's own time, counted once"
    torch_npu.configure()
    assert torch_npu.own_seconds() == 0.0
