"""The names SGLang's Ascend path needs of the Ascend stack beside the kernels: torchair's
compile backend and config, ``sgl_kernel_npu`` under its own name, torch_npu's
``contrib.transfer_to_npu``, ``profiler`` names, ``_apply_patches``,
``multiprocessing.reductions``, ``acl.rt.get_device_info``, and torch.npu's reusable
stream contexts, ``Tensor.record_stream`` on its streams and ``param.data = npu tensor``."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import npusim as sim
from npusim import npu


def test_torchair_config_checks_its_options_as_torchair_does(torch_npu):
    from torchair.configs.compiler_config import CompilerConfig

    config = CompilerConfig()
    assert config.mode.value == "max-autotune" and not config.debug.run_eagerly
    config.mode = "reduce-overhead"
    config.debug.run_eagerly = True
    assert config.mode.value == "reduce-overhead" and config.debug.run_eagerly.value is True
    with pytest.raises(ValueError, match="not in optional list"):
        config.mode = "fast"
    with pytest.raises(ValueError, match="CompilerConfig has no option speed"):
        config.speed = 1


def test_torchair_backend_compiles_and_computes_what_eager_does(torch_npu):
    import torchair
    import torchair.ge_concrete_graph.ge_converter.experimental.patch_for_hcom_allreduce

    config = torchair.CompilerConfig()
    backend = torchair.get_npu_backend(compiler_config=config)

    def f(x, y):
        return torch.nn.functional.silu(x) * y + 1

    x, y = torch.randn(4, 8, device="npu"), torch.randn(4, 8, device="npu")
    torch._dynamo.reset()
    got = torch.compile(f, backend=backend, dynamic=True)(x, y)
    assert torch.allclose(got.cpu(), f(x.cpu(), y.cpu()), atol=1e-6)


def test_sgl_kernel_npu_imports_under_its_own_name_and_refuses_what_it_does_not_simulate(torch_npu):
    from sgl_kernel_npu.kvcacheio import TransferDirection, transfer_kv_dim_exchange
    from sgl_kernel_npu.norm.split_qkv_rmsnorm_rope import split_qkv_rmsnorm_rope

    from npusim.kernels import dense

    assert split_qkv_rmsnorm_rope is dense.split_qkv_rmsnorm_rope and TransferDirection.D2H.value == 2
    with pytest.raises(RuntimeError, match="transfer_kv_dim_exchange is not simulated by npusim"):
        transfer_kv_dim_exchange(None, None, None, None, None, None)
    # SGLang 0.5.22's layers/layernorm.py imports it at module level on Ascend
    from sgl_kernel_npu.norm.add_rmsnorm_bias import add_gemma_rms_norm

    with pytest.raises(RuntimeError, match="add_gemma_rms_norm is not simulated by npusim .Gemma models."):
        add_gemma_rms_norm(None, None, None, 1e-6)
    with pytest.raises(ModuleNotFoundError, match="sgl_kernel_npu.fla"):
        importlib.import_module("sgl_kernel_npu.fla")
    sim.uninstall_torch_npu()
    assert "sgl_kernel_npu" not in sys.modules
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("sgl_kernel_npu")


def test_torch_npu_names_sglang_reads_at_start_up(torch_npu):
    from torch_npu.multiprocessing import reductions

    assert torch_npu.profiler.ProfilerActivity.NPU is not torch_npu.profiler.ProfilerActivity.CPU
    assert torch_npu.profiler.ExportType.Text == "text" and torch_npu.profiler.ProfilerLevel.Level1 == "Level1"
    torch_npu.profiler._ExperimentalConfig(profiler_level=torch_npu.profiler.ProfilerLevel.Level1)
    with pytest.raises(RuntimeError, match="torch_npu.profiler.profile is not simulated"):
        torch_npu.profiler.profile()
    with pytest.raises(RuntimeError, match="sharing an npu tensor between processes is not simulated"):
        reductions.rebuild_npu_tensor()
    import acl

    assert acl.rt.get_device_info(0, 601) == (0, 100000), "pyACL's (value, status): no attribute is simulated"
    assert callable(torch_npu.npu_gemma_rms_norm) and callable(torch_npu.npu_mrope)


def test_apply_patches_points_torch_names_at_torch_npus(monkeypatch, torch_npu):
    import torch.profiler

    marker = object()
    monkeypatch.setattr(torch.profiler, "profile", torch.profiler.profile)  # restored after the test
    torch_npu._apply_patches([["profiler.profile", marker]])
    assert torch.profiler.profile is marker
    torch_npu._apply_patches([["npugraph_sim_test.made.value", 3]])  # missing modules on the way are made
    try:
        assert torch.npugraph_sim_test.made.value == 3
        assert sys.modules["torch.npugraph_sim_test.made"] is torch.npugraph_sim_test.made
    finally:
        del torch.npugraph_sim_test
        for name in ("torch.npugraph_sim_test", "torch.npugraph_sim_test.made"):
            sys.modules.pop(name, None)


def test_transfer_to_npu_points_cuda_code_at_the_npu():
    """Importing it patches torch for good, as torch_npu's does: in a process of its own."""
    code = textwrap.dedent(
        """
        import torch
        import npusim as sim
        sim.install_torch_npu(device=True)
        import torch_npu
        from torch_npu.contrib import transfer_to_npu
        assert torch.cuda.is_available() and torch.cuda.current_stream() is torch.npu.current_stream()
        assert torch.cuda.device_count() == torch.npu.device_count()
        assert torch.cuda.CUDAGraph is torch.npu.NPUGraph
        assert torch.zeros(2, device="cuda").device.type == "npu"
        assert torch.ones(2).cuda().device.type == "npu" and torch.ones(2).to("cuda:0").is_cuda
        assert torch.empty(3).new_zeros(2, device=torch.device("cuda")).device.type == "npu"
        with torch.device("npu"):  # torch's device context still knows its factories
            assert torch.nn.Linear(2, 2).weight.device.type == "npu"
        assert torch.nn.Linear(2, 2).cuda().weight.device.type == "npu"
        print("ok")
        """
    )
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_stream_contexts_are_reusable_and_restore_the_stream_before():
    s = npu.Stream()
    before = npu.current_stream()
    ctx = npu.stream(s)  # SGLang makes one and enters it every step
    for _ in range(2):
        with ctx:
            assert npu.current_stream() is s
            with npu.StreamContext(None):
                assert npu.current_stream() is s
        assert npu.current_stream() is before


def test_record_stream_takes_a_simulated_stream_and_data_moves_between_cpu_and_npu():
    t = torch.ones(4, device="npu")
    t.record_stream(npu.current_stream())
    p = torch.nn.Parameter(torch.zeros(3))
    p.data = torch.arange(3.0).npu()  # SGLang stages a CPU-built parameter to the device so
    assert p.device.type == "npu" and p.cpu().tolist() == [0.0, 1.0, 2.0]
    p.data = p.data.cpu()
    assert p.device.type == "cpu"
