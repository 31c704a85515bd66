from __future__ import annotations

import gc
import importlib
import os
import weakref

import pytest
import torch
from hypothesis import settings

import npusim as sim
from npugraph.models.engine import DecodeEngine
from tests.helpers import Harness, assert_engine_serves

# The oracle tests explore shapes at random; derandomized, every run checks the same
# examples, so a failure reproduces and CI cannot flake.
settings.register_profile("npugraph", derandomize=True, deadline=None)
settings.load_profile("npugraph")

# The simulator's npu device in this process too (tests of npu tensors run in place; the
# CPU-based tests must not notice it): what NPUGRAPH_SIM_TORCH_NPU=1 gives every process.
sim.install_npu_device()

if not os.environ.get("OMP_NUM_THREADS"):
    torch.set_num_threads(1)  # the simulator's kernels are small (the CLI does the same)


def pytest_collection_finish(session):
    """Every graph capture starts with ``gc.collect()`` (as torch's does); with torch and
    vLLM imported that walks a large heap each time.  What exists once every test module is
    imported lives for the whole run, so it is frozen out of the collector's walks.

    torch._dynamo (with sympy: about 800 modules, 120,000 objects) is imported first: the
    first capture imports it anyway (torch's graph context disables dynamo), and imported
    after the freeze its objects made every later capture's collection walk them (86 ms
    each, 7.6 of a stateful test's 14 s, 2026-12-06)."""
    import torch._dynamo  # noqa: F401  (for its objects to be frozen with the rest)

    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def fresh_device():
    """Every test starts on a fresh simulated device (no queues, zero counters)."""
    sim.configure()
    torch.manual_seed(0)
    yield
    sim.configure()
    stack = [torch._C._get_dispatch_stack_at(i) for i in range(torch._C._len_torch_dispatch_stack())]
    assert not stack, f"modes left on the torch dispatch stack after the device was reset: {stack}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call":
        item.npugraph_passed = report.passed
    return report


@pytest.fixture(autouse=True)
def serving_goes_on(request, monkeypatch):
    """After every passing test, each harness and decode engine it built serves good steps,
    right against the float64 reference: a bad step, fault or half step never stops serving.
    ``@pytest.mark.no_serving_check("why")`` opts a test out (it broke the graphs' inputs on
    purpose, or checks serving itself after every step)."""
    made: list[weakref.ref[Harness]] = []
    engines: list[weakref.ref[DecodeEngine]] = []

    def track(cls, into):
        init = cls.__init__

        def tracked(self, *args, **kwargs):
            init(self, *args, **kwargs)
            into.append(weakref.ref(self))  # weak: tests check what the runtime keeps alive

        monkeypatch.setattr(cls, "__init__", tracked)

    track(Harness, made)
    track(DecodeEngine, engines)
    yield
    if getattr(request.node, "npugraph_passed", False) and not request.node.get_closest_marker("no_serving_check"):
        for h in filter(None, (r() for r in made)):
            h.assert_serves()
        for eng in filter(None, (r() for r in engines)):
            assert_engine_serves(eng)


@pytest.fixture
def torch_npu():
    """The simulator installed as ``torch_npu`` (its module paths in ``sys.modules``: torchair,
    ``sgl_kernel_npu`` and pyACL's ``acl`` with it), uninstalled after the test."""
    sim.install_torch_npu()
    try:
        yield importlib.import_module("torch_npu")
    finally:
        sim.uninstall_torch_npu()
