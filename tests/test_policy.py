"""Kernel choice per captured size: static rules, measured crossover, saved files."""

from __future__ import annotations

import json

import pytest
import torch

import npusim as sim
from npugraph.errors import CaptureFailed, PolicyError
from npugraph.ops import AttentionCall
from npugraph.policy import StaticPolicy, load_policy
from npugraph.tools.measure import measure_policy

from .helpers import build, run


def _call(tokens=4, head=64, dtype=torch.float16, tpr=1):
    q = torch.zeros(tokens, 4, head, dtype=dtype)
    kc = torch.zeros(8, 16, 2, head, dtype=dtype)
    return AttentionCall(
        query=q,
        key_cache=kc,
        value_cache=kc,
        block_table=torch.zeros(tokens // tpr, 4, dtype=torch.int32),
        out=torch.empty_like(q),
        num_heads=4,
        num_kv_heads=2,
        scale=0.1,
        tokens_per_request=tpr,
    )


@pytest.mark.parametrize(
    ("tokens", "kwargs", "kernel", "why"),
    [
        (1, {}, "pa", "in pa_sizes"),
        (4, {}, "pa", "in pa_sizes"),
        (5, {}, "fia", "not in pa_sizes"),
        (4, {"tpr": 2}, "fia", "one token per request"),
        (2, {"head": 96}, "fia", "head size 96"),
        (2, {"dtype": torch.float32}, "fia", "dtype torch.float32"),
    ],
)
def test_static_policy_crossover_rules(tokens, kwargs, kernel, why):
    choice = StaticPolicy().choose("main", tokens, tokens, [_call(tokens, **kwargs)])
    assert choice.kernel == kernel and why in choice.reason


def test_static_policy_sizes_are_configurable():
    assert StaticPolicy({1, 8}).choose("main", 8, 8, [_call(8)]).kernel == "pa"
    assert StaticPolicy(set()).choose("main", 1, 1, [_call(1)]).kernel == "fia"


def _linear_model(pa_per_token_us, fia_us):
    """PA costs grow with the batch, FIA is flat: PA wins below the crossover."""

    def model(op, params):
        tokens = int(params["query"].shape[0])
        if op == "_npu_paged_attention":
            return pa_per_token_us * tokens * 1e-6
        return fia_us * 1e-6

    return model


MEASURE = dict(heads=4, kv_heads=2, head_size=64, block_size=16, max_model_len=128, repeats=3, warmup=1)


@pytest.mark.parametrize(("pa_per_token", "crossover"), [(10.0, 2), (4.0, 5)])
def test_measured_policy_follows_the_device_time_model(pa_per_token, crossover):
    sim.configure(kernel_time_model=_linear_model(pa_per_token, 25.0))
    policy = measure_policy([1, 2, 4, 8], **MEASURE)
    picked = {t: c.kernel for t, c in policy.choices.items()}
    assert picked == {t: ("pa" if t * pa_per_token < 25.0 else "fia") for t in (1, 2, 4, 8)}
    assert all(t <= crossover for t, k in picked.items() if k == "pa")
    m = policy.measurements[1]
    assert m.pa_median == pytest.approx(pa_per_token) and m.fia_median == pytest.approx(25.0)


def test_near_ties_keep_the_default():
    sim.configure(kernel_time_model=_linear_model(25.0, 25.5))
    policy = measure_policy([1, 8], margin=0.05, **MEASURE)
    assert policy.choices[1].kernel == "pa" and "default keeps pa" in policy.choices[1].reason
    assert policy.choices[8].kernel == "fia"


def test_without_a_model_the_real_kernel_times_are_measured():
    policy = measure_policy([2], **MEASURE)
    m = policy.measurements[2]
    assert len(m.pa_us) == 3 and all(x > 0 for x in m.pa_us + m.fia_us)
    pa, fia = m.pa_median, m.fia_median
    choice = policy.choices[2]
    assert f"PA {pa:.1f}us vs FIA {fia:.1f}us" in choice.reason, "the reason quotes the medians it chose by"
    if abs(pa - fia) > policy.margin * min(pa, fia):
        assert choice.kernel == ("pa" if pa < fia else "fia"), "the faster kernel wins outside the margin"
    else:
        assert choice.kernel == "pa" and "default keeps pa" in choice.reason


def test_policy_file_round_trips_and_is_refused_for_other_shapes(tmp_path):
    sim.configure(kernel_time_model=_linear_model(10.0, 25.0))
    policy = measure_policy([1, 4], **MEASURE)
    path = tmp_path / "policy.json"
    policy.save(str(path))
    loaded = load_policy(str(path))
    assert loaded.choices == policy.choices and loaded.signature == policy.signature
    assert json.loads(path.read_text())["sizes"]["4"]["kernel"] == "fia"
    with pytest.raises(PolicyError, match="head_size: file has 64, this model has 96"):
        loaded.choose("main", 1, 1, [_call(1, head=96)])
    doc = json.loads(path.read_text())
    doc["signature"]["device"] = "npu"
    path.write_text(json.dumps(doc))
    with pytest.raises(PolicyError, match="measured on device 'npu'"):
        from npugraph import Runtime

        Runtime("sim", max_model_len=64, policy=load_policy(str(path)))


def test_decode_with_a_measured_policy_stays_bitwise_equal(tmp_path):
    sim.configure(kernel_time_model=_linear_model(10.0, 25.0))
    cfg_kw = dict(heads=4, kv_heads=2, head_size=64, block_size=16, max_model_len=256, repeats=3, warmup=1)
    policy = measure_policy([1, 2, 4, 8], dtype=torch.bfloat16, **cfg_kw)
    path = tmp_path / "p.json"
    policy.save(str(path))
    sim.configure()
    cfg, rt, _, eng = build(sizes=[1, 2, 4, 8], policy=load_policy(str(path)))
    kernels = {e.key: e.choice.kernel for e in rt.manager.entries()}
    assert kernels == {1: "pa", 2: "pa", 4: "fia_sink", 8: "fia_sink"}  # FIA's lengths on the device
    assert run(eng, cfg, 60, seed=3) == 0


def test_mismatched_policy_fails_the_capture_clearly(tmp_path):
    sim.configure(kernel_time_model=_linear_model(10.0, 25.0))
    policy = measure_policy([1], **{**MEASURE, "head_size": 128})
    sim.configure()
    with pytest.raises(CaptureFailed, match="head_size: file has 128, this model has 64"):
        build(sizes=[1], policy=policy)
