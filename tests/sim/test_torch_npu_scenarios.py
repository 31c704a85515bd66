"""torch_npu's own graph-update scenarios (Ascend/pytorch test/npu/test_aclgraph_update.py).

Run against npusim with only the module names changed (``torch_npu`` →
``npusim``, ``torch.npu`` → ``npusim.npu``), on the simulator's ``npu`` device
as written.
"""

from __future__ import annotations

import pytest
import torch

import npusim as torch_npu

npu = torch_npu.npu  # stands for torch.npu
DEVICE = "npu"


# The attributes every FIA call of torch_npu's test passes (32 heads, BNSD, its scale, no
# sparsity, no softmax LSE), each call adding its own lengths, workspace and outputs.
SCALE = 1 / 0.0078125
FIA = dict(num_heads=32, input_layout="BNSD", scale=SCALE, pre_tokens=65535, next_tokens=65535, softmax_lse_flag=False)
FIA_4_IN_1 = dict(num_heads=32, input_layout="BNSD", scale=SCALE, softmax_lse_flag=False)  # its 4-in-1 test's
FIA_V2 = dict(
    num_query_heads=32,
    input_layout="BNSD",
    softmax_scale=SCALE,
    pre_tokens=65535,
    next_tokens=65535,
    return_softmax_lse=False,
)


def assert_equal(a, b):
    assert torch.equal(a.float(), b.float()), (a, b)


def _qkv(s_kv=1):
    query = torch.randn(1, 32, 1, 128, dtype=torch.float16, device=DEVICE)
    key = torch.randn(1, 32, s_kv, 128, dtype=torch.float16, device=DEVICE)
    value = torch.randn(1, 32, s_kv, 128, dtype=torch.float16, device=DEVICE)
    return query, key, value


def _ifa_update(with_reset: bool, s_kv: int = 1):
    npu.set_device(0)
    length = [29]
    length_new = [100]
    query, key, value = _qkv(s_kv)
    kv_len, kv_len_new = [min(s_kv, 3)], [s_kv]
    res_src = torch_npu.npu_fused_infer_attention_score(
        query,
        key,
        value,
        **FIA,
        actual_seq_lengths=length_new,
        actual_seq_lengths_kv=kv_len_new,
    )

    g = npu.NPUGraph()
    event = npu.ExternalEvent()
    update_stream = npu.Stream()
    workspace = torch_npu._npu_fused_infer_attention_score_get_max_workspace(
        query,
        key,
        value,
        **FIA,
        actual_seq_lengths=length,
        actual_seq_lengths_kv=kv_len,
    )

    with npu.graph(g):
        stream = npu.current_stream()
        output = torch.empty(1, 32, 1, 128, dtype=torch.float16, device=DEVICE)
        softmax_lse = torch.empty(1, dtype=torch.float16, device=DEVICE)
        event.wait(stream)
        if with_reset:
            event.reset(stream)
        npu.graph_task_group_begin(stream)
        torch_npu.npu_fused_infer_attention_score.out(
            query,
            key,
            value,
            **FIA,
            workspace=workspace,
            actual_seq_lengths=length,
            actual_seq_lengths_kv=kv_len,
            out=[output, softmax_lse],
        )
        handle = npu.graph_task_group_end(stream)

    with npu.stream(update_stream):
        npu.graph_task_update_begin(update_stream, handle)
        torch_npu.npu_fused_infer_attention_score.out(
            query,
            key,
            value,
            **FIA,
            workspace=workspace,
            actual_seq_lengths=length_new,
            actual_seq_lengths_kv=kv_len_new,
            out=[output, softmax_lse],
        )
        npu.graph_task_update_end(update_stream)
        event.record(update_stream)

    g.replay()
    assert_equal(output.cpu(), res_src[0].cpu())
    assert_equal(softmax_lse.cpu(), res_src[1].cpu())


def test_ifa_update():
    _ifa_update(with_reset=True)


