"""The simulator as a real torch device, ``npu``, in every process that asks for it.

Each test runs a fresh Python process with ``NPUGRAPH_SIM_TORCH_NPU=1`` (torch allows one
PrivateUse1 backend per process, and renaming it is for good): what a vllm-ascend
developer's process sees after ``import torch, torch_npu``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import pytest

from npusim_hook import ENV, SHORT_ENV


def _run(code: str, *, env: dict[str, str] | None = None, timeout: int = 240) -> str:
    """Run ``code`` as a script (spawned children import its functions from it)."""
    full = {**os.environ, ENV: "1", **(env or {})}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "script.py"
        script.write_text(textwrap.dedent(code))
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=full, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_npu_tensors_behave_as_with_torch_npu():
    out = _run(
        """
        import torch, torch_npu
        import npusim as sim
        assert torch_npu is sim and torch.npu is sim.npu
        a = torch.ones(4, device="npu")
        assert a.device == torch.device("npu:0") and a.is_npu and str(a.device) == "npu:0"
        b = torch.arange(6.0).npu()
        assert b.device.type == "npu" and torch.equal(b.cpu(), torch.arange(6.0))
        c = b.to("npu:1")
        assert c.device == torch.device("npu:1") and c.data_ptr() != b.data_ptr()
        # real storage and pointers: views and aliases share the memory
        v = b.view(2, 3).t()
        assert v.device == b.device and v.data_ptr() == b.data_ptr()
        w = sim._C._weak_ref_tensor(b)
        assert w.data_ptr() == b.data_ptr() and w.device == b.device
        v.mul_(2)
        assert b.cpu().tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
        # every aten op: the CPU kernels' math on that memory
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(5, 7, generator=g), torch.randn(7, 3, generator=g)
        assert torch.allclose((x.npu() @ y.npu()).cpu(), x @ y)
        assert torch.allclose(torch.softmax(x.npu(), -1).cpu(), torch.softmax(x, -1))
        assert (x.npu()[x.npu() > 0]).cpu().tolist() == x[x > 0].tolist()
        assert x.npu().to(torch.float16).dtype == torch.float16
        assert torch.nn.Linear(7, 3).npu()(x.npu()).device.type == "npu"
        # an out= argument the kernel grows
        o = torch.empty(0, device="npu"); torch.add(a, a, out=o)
        assert o.device.type == "npu" and o.cpu().tolist() == [2.0] * 4
        # mixed devices are refused, as torch_npu refuses them (a 0-d CPU tensor is a scalar)
        try:
            a + torch.ones(4)
        except RuntimeError as e:
            assert "Expected all tensors to be on the same device" in str(e)
        else:
            raise AssertionError("npu + cpu was accepted")
        assert (a + torch.tensor(2.0)).cpu().tolist() == [3.0] * 4
        # host memory stays host memory; pinned memory is told apart by pointer
        p = torch.empty(8).pin_memory()
        assert p.is_pinned() and p.device.type == "cpu" and not torch.empty(8).is_pinned()
        q = torch.zeros(8, device="npu"); q.copy_(p, non_blocking=True)
        print("ok")
        """
    )
    assert out.strip().endswith("ok")


def test_torch_npu_surface_vllm_ascend_touches_at_start_up():
    out = _run(
        """
        import torch, torch_npu
        npu = torch.npu
        before = npu.memory_allocated()
        t = torch.empty(1 << 20, dtype=torch.uint8, device="npu")
        assert npu.memory_allocated() - before == 1 << 20, (npu.memory_allocated(), before)
        assert npu.max_memory_allocated() >= npu.memory_allocated() and npu.memory_reserved() >= 1 << 20
        free, total = npu.mem_get_info()
        assert total == 64 << 30 and free == total - npu.memory_allocated()
        assert npu.memory_stats()["allocated_bytes.all.current"] == npu.memory_allocated()
        del t
        assert npu.memory_allocated() == before
        npu.reset_peak_memory_stats()
        assert npu.max_memory_allocated() == before
        assert npu.get_device_name(0) == "Ascend910B1" and torch_npu.npu.get_soc_version() == 220
        assert npu.get_device_properties(0).total_memory == total and npu.device_count() == 8
        npu.set_device(1); assert npu.current_device() == 1
        assert torch.empty(1, device="npu").device == torch.device("npu:1")
        with npu.device(0):
            assert torch.empty(1, device="npu").device == torch.device("npu:0")
        npu.config.allow_internal_format = True
        npu.set_compile_mode(jit_compile=False)
        s = npu.Stream(); npu.set_stream(s); assert npu.current_stream() is s
        torch_npu._C._npu_setStream(npu.default_stream())
        from torch_npu.op_plugin.atb._atb_ops import _register_atb_extensions
        from torch_npu.profiler import dynamic_profile as dp
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL
        from torch.distributed import is_hccl_available
        _register_atb_extensions(); dp.init("/tmp", None); dp.step()
        assert is_hccl_available() and ProcessGroupHCCL.Options() is not None
        for name in ("NPUPluggableAllocator", "MemPool", "use_mem_pool"):
            try:
                getattr(npu.memory, name)()
            except RuntimeError as e:
                assert "not simulated" in str(e)
            else:
                raise AssertionError(name)
        torch.manual_seed(3); a = torch.randn(4, device="npu")
        torch.manual_seed(3); assert torch.equal(a.cpu(), torch.randn(4, device="npu").cpu())
        # vLLM's dummy weights: a generator per parameter, seeded, on the parameter's device
        g = torch.Generator(device="npu"); g.manual_seed(7)
        w = torch.empty(5, device="npu").uniform_(-1, 1, generator=g)
        g.manual_seed(7); assert torch.equal(w.cpu(), torch.empty(5).uniform_(-1, 1, generator=g))
        # pyACL's copy between raw addresses (vllm-ascend's worker imports acl.rt.memcpy)
        from acl.rt import memcpy
        src = torch.arange(8, dtype=torch.int32, device="npu"); dst = torch.zeros(8, dtype=torch.int32, device="npu")
        assert memcpy(dst.data_ptr(), 32, src.data_ptr(), 32, 3) == 0 and torch.equal(dst.cpu(), src.cpu())
        assert memcpy(dst.data_ptr(), 16, src.data_ptr(), 32, 3) != 0  # count over dest_max: refused
        print("ok")
        """,
        env={"NPUGRAPH_SIM_MEMORY_GB": "64"},  # a card of a real one's size
    )
    assert out.strip().endswith("ok")


def test_a_spawned_child_sees_the_same_and_import_torch_npu_first_works():
    out = _run(
        """
        import multiprocessing as mp

        def child(q):
            import torch
            q.put((str(torch.ones(2, device="npu").device), type(torch.npu).__name__, torch.npu.get_device_name()))

        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            p = ctx.Process(target=child, args=(q,))
            p.start()
            print(q.get(timeout=120))
            p.join()
        """
    )
    assert "('npu:0', 'module', 'Ascend910B1')" in out
    # the .pth finder: `import torch_npu` before torch
    first = _run(
        """
        import npusim_hook
        npusim_hook.from_pth()
        import torch_npu
        import torch
        print(torch_npu.__name__, torch.zeros(1, device="npu:1").device)
        """
    )
    assert first.strip() == "npusim npu:1"


def test_without_the_variable_nothing_changes():
    out = _run(
        """
        import importlib.util, torch
        assert not hasattr(torch, "npu") and importlib.util.find_spec("torch_npu") is None
        try:
            torch.device("npu")
        except RuntimeError:
            print("ok")
        """,
        env={ENV: "0"},
    )
    assert out.strip() == "ok"


@pytest.mark.parametrize(
    "first, variable",
    [("torch", SHORT_ENV), ("torch_npu", SHORT_ENV), ("npusim", ENV), ("npusim.device.backend", ENV)],
)
def test_the_simulator_is_torch_npu_whichever_is_imported_first(first, variable):
    """NPUSIM_TORCH_NPU=1 (or its first name) gives the simulator as torch_npu whichever module
    comes first: torch (its autoload), torch_npu (the finder npusim.pth installs), or npusim
    itself, which imports torch while half-loaded (torch's autoload must wait for it)."""
    out = _run(
        f"""
        import {first}
        import torch, torch_npu
        import npusim
        assert torch_npu is npusim and torch.npu is npusim.npu
        print(torch.ones(2, device="npu").device)
        """,
        env={ENV: "", SHORT_ENV: "", variable: "1"},
    )
    assert out.strip() == "npu:0"


def test_hccl_at_world_size_two():
    out = _run(
        f"""
        import os
        import torch
        import torch.distributed as dist
        import torch.multiprocessing as mp

        def worker(rank, size):
            dist.init_process_group("hccl", init_method="tcp://127.0.0.1:{_port()}", rank=rank, world_size=size)
            torch.npu.set_device(rank)
            t = torch.full((4,), float(rank + 1), device=f"npu:{{rank}}")
            dist.all_reduce(t)
            gathered = [torch.empty(4, device="npu") for _ in range(size)]
            dist.all_gather(gathered, torch.full((4,), float(rank), device="npu"))
            b = torch.full((2,), float(rank + 7), device="npu")
            dist.broadcast(b, 1)
            dist.barrier()
            assert t.device == torch.device(f"npu:{{rank}}") and dist.get_backend() == "hccl"
            # the tensor collectives (torch 2.14 sends them to group.all_gather_single / reduce_scatter_single)
            flat = torch.empty(2 * size, device="npu")
            dist.all_gather_into_tensor(flat, torch.full((2,), float(rank), device="npu"))
            part = torch.empty(2, device="npu")
            dist.reduce_scatter_tensor(part, torch.arange(2.0 * size, device="npu"))
            line = (
                f"{{rank}} {{t.cpu().tolist()}} {{[g.cpu().tolist()[0] for g in gathered]}} {{b.cpu().tolist()}}"
                f" {{flat.cpu().tolist()}} {{part.cpu().tolist()}}"
            )
            # a group has its name, and destroying groups (vllm-ascend's shutdown) says nothing
            sub = dist.new_group([0, 1], backend="hccl")
            assert dist.group.WORLD.group_name and sub.group_name
            os.write(1, (line + "\\n").encode())  # one write: the two ranks' lines never interleave
            dist.destroy_process_group(sub)
            dist.destroy_process_group()

        if __name__ == "__main__":
            mp.spawn(worker, args=(2,), nprocs=2)
        """
    )
    assert "0 [3.0, 3.0, 3.0, 3.0] [0.0, 1.0] [8.0, 8.0] [0.0, 0.0, 1.0, 1.0] [0.0, 2.0]" in out
    assert "1 [3.0, 3.0, 3.0, 3.0] [0.0, 1.0] [8.0, 8.0] [0.0, 0.0, 1.0, 1.0] [4.0, 6.0]" in out


def test_a_collective_captured_in_a_graph_runs_at_every_replay():
    # HCCL's tasks are part of an ACL graph: each replay all-reduces (meeting the other rank's
    # replay) and all-gathers the values its inputs hold then.  The simulator had run them
    # once, at capture, and left them out of the graph: a tensor-parallel engine's replays
    # then served wrong tokens, silently
    out = _run(
        f"""
        import os
        import torch
        import torch.distributed as dist
        import torch.multiprocessing as mp

        def worker(rank, size):
            dist.init_process_group("hccl", init_method="tcp://127.0.0.1:{_port()}", rank=rank, world_size=size)
            torch.npu.set_device(rank)
            x = torch.zeros(4, device="npu")
            summed = torch.empty(4, device="npu")
            flat = torch.empty(2 * size, device="npu")
            g = torch.npu.NPUGraph()
            with torch.npu.graph(g):
                summed.copy_(x * 2)
                dist.all_reduce(summed)
                dist.all_gather_into_tensor(flat, summed[:2] + rank)
            seen = []
            for step in (1, 5):
                x.copy_(torch.full((4,), float(step * (rank + 1))))
                g.replay()
                torch.npu.synchronize()
                seen.append((summed.cpu().tolist(), flat.cpu().tolist()))
            os.write(1, (f"{{rank}} {{seen}}" + "\\n").encode())
            try:  # on another stream than the capturing one: refused before it reaches gloo
                with torch.npu.graph(torch.npu.NPUGraph()), torch.npu.stream(torch.npu.Stream()):
                    dist.all_reduce(summed)
            except RuntimeError as exc:
                os.write(1, (f"{{rank}} refused: {{exc}}" + "\\n").encode())
            dist.destroy_process_group()

        if __name__ == "__main__":
            mp.spawn(worker, args=(2,), nprocs=2)
        """
    )
    # step s: rank r holds 2*s*(r+1); the sum over both ranks is 6*s; rank r gathers 6*s + r
    want = "[([6.0, 6.0, 6.0, 6.0], [6.0, 6.0, 7.0, 7.0]), ([30.0, 30.0, 30.0, 30.0], [30.0, 30.0, 31.0, 31.0])]"
    assert f"0 {want}" in out and f"1 {want}" in out, out
    assert out.count("hccl allreduce issued on") == 2, out


@pytest.mark.vllm
@pytest.mark.parametrize("size", [1, 2])
def test_vllm_init_distributed_environment_with_hccl(size):
    pytest.importorskip("vllm")
    port = _port()
    out = _run(
        f"""
        import os, torch
        import torch.multiprocessing as mp

        def worker(rank, size):
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}", LOCAL_RANK=str(rank))
            import torch.distributed as dist
            from vllm.config import VllmConfig, set_current_vllm_config
            from vllm.distributed import ensure_model_parallel_initialized, get_tp_group, init_distributed_environment
            with set_current_vllm_config(VllmConfig()):
                init_distributed_environment(
                    world_size=size, rank=rank, distributed_init_method="tcp://127.0.0.1:{port}",
                    local_rank=rank, backend="hccl",
                )
                ensure_model_parallel_initialized(size, 1)
                torch.npu.set_device(rank)
                t = torch.full((3,), float(rank + 1), device="npu")
                dist.all_reduce(t, group=get_tp_group().device_group)
                line = f"rank {{rank}} {{dist.get_backend(get_tp_group().device_group)}} {{t.cpu().tolist()}}"
                os.write(1, (line + "\\n").encode())

        if __name__ == "__main__":
            mp.spawn(worker, args=({size},), nprocs={size})
        """
    )
    total = float(sum(range(1, size + 1)))
    for rank in range(size):
        assert f"rank {rank} hccl {[total] * 3}" in out, out


def test_npugraph_runs_its_real_npu_path_on_the_simulators_device(tmp_path):
    """With the simulator as torch_npu, ``--device npu`` is npugraph's Ascend code path as it
    is (``load_device("npu")``: torch_npu, torch.npu, memory on ``npu:0``, device memory
    told by ``tensor.device``): the self-test meant for Ascend hosts passes, and the demo
    decodes with replay equal to eager and to the float64 reference (which crosses to the
    host explicitly)."""
    env = {**os.environ, ENV: "1"}
    npugraph = str(Path(sys.executable).with_name("npugraph"))
    selftest = subprocess.run([npugraph, "selftest", "--device", "npu"], capture_output=True, text=True, env=env)
    assert selftest.returncode == 0, selftest.stdout + selftest.stderr
    assert "selftest on npu" in selftest.stdout and "0 failed" in selftest.stdout
    out = tmp_path / "demo.json"
    args = ["--steps", "30", "--sizes", "1,2,4,8", "--layers", "2", "--json", str(out)]
    demo = subprocess.run(
        [npugraph, "demo", "--device", "npu", "--no-progress", *args],
        capture_output=True,
        text=True,
        env=env,
    )
    assert demo.returncode == 0, demo.stdout + demo.stderr
    summary = json.loads(out.read_text())
    assert summary["device"] == "npu" and summary["mismatches"] == 0 and summary["reference_failures"] == 0
    assert summary["reference_checks"] >= 3


def test_import_torch_npu_first_in_a_fresh_process_through_the_installed_pth():
    """The environment's ``npusim.pth`` (a wheel install's, or the copy ``make`` puts
    beside an editable install) lets ``import torch_npu`` come before ``import torch``;
    without the variable a process imports nothing of torch at start-up."""
    import sysconfig

    if not (Path(sysconfig.get_paths()["purelib"]) / "npusim.pth").exists():
        pytest.skip("npusim.pth is not installed in this environment (make installs it)")
    assert _run("import torch_npu, torch\nprint(torch_npu.__name__, torch.ones(1, device='npu').device)").split() == [
        "npusim",
        "npu:0",
    ]
    bare = _run("import sys\nprint('torch' in sys.modules)", env={ENV: "0"})
    assert bare.strip() == "False"


def test_torch_accelerator_synchronize_reaches_the_simulators_streams():
    """vLLM's capture_model calls ``torch.accelerator.synchronize()``: the device guard's
    synchronizeDevice runs the simulator's synchronize, so a hang is reported, not waited on."""
    import torch

    import npusim as sim

    if not hasattr(torch, "accelerator"):
        pytest.skip("torch.accelerator is new in torch 2.6")
    sim.install_npu_device()
    x = torch.ones(4, device="npu")
    blocked = sim.npu.Stream()
    gate = sim.npu.ExternalEvent()
    gate.wait(blocked)
    with sim.npu.stream(blocked):
        y = x + 1
    with pytest.raises(sim.DeadlockError, match="would block forever"):
        torch.accelerator.synchronize()
    gate.record(sim.npu.current_stream())
    torch.accelerator.synchronize()
    assert y.cpu().tolist() == [2.0] * 4


def test_torch_accelerator_empties_the_caches_as_vllms_shutdown_does():
    """vLLM's cleanup_dist_env_and_memory, in every engine's exit, calls
    ``torch.accelerator.empty_cache()`` and then ``empty_host_cache()``: torch asks
    PrivateUse1's device allocator (an assert where it is no DeviceAllocator) and its host
    allocator (a segfault where none is registered).  torch_npu registers both; its NPU
    allocator is a DeviceAllocator from its release for torch 2.13."""
    import torch

    if not hasattr(getattr(torch, "accelerator", None), "empty_host_cache"):
        pytest.skip("torch.accelerator.empty_host_cache is new in torch 2.9")
    out = _run(
        """
        import faulthandler
        faulthandler.enable()
        import torch, torch_npu
        a = torch.ones(1 << 20, dtype=torch.uint8, device="npu")
        p = torch.arange(8.0).pin_memory()
        q = torch.zeros(8, device="npu"); q.copy_(p, non_blocking=True)
        version = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
        if version >= (2, 13):
            torch.accelerator.empty_cache()
            assert torch.accelerator.memory_allocated() == torch.npu.memory_allocated() >= 1 << 20
            assert torch.accelerator.memory_reserved() == torch.npu.memory_reserved()
            assert torch.accelerator.get_memory_info() == torch.npu.mem_get_info()
            b = torch.ones(1 << 20, dtype=torch.uint8, device="npu"); del b
            assert torch.accelerator.max_memory_allocated() >= torch.accelerator.memory_allocated() + (1 << 20)
            torch.accelerator.reset_peak_memory_stats()
            assert torch.accelerator.max_memory_allocated() == torch.accelerator.memory_allocated()
        else:  # as strict as torch_npu for this torch, whose NPU allocator is no DeviceAllocator
            try:
                torch.accelerator.empty_cache()
            except RuntimeError as e:
                assert "not a DeviceAllocator" in str(e), e
            else:
                raise AssertionError("torch.accelerator.empty_cache() was accepted")
        torch.accelerator.empty_host_cache()
        # nothing was freed that is in use: pinned memory is still pinned, the copy still there
        assert p.is_pinned() and not torch.empty(8).is_pinned()
        assert q.cpu().tolist() == p.tolist() == list(range(8))
        # a storage made from the device type is PrivateUse1's allocator's, as with torch_npu
        s = torch.UntypedStorage(16, device="npu")
        assert s.device.type == "npu" and s.nbytes() == 16
        print("ok")
        """
    )
    assert out.strip().endswith("ok")


def test_an_engines_custom_op_with_an_npu_kernel_is_captured_op_by_op():
    """vLLM registers ``vllm::unified_attention_with_output`` with a Python kernel for the
    platform's device: captured in a graph, its code runs with the recorder on, so the ops
    inside it become graph nodes that a replay runs on the inputs of the moment."""
    import torch

    import npusim as sim

    sim.install_npu_device()
    lib = torch.library.Library("npugraph_test", "FRAGMENT")
    lib.define("scale_into(Tensor x, Tensor(a!) out) -> ()")

    def scale_into(x: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(x * 2 + 1)

    lib.impl("scale_into", scale_into, "PrivateUse1")
    x = torch.zeros(4, device="npu")
    out = torch.zeros(4, device="npu")
    g = sim.npu.NPUGraph()
    with sim.npu.graph(g):
        torch.ops.npugraph_test.scale_into(x, out)
    assert out.cpu().tolist() == [0.0] * 4, "captured, not run"
    x.copy_(torch.arange(4.0))
    g.replay()
    assert out.cpu().tolist() == [1.0, 3.0, 5.0, 7.0]
    x.fill_(1.0)
    g.replay()
    assert out.cpu().tolist() == [3.0] * 4


def test_torch_npu_dense_kernels_are_torch_ops_that_compile_keeps_opaque():
    """torch_npu's kernels are torch ops: ``torch.compile(fullgraph=True)`` (vLLM's
    VLLM_COMPILE mode) keeps each call as one node, shaped by its fake implementation,
    instead of tracing into the simulator.  Checked against a float64 reference."""
    import torch

    import npusim as sim

    sim.install_npu_device()
    assert sim.npu_rms_norm is torch.ops.npu.npu_rms_norm
    assert sim.npu_add_rms_norm is torch.ops.npu.npu_add_rms_norm
    assert sim.npu_swiglu is torch.ops.npu.npu_swiglu
    gen = torch.Generator().manual_seed(3)
    x1 = torch.randn(5, 16, generator=gen).half()
    x2 = torch.randn(5, 16, generator=gen).half()
    w = torch.randn(16, generator=gen).half()

    def block(a: torch.Tensor, b: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        y, _, s = sim.npu_add_rms_norm(a, b, g, 1e-6)
        z, _ = sim.npu_rms_norm(s, g, 1e-6)
        return sim.npu_swiglu(torch.cat([y, z], dim=-1))

    seen: list[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    compiled = torch.compile(block, backend=backend, fullgraph=True)
    out = compiled(x1.npu(), x2.npu(), w.npu()).cpu()
    assert {"npu.npu_add_rms_norm", "npu.npu_rms_norm", "npu.npu_swiglu"} <= {s.removesuffix(".default") for s in seen}

    def rms(v: torch.Tensor) -> torch.Tensor:
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()

    s = x1.double() + x2.double()
    both = torch.cat([rms(s), rms(s.half().double())], dim=-1)
    a, b = both.chunk(2, dim=-1)
    ref = torch.nn.functional.silu(a) * b
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    with pytest.raises(Exception, match="odd size"):
        sim.npu_swiglu(torch.ones(2, 3, device="npu"))


def test_a_compiled_graph_with_a_mutating_custom_op_is_captured_and_replays_right():
    """A compiled graph calls a mutating custom op through ``auto_functionalized_v2`` (a
    higher-order op) where no compiler re-inplaced it, as vllm-ascend's backend does: the
    capture runs the higher-order op's dense implementation with the recorder on."""
    import torch

    import npusim as sim

    sim.install_npu_device()
    lib = torch.library.Library("npugraph_test_hop", "FRAGMENT")
    lib.define("shift_into(Tensor x, Tensor(a!) out) -> ()")

    def shift_into(x: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(x + 10)

    lib.impl("shift_into", shift_into, "PrivateUse1")
    lib.impl("shift_into", lambda x, out: None, "Meta")

    def step(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        y = sim.npu_rms_norm(x, torch.ones(4, device=x.device), 1e-6)[0]
        torch.ops.npugraph_test_hop.shift_into(y, out)
        return out * 2

    from torch._dynamo.backends.common import aot_autograd

    # like vLLM, keep the backend's compiled callable and call it without Dynamo's guards
    kept: list[Any] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        kept.append(aot_autograd(fw_compiler=lambda g, _: g)(gm, example_inputs))
        return kept[-1]

    x = torch.ones(3, 4, device="npu")
    out = torch.zeros(3, 4, device="npu")
    torch.compile(step, backend=backend, fullgraph=True)(x, out)  # compiles outside the capture
    (compiled,) = kept
    g = sim.npu.NPUGraph()
    with sim.npu.graph(g):
        (res,) = compiled(x, out)
    for fill in (2.0, -3.0):
        x.copy_(torch.full((3, 4), fill).npu() * torch.arange(1.0, 5.0).npu())
        g.replay()
        v = x.cpu().double()
        ref = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6) + 10
        torch.testing.assert_close(out.cpu().double(), ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(res.cpu().double(), 2 * ref, atol=1e-5, rtol=1e-5)


def test_a_copy_made_by_a_composite_op_inside_a_custom_ops_kernel_is_graph_memory():
    """Inside a custom op's npu kernel autograd is below the recorder, so ``contiguous()``
    arrives whole (its schema says "may alias").  vllm-ascend's Triton rope makes its query
    contiguous there: the copy must come from the graph's pool, or the replay reads memory
    freed after the capture (what the simulator first did with vLLM's ACL graph mode)."""
    import gc

    import torch

    import npusim as sim

    sim.install_npu_device()
    lib = torch.library.Library("npugraph_test_composite", "FRAGMENT")
    lib.define("double_left(Tensor x) -> Tensor")

    def double_left(x: torch.Tensor) -> torch.Tensor:
        q = x[:, :3]
        return q.contiguous().reshape(-1) * 2

    lib.impl("double_left", double_left, "PrivateUse1")
    x = torch.zeros(4, 5, device="npu")
    g = sim.npu.NPUGraph()
    with sim.npu.graph(g):
        out = torch.ops.npugraph_test_composite.double_left(x)
    gc.collect()
    for k in (1.0, 7.0):
        src = torch.arange(20.0).reshape(4, 5) * k
        x.copy_(src.npu())
        g.replay()
        assert out.cpu().tolist() == (src[:, :3].reshape(-1) * 2).tolist()


def test_after_import_runs_once_the_module_has_executed(tmp_path, monkeypatch):
    """What wires Triton into the simulator as Triton's modules load (and the release
    environment's ``vllm_ascend.utils`` settlement)."""
    import sys

    import npusim_hook

    (tmp_path / "npugraph_after_import_probe.py").write_text("VALUE = 41\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[int] = []
    before = list(sys.meta_path)
    try:
        npusim_hook.after_import("npugraph_after_import_probe", lambda m: seen.append(m.VALUE + 1))
        # a second wish for the same module runs too, after the first (one finder answers a name)
        npusim_hook.after_import("npugraph_after_import_probe", lambda m: seen.append(m.VALUE + 2))
        import npugraph_after_import_probe  # noqa: F401

        assert seen == [42, 43]
    finally:
        sys.meta_path[:] = before
        sys.modules.pop("npugraph_after_import_probe", None)


def test_triton_ascends_language_extension_stand_in_has_what_vllm_ascend_imports():
    from npusim.surfaces import triton_ascend

    ext = triton_ascend.cann_extension()
    assert ext.__name__ == "triton.language.extra.cann.extension"
    for name in ("insert_slice", "extract_slice", "get_element"):
        assert callable(getattr(ext, name))  # each is tested in Triton's interpreter: tests/sim/test_triton_ascend.py


def test_install_npu_device_after_install_torch_npu_installs_everything_at_once():
    # install_torch_npu() (no device) makes torch.npu the simulator's module; the device's
    # install then must not refuse it half-way (hccl and the torch ops not yet registered)
    out = _run(
        """
        import torch
        import npusim as sim
        sim.install_torch_npu()
        assert torch.npu is sim.npu
        from npugraph import Runtime
        rt = Runtime("sim", max_model_len=64)
        assert torch.ones(2, device="npu").device.type == "npu"
        assert torch.distributed.is_hccl_available()
        assert hasattr(torch.ops.npu, "npu_rms_norm")
        sim.install_npu_device()  # and again: idempotent
        import sys
        assert sys.modules["torch.npu"] is sim.npu
        print("ok")
        """,
        env={ENV: ""},
    )
    assert out.strip().endswith("ok")


def test_a_forked_child_computes_after_its_parent_used_the_thread_pool():
    # torch's OpenMP pool does not survive a fork: without the simulator's at-fork rule the
    # child hangs for good in libgomp at its first parallel op (vLLM's forked engine did)
    out = _run(
        """
        import os, torch
        x = torch.randn(1024, 1024)
        (x @ x).sum(); torch.randn(1 << 22).sum()  # the parent's parallel regions
        (x.npu() @ x.npu()).cpu()
        pid = os.fork()
        if pid == 0:
            y = torch.randn(1 << 22)
            ok = float((y * 0 + 1).sum()) == float(1 << 22)
            ok &= bool((torch.ones(1 << 20, device="npu") * 2).sum().cpu() == 2 * (1 << 20))
            os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status))
        """,
        env={"OMP_NUM_THREADS": "2"},
        timeout=60,  # a hang is the failure
    )
    assert out.strip() == "child 0"


def test_a_forked_child_computes_when_a_library_raises_the_thread_count_again():
    # vLLM's n-gram proposer (speculative decoding) restores numba's thread count after each
    # proposal through the same libgomp: back to the host's cores, in the forked engine.  The
    # device's ops, its kernels' CPU views and its graph replays must still compute on one
    # thread there (without the guard: a hang in libgomp at the next matmul)
    out = _run(
        """
        import os, torch, torch_npu
        x = torch.randn(1024, 1024)
        (x @ x).sum(); torch.randn(1 << 22).sum()  # the parent's parallel regions
        pid = os.fork()
        if pid == 0:
            a = torch.randn(512, 512, device="npu")
            ok = True
            torch.set_num_threads(2)  # what numba's set_num_threads does through libgomp
            ok &= bool(torch.allclose((a @ a).cpu(), a.cpu().double().matmul(a.cpu().double()).float(), atol=1e-3))
            out = torch.empty(512, 512, device="npu")
            g = torch.npu.NPUGraph()
            with torch.npu.graph(g):
                out.copy_(a @ a)
            ones = torch.ones(512, 512)  # host work of the child's own: one thread from here
            a.copy_(ones)
            torch.set_num_threads(2)  # again, between the last device op and the replay
            g.replay()
            torch.npu.synchronize()
            ok &= bool((out.cpu() == 512).all())
            os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status))
        """,
        env={"OMP_NUM_THREADS": "2"},
        timeout=90,  # a hang is the failure
    )
    assert out.strip() == "child 0"


def test_the_card_is_what_the_host_can_back_and_what_the_host_cannot_back_is_refused():
    out = _run(
        """
        import torch, torch_npu
        from npusim.device import backend
        total = torch.npu.mem_get_info()[1]
        size, how = backend.card_size()
        available = backend.host_available()
        assert total == size and "half of the" in how, (total, how)
        assert available is None or size <= min(64 << 30, available), (size, available)  # half of what it had
        print("default", total == size)
        """,
        env={"NPUGRAPH_SIM_MEMORY_GB": ""},
    )
    assert "default True" in out
    # a card set larger than the host: an allocation the host cannot back is refused before
    # any page is touched (the host overcommits: it would be an OOM kill, with no message)
    out = _run(
        """
        import torch, torch_npu
        from npusim.device import backend
        try:
            torch.empty(backend.host_available() + (2 << 30), dtype=torch.uint8, device="npu")
        except torch.OutOfMemoryError as e:
            assert "the host" in str(e) and "NPUGRAPH_SIM_MEMORY_GB" in str(e), e
            print("host refused")
        print("serving", float(torch.ones(4, device="npu").sum().cpu()))
        """,
        env={"NPUGRAPH_SIM_MEMORY_GB": "100000"},
    )
    assert "host refused" in out and "serving 4.0" in out


def test_a_card_of_a_set_size_refuses_what_does_not_fit_and_says_which_setting():
    out = _run(
        """
        import torch, torch_npu
        assert torch.npu.mem_get_info()[1] == 1 << 30 == torch.npu.get_device_properties(0).total_memory
        keep = torch.empty(600 << 20, dtype=torch.uint8, device="npu")
        try:
            torch.empty(600 << 20, dtype=torch.uint8, device="npu")
        except torch.OutOfMemoryError as e:
            assert "NPUGRAPH_SIM_MEMORY_GB" in str(e) and "1.00 GiB in total" in str(e), e
            print("refused")
        del keep
        again = torch.empty(600 << 20, dtype=torch.uint8, device="npu")  # the card serves on
        print("again", again.numel() == 600 << 20)
        """,
        env={"NPUGRAPH_SIM_MEMORY_GB": "1"},
    )
    assert "refused" in out and "again True" in out


def test_the_default_card_size_is_said_once_and_a_bad_setting_is_named(monkeypatch):
    from npusim.device import backend

    full = {**os.environ, ENV: "1", "NPUGRAPH_SIM_MEMORY_GB": ""}
    code = "import torch, torch_npu; torch.npu.mem_get_info(); torch.npu.get_device_properties(0)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    said = [line for line in done.stderr.splitlines() if line.startswith("npusim:")]
    assert len(said) == 1 and "NPUGRAPH_SIM_MEMORY_GB sets it" in said[0], done.stderr
    for bad in ("lots", "0", "-2", "inf"):
        monkeypatch.setenv("NPUGRAPH_SIM_MEMORY_GB", bad)
        backend.card_size.cache_clear()
        with pytest.raises(ValueError, match="NPUGRAPH_SIM_MEMORY_GB"):
            backend.card_size()
    monkeypatch.setenv("NPUGRAPH_SIM_MEMORY_GB", "2.5")
    backend.card_size.cache_clear()
    assert backend.card_size()[0] == int(2.5 * (1 << 30))
    backend.card_size.cache_clear()


def test_npugraph_ex_is_importable_and_a_dynamo_backend_in_every_process():
    # vllm-ascend imports npugraph_ex at module level; torch.compile(backend="npugraph_ex")
    # works as after importing torch_npu (the hook registers it once torch._dynamo loads)
    out = _run(
        """
        import torch
        import npugraph_ex, torch_npu
        assert torch.npu.npugraph_ex is npugraph_ex and callable(npugraph_ex.register_replacement)
        f = torch.compile(lambda x: torch.relu(x) + 1, backend="npugraph_ex", fullgraph=True, dynamic=False)
        x = torch.tensor([-1.0, 2.0], device="npu")
        assert f(x).cpu().tolist() == [1.0, 3.0] and f(x * 2).cpu().tolist() == [1.0, 5.0]
        print("ok")
        """
    )
    assert out.strip().endswith("ok")


def test_pyacl_answers_what_ray_asks_of_a_node_without_importing_torch() -> None:
    """Ray's NPU detection (``ray/_private/accelerators/npu.py``) imports CANN's ``acl``: the
    card count from ``acl.rt.get_device_count()``, the type from ``acl.get_soc_name()``.  With
    the simulator asked for, both answer as torch_npu does, in a process that never imports
    torch (a raylet's); without it there is no ``acl``, as on a host without CANN."""
    out = _run(
        """
        import json, sys
        import acl
        loaded_torch = "torch" in sys.modules
        count, ret = acl.rt.get_device_count()
        soc = acl.get_soc_name()
        import torch, torch_npu
        print(json.dumps([loaded_torch, count, ret, soc, torch_npu.npu.get_device_name(), torch.npu.device_count()]))
        """,
        env={"NPUGRAPH_SIM_DEVICES": "4"},
    )
    loaded_torch, count, ret, soc, torch_npus, torch_count = json.loads(out.splitlines()[-1])
    assert not loaded_torch
    assert (count, ret) == (torch_count, 0) == (4, 0)
    assert soc == torch_npus == "Ascend910B1"
    bare = {k: v for k, v in os.environ.items() if k not in (ENV, SHORT_ENV)}
    done = subprocess.run([sys.executable, "-c", "import acl"], capture_output=True, text=True, env=bare, timeout=60)
    assert done.returncode == 1 and "No module named 'acl'" in done.stderr
