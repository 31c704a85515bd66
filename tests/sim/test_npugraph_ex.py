"""npugraph_ex (torchair's graph backend, in torch_npu's wheel) on the simulator, as
vllm-ascend 0.23.0.post1's default configuration uses it: patterns registered with it,
graphs compiled by it with ``force_eager=True``; and its default path (one NPU graph
captured per input signature, replayed).  torch_npu's own ``test/dynamo/test_npugraph_ex.py``
runs as written on the simulator (docs/simulator.md); these restate what it checks and what
vllm-ascend needs of it."""

from __future__ import annotations

import importlib

import pytest
import torch

import npusim as sim

DEVICE = "npu"


@pytest.fixture
def nge():
    sim.install_torch_npu()
    try:
        from npusim.surfaces.npugraph_ex.npu_fx_compiler import register_dynamo_backend

        register_dynamo_backend()
        yield importlib.import_module("npugraph_ex")
    finally:
        sim.uninstall_torch_npu()


def _norm_quant(x, residual, weight):
    out = torch.ops.npu.npu_add_rms_norm(x, residual, weight, 1e-6)
    q = torch.ops.npu.npu_dynamic_quant(out[0])
    return q[0], q[1], out[2]


def _fused(x, residual, weight):
    out = torch.ops.npu.npu_add_rms_norm_dynamic_quant(x, residual, weight, epsilon=1e-6, output_mask=[True, False])
    return out[0], out[3], out[2]


def _inputs(rows=3, hidden=16):
    return [
        torch.randn(rows, hidden, device=DEVICE, dtype=torch.bfloat16),
        torch.randn(rows, hidden, device=DEVICE, dtype=torch.bfloat16),
        torch.rand(hidden, device=DEVICE, dtype=torch.bfloat16) + 0.5,
    ]


def test_vllm_ascends_imports_resolve_and_its_triton_patch_is_skipped_as_without_npugraph_ex_core(nge):
    import npugraph_ex.npu_fx_compiler as nfx
    from npugraph_ex.configs.compiler_config import _process_kwargs_options

    config = nge.CompilerConfig()
    _process_kwargs_options(
        config, {"options": {"force_eager": True, "inplace_pass": False, "clone_input": False, "clone_output": False}}
    )
    assert config.force_eager and not config.inplace_pass and config.mode == "npugraph_ex"
    assert callable(nfx._NpuFxCompiler._get_compiled_gm)
    assert torch.npu.npugraph_ex is nge and importlib.import_module("torch_npu.dynamo.npugraph_ex") is nge
    with pytest.raises(ImportError):  # vllm-ascend's patch_npugraph_ex_triton then skips itself
        importlib.import_module("npugraph_ex.core._concrete_graph")
    with pytest.raises(ValueError, match="Invalid option 'no_such_option'"):
        _process_kwargs_options(config, {"options": {"no_such_option": 1}})


def test_a_registered_pattern_is_replaced_when_npugraph_ex_compiles(nge, monkeypatch):
    """As vllm-ascend's own graph-fusion tests look: _optimize_fx wrapped, its graph read."""
    nge.register_replacement(
        search_fn=_norm_quant, replace_fn=_fused, example_inputs=_inputs(2, 4), skip_duplicates=True
    )
    seen = []
    original = nge.npu_fx_compiler._optimize_fx

    def wrapper(gm, example_inputs=None, config=None):
        out = original(gm, example_inputs, config)
        seen.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return out

    monkeypatch.setattr(nge.npu_fx_compiler, "_optimize_fx", wrapper)

    class Model(torch.nn.Module):
        def forward(self, x, residual, weight):
            return _norm_quant(x, residual, weight)

    model = torch.compile(Model(), backend="npugraph_ex", options={"force_eager": True}, fullgraph=True, dynamic=False)
    args = _inputs()
    y, scale, total = model(*args)
    (targets,) = seen
    assert "npu.npu_add_rms_norm_dynamic_quant.default" in targets and "npu.npu_dynamic_quant.default" not in targets
    want_y, want_scale, want_total = _norm_quant(*args)
    assert torch.equal(total.cpu(), want_total.cpu())
    # the fused kernel quantises the float32 norm, the pattern its bf16 cast: one step apart at most
    assert (y.cpu().int() - want_y.cpu().int()).abs().max() <= 1
    assert torch.allclose(scale.cpu(), want_scale.cpu(), rtol=1e-2)


def test_by_default_npugraph_ex_captures_a_graph_and_replays_it_with_new_inputs(nge):
    class Model(torch.nn.Module):
        def forward(self, x, y):
            return torch.relu(x) * 2 + y

    model = torch.compile(Model(), backend="npugraph_ex", fullgraph=True, dynamic=False)
    x, y = torch.randn(8, device=DEVICE), torch.randn(8, device=DEVICE)
    replays = sim.counters()["replay"]
    first = model(x, y).cpu()
    x2, y2 = torch.randn(8, device=DEVICE), torch.randn(8, device=DEVICE)
    second = model(x2, y2).cpu()
    assert sim.counters()["replay"] - replays == 2, "captured on the first call, replayed on both"
    for got, (a, b) in ((first, (x, y)), (second, (x2, y2))):
        assert torch.allclose(got, (torch.relu(a.cpu()) * 2 + b.cpu()))


def test_the_core_limit_scope_compiles_and_does_nothing(nge):
    class Model(torch.nn.Module):
        def forward(self, a, b):
            with torch.npu.npugraph_ex.scope.limit_core_num(4, 5):
                c = a @ b
            return c + 1

    model = torch.compile(Model(), backend="npugraph_ex", fullgraph=True, dynamic=False)
    a, b = torch.randn(4, 4, device=DEVICE), torch.randn(4, 4, device=DEVICE)
    assert torch.allclose(model(a, b).cpu(), a.cpu() @ b.cpu() + 1, atol=1e-5)