def test_ifa_update_without_reset():
    _ifa_update(with_reset=False)


def test_ifa_update_changes_the_key_length():
    """The same scenario where the update really matters: 3 keys at capture, 9 after."""
    _ifa_update(with_reset=True, s_kv=9)


def test_ifa_update_with_auto_dispatch_capture():
    npu.set_device(0)
    length = [29]
    length_new = [100]
    query, key, value = _qkv()
    res_src = torch_npu.npu_fused_infer_attention_score(
        query,
        key,
        value,
        **FIA,
        actual_seq_lengths=length_new,
    )
    g = npu.NPUGraph()
    workspace = torch_npu._npu_fused_infer_attention_score_get_max_workspace(
        query,
        key,
        value,
        **FIA,
        actual_seq_lengths=length,
    )
    with npu.graph(g, auto_dispatch_capture=True):
        output = torch.empty(1, 32, 1, 128, dtype=torch.float16, device=DEVICE)
        softmax_lse = torch.empty(1, dtype=torch.float16, device=DEVICE)
        torch_npu.npu_fused_infer_attention_score.out(
            query,
            key,
            value,
            **FIA,
            workspace=workspace,
            actual_seq_lengths=length,
            out=[output, softmax_lse],
        )
    g.update(cpu_update_input=[{"actual_seq_lengths": length_new}])
    g.replay()
    assert_equal(output.cpu(), res_src[0].cpu())
    assert_equal(softmax_lse.cpu(), res_src[1].cpu())


def test_ifa_update_with_non_out_and_auto_dispatch_capture():
    npu.set_device(0)
    length = [29]
    length_new = [100]
    query, key, value = _qkv()
    res_src = torch_npu.npu_fused_infer_attention_score(
        query,
        key,
        value,
        **FIA,
        actual_seq_lengths=length_new,
    )
    g = npu.NPUGraph()
    with npu.graph(g, auto_dispatch_capture=True):
        output = torch.empty(1, 32, 1, 128, dtype=torch.float16, device=DEVICE)
        softmax_lse = torch.empty(1, dtype=torch.float16, device=DEVICE)
        output, softmax_lse = torch_npu.npu_fused_infer_attention_score(
            query,
            key,
            value,
            **FIA,
            actual_seq_lengths=length,
        )
    g.update(cpu_update_input=[{"actual_seq_lengths": length_new}])
    g.replay()
    assert_equal(output.cpu(), res_src[0].cpu())
    assert_equal(softmax_lse.cpu(), res_src[1].cpu())


def test_npu_fused_infer_attention_score_v2():
    npu.set_device(0)
    length = [29]
    length_new = [100]
    query, key, value = _qkv()
    res_src = torch_npu.npu_fused_infer_attention_score_v2(
        query,
        key,
        value,
        **FIA_V2,
        actual_seq_qlen=length_new,
    )
    g = npu.NPUGraph()
    event = npu.ExternalEvent()
    update_stream = npu.Stream()
    workspace = torch_npu._npu_fused_infer_attention_score_v2_get_max_workspace(
        query,
        key,
        value,
        **FIA_V2,
        actual_seq_qlen=length,
    )
    with npu.graph(g):
        stream = npu.current_stream()
        output = torch.empty(1, 32, 1, 128, dtype=torch.float16, device=DEVICE)
        softmax_lse = torch.empty(1, dtype=torch.float16, device=DEVICE)
        event.wait(stream)
        event.reset(stream)
        npu.graph_task_group_begin(stream)
        torch_npu.npu_fused_infer_attention_score_v2.out(
            query,
            key,
            value,
            **FIA_V2,
            workspace=workspace,
            actual_seq_qlen=length,
            out=[output, softmax_lse],
        )
        handle = npu.graph_task_group_end(stream)
    with npu.stream(update_stream):
        npu.graph_task_update_begin(update_stream, handle)
        torch_npu.npu_fused_infer_attention_score_v2.out(
            query,
            key,
            value,
            **FIA_V2,
            workspace=workspace,
            actual_seq_qlen=length_new,
            out=[output, softmax_lse],
        )
        npu.graph_task_update_end(update_stream)
        event.record(update_stream)
    g.replay()
    assert_equal(output.cpu(), res_src[0].cpu())
    assert_equal(softmax_lse.cpu(), res_src[1].cpu())


