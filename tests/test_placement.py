"""Every tensor npugraph allocates states where it lives; the simulator refuses misplaced arguments."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

import npusim as torch_npu
from npugraph import AttentionMetadata, Runtime
from npugraph.device import load_device
from npugraph.models import Decoder, DecoderConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent / "npugraph"
# the simulator too: like a device, it must not follow the process's default torch device
DEVICE_FACING = ["ops", "capture", "replay", "attention", "integrations", "models", "runtime.py", "sim"]
FACTORIES = {
    "empty",
    "empty_strided",
    "zeros",
    "ones",
    "full",
    "tensor",
    "as_tensor",
    "arange",
    "linspace",
    "eye",
    "triu",
    "tril",
    "randn",
    "rand",
    "randint",
    "randperm",
}


def _factory_calls_without_device(path: pathlib.Path, root: pathlib.Path = ROOT.parent) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        f = node.func
        named = any(k.arg == "device" for k in node.keywords)
        if isinstance(f.value, ast.Name) and f.value.id == "torch" and f.attr in FACTORIES and not named:
            bad.append(f"{path.relative_to(root)}:{node.lineno}: torch.{f.attr}(...) without device=")
    return bad


def test_every_tensor_factory_in_device_facing_code_names_its_device():
    files = []
    for entry in DEVICE_FACING:
        p = ROOT / entry
        files += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    assert len(files) > 10
    bad = [line for f in files for line in _factory_calls_without_device(f)]
    assert bad == [], "\n".join(bad)


def test_the_factory_check_catches_a_missing_device(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import torch\nx = torch.empty(3)\ny = torch.zeros(2, device='cpu')\nz = torch.empty_like(x)\n")
    assert _factory_calls_without_device(src, tmp_path) == ["m.py:2: torch.empty(...) without device="]


def test_the_device_names_where_its_memory_lives():
    """The simulator's memory is its npu device's, as Ascend's is npu:<current device>."""
    assert load_device("sim").memory == torch.device("npu", 0)


def test_models_and_runtime_allocate_on_the_runtime_device():
    rt = Runtime("sim", max_model_len=64)
    model = Decoder(DecoderConfig(layers=1, num_blocks=8, max_model_len=64), rt)
    assert model.layers[0].k_cache.device == rt.device.memory
    assert all(p.device == rt.device.memory for p in model.parameters())


# --- the simulator refuses what a device would ----------------------------------------------


def _pa_args():
    q = torch.randn(2, 4, 64).half().npu()
    kc = torch.randn(8, 4, 2, 64).half().npu()
    vc = torch.randn(8, 4, 2, 64).half().npu()
    bt = torch.zeros(2, 4, dtype=torch.int32, device="npu")
    lens = torch.tensor([3, 5], dtype=torch.int32)  # host lengths
    return q, kc, vc, bt, lens, torch.empty_like(q)


def test_a_device_argument_on_another_device_than_the_query_is_refused():
    q, kc, vc, bt, lens, out = _pa_args()
    with pytest.raises(ValueError, match=r"argument 'block_table' is a meta tensor, but the kernel reads it in device"):
        torch_npu._npu_paged_attention(q, kc, vc, 2, 4, 0.1, bt.to("meta"), lens, out)
    with pytest.raises(ValueError, match=r"argument 'key' is a meta tensor"):
        torch_npu.npu_fused_infer_attention_score(
            q.unsqueeze(1),
            kc[:2, :1].reshape(2, 1, 2, 64).to("meta"),
            q.unsqueeze(1)[:, :, :2],
            num_heads=4,
            num_key_value_heads=2,
            input_layout="BSND",
        )


def test_a_device_argument_in_host_memory_is_refused():
    """Host versus device by tensor.device, as hardware tells them: a CPU cache, table or
    query is host memory, which a kernel does not read."""
    q, kc, vc, bt, lens, out = _pa_args()
    with pytest.raises(ValueError, match=r"argument 'block_table' is a cpu tensor, but the kernel reads it in device"):
        torch_npu._npu_paged_attention(q, kc, vc, 2, 4, 0.1, bt.cpu(), lens, out)
    with pytest.raises(ValueError, match=r"argument 'query' is a cpu tensor"):
        torch_npu._npu_paged_attention(q.cpu(), kc.cpu(), vc.cpu(), 2, 4, 0.1, bt.cpu(), lens, out.cpu())
    with pytest.raises(ValueError, match=r"argument 'key_cache' is on npu:1 but the query is on npu:0"):
        torch_npu._npu_paged_attention(q, kc.to("npu:1"), vc, 2, 4, 0.1, bt, lens, out)


def test_a_host_argument_given_as_a_device_tensor_is_refused():
    q, kc, vc, bt, lens, out = _pa_args()
    with pytest.raises(ValueError, match=r"argument 'context_lens' is a host-side argument .* tensor on meta"):
        torch_npu._npu_paged_attention(q, kc, vc, 2, 4, 0.1, bt, lens.to("meta"), out)


def test_metadata_on_the_wrong_side_is_named():
    rt = Runtime("sim", max_model_len=64)
    model = Decoder(DecoderConfig(layers=1, num_blocks=8, max_model_len=64), rt)
    layer = model.layers[0]
    q = torch.randn(2, 4, 64, dtype=torch.bfloat16)
    meta = AttentionMetadata(
        seq_lens=torch.ones(2, dtype=torch.int32).to("meta"), block_table=torch.zeros(2, 4, dtype=torch.int32)
    )
    with pytest.raises(ValueError, match="seq_lens must be on the host"):
        layer.attn(q, layer.k_cache, layer.v_cache, meta)