def test_ifa_update_with_4_in_1_helper():
    npu.set_device(0)
    query, key, value = _qkv(s_kv=6)
    kv, kv_new = [2], [6]
    res_src = torch_npu.npu_fused_infer_attention_score(
        query,
        key,
        value,
        **FIA_4_IN_1,
        actual_seq_lengths_kv=kv_new,
    )
    g = npu.NPUGraph()
    event = npu.ExternalEvent()
    update_stream = npu.Stream()
    workspace = torch_npu._npu_fused_infer_attention_score_get_max_workspace(
        query,
        key,
        value,
        **FIA_4_IN_1,
        actual_seq_lengths_kv=kv,
    )
    with npu.graph(g):
        stream = npu.current_stream()
        output = torch.empty(1, 32, 1, 128, dtype=torch.float16, device=DEVICE)
        softmax_lse = torch.empty(1, dtype=torch.float16, device=DEVICE)
        event.wait(stream)
        event.reset(stream)
        npu.graph_task_group_begin(stream)
        torch_npu.npu_fused_infer_attention_score.out(
            query,
            key,
            value,
            **FIA_4_IN_1,
            workspace=workspace,
            actual_seq_lengths_kv=kv,
            out=[output, softmax_lse],
        )
        handle = npu.graph_task_group_end(stream)
    torch_npu._C._npu_fused_infer_attention_score_out_graph(
        update_stream,
        handle,
        event,
        query,
        key,
        value,
        **FIA_4_IN_1,
        workspace=workspace,
        actual_seq_lengths_kv=kv_new,
        out=[output, softmax_lse],
    )
    g.replay()
    assert_equal(output.cpu(), res_src[0].cpu())


def test_pa_auto_dispatch_update_against_golden():
    """PA captured with auto-dispatch, updated with new context_lens, vs a golden reference."""
    npu.set_device(0)
    num_tokens, num_heads, kv_heads, head_size, block_size, num_blocks = 4, 8, 2, 128, 16, 32
    scale = head_size**-0.5
    query = torch.randn(num_tokens, num_heads, head_size, dtype=torch.float16, device=DEVICE)
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_size, dtype=torch.float16, device=DEVICE)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, head_size, dtype=torch.float16, device=DEVICE)
    block_table = torch.randint(0, num_blocks, (num_tokens, 8), dtype=torch.int32, device=DEVICE)
    context_lens = torch.tensor([1] * num_tokens, dtype=torch.int32)  # host lengths
    new_lens = [17, 128, 5, 64]
    output = torch.empty_like(query)
    g = npu.NPUGraph()
    with npu.graph(g, auto_dispatch_capture=True):
        torch_npu._npu_paged_attention(
            query=query,
            key_cache=key_cache,
            value_cache=value_cache,
            num_kv_heads=kv_heads,
            num_heads=num_heads,
            scale_value=scale,
            block_table=block_table,
            context_lens=context_lens,
            out=output,
        )
    # the record holds PA's arguments positionally (context_lens at 7): its update takes a
    # host tensor, as the op does (a list is refused, as torch_npu's schema refuses it)
    with pytest.raises(ValueError, match="context_lens"):
        g.update(cpu_update_input=[{"context_lens": new_lens}])
    # torch_npu's update does not close the update it failed in: the update stream stays in it
    update_stream = g.graph_dispatch_mode.update_stream
    with pytest.raises(RuntimeError, match="is already updating"):
        g.update(cpu_update_input=[{"context_lens": torch.tensor(new_lens, dtype=torch.int32)}])
    with pytest.raises(torch_npu.UpdateMismatchError, match="0 ops"):
        npu.graph_task_update_end(update_stream)  # what its caller must do to go on: close the empty update
    g.update(cpu_update_input=[{"context_lens": torch.tensor(new_lens, dtype=torch.int32)}])
    g.replay()
    npu.synchronize()
    # golden: per request, gather its keys and run softmax attention in float32, on the host
    golden = torch.empty(num_tokens, num_heads, head_size)
    group = num_heads // kv_heads
    query, key_cache, value_cache, block_table = (t.cpu() for t in (query, key_cache, value_cache, block_table))
    for i, length in enumerate(new_lens):
        pos = torch.arange(length)
        blocks = block_table[i, pos // block_size].long()
        k = key_cache[blocks, pos % block_size].float()  # [L, KVN, D]
        v = value_cache[blocks, pos % block_size].float()
        for h in range(num_heads):
            s = (query[i, h].float() @ k[:, h // group].T) * scale
            p = torch.softmax(s, -1).half().float()
            golden[i, h] = p @ v[:, h // group]
    assert torch.allclose(output.cpu().float(), golden, atol=2e-3, rtol=1e-3)


def test_pa_captured_with_lengths_past_its_table_is_accepted_and_faults_only_if_replayed_so():
    """vllm-ascend captures PA at a context length past the block table (its
    SEQ_LEN_WITH_MAX_PA_WORKSPACE, for the largest workspace), then updates every task with
    the step's lengths before each replay.  A capture only records the arguments and the
    device accepts them; the kernel reads past the table only if it runs so: the replay."""
    npu.set_device(0)
    tokens, heads, kv_heads, head_size, block_size = 2, 4, 2, 64, 16
    query = torch.randn(tokens, heads, head_size, dtype=torch.float16, device=DEVICE)
    cache = torch.randn(8, block_size, kv_heads, head_size, dtype=torch.float16, device=DEVICE)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=DEVICE)  # 32 positions per request
    past = torch.tensor([6144, 6144], dtype=torch.int32)
    args = dict(query=query, key_cache=cache, value_cache=cache, num_kv_heads=kv_heads, num_heads=heads)
    args.update(scale_value=head_size**-0.5, block_table=table)
    workspace = torch_npu._npu_paged_attention_get_workspace(**args, context_lens=past, out=torch.empty_like(query))
    out = torch.empty_like(query)
    g = npu.NPUGraph()
    with npu.graph(g):
        stream = npu.current_stream()
        event = npu.ExternalEvent()
        event.wait(stream)
        event.reset(stream)
        npu.graph_task_group_begin(stream)
        torch_npu._npu_paged_attention(**args, context_lens=past, out=out, workspace=workspace)
        handle = npu.graph_task_group_end(stream)
    event.record(npu.current_stream())
    g.replay()  # not updated: the kernel would read past the table
    with pytest.raises(torch_npu.ReplayFault, match=r"context_lens\[0\]. = 6144 is outside \[0, 32\]"):
        npu.synchronize()
    lens = torch.tensor([32, 5], dtype=torch.int32)
    stream = npu.current_stream()
    # as vllm-ascend 0.23.0.post1's update does: a workspace for the step's lengths
    workspace = torch_npu._npu_paged_attention_get_workspace(**args, context_lens=lens, out=out)
    npu.graph_task_update_begin(stream, handle)
    torch_npu._npu_paged_attention(**args, context_lens=lens, out=out, workspace=workspace)
    npu.graph_task_update_end(stream)
    event.record(stream)
    g.replay()
    npu.synchronize()
    eager = torch.empty_like(query)
    torch_npu._npu_paged_attention(**args, context_lens=lens, out=eager)
    assert torch.equal(out.cpu(), eager.cpu())
    with pytest.raises(ValueError, match="outside"):  # eagerly it runs at once: said at the call
        torch_npu._npu_paged_attention(**args, context_lens=past, out=eager)
