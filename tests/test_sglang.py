"""npugraph's SGLang plugin against SGLang itself (runs in the SGLang environment of
release/sglang/env.sh, from make sglang-check; elsewhere it skips): the entry point is
SGLang's, it does nothing unless asked, its hooks go through SGLang's own HookRegistry onto
the classes SGLang 0.5.23 has, and uninstall() puts SGLang's functions back.  The plugin at
work (capture, update, replay, tokens) is judged by release/sglang/test_generate.py."""

from __future__ import annotations

import importlib.metadata
import logging
import pkgutil

import pytest

pytest.importorskip("sglang", reason="needs the SGLang environment (release/sglang/env.sh)")

from sglang.srt.plugins import hook_registry as hr

import npusim as sim
from npugraph.integrations import sglang as plugin


@pytest.fixture(autouse=True)
def _simulator():
    sim.install_torch_npu(device=True)
    yield
    plugin.uninstall()


def _targets() -> dict[str, object]:
    return {target: pkgutil.resolve_name(target) for target, _, _ in plugin._HOOKS + plugin._INTAKE}


def test_the_entry_point_is_sglangs_plugin_group():
    (ep,) = [e for e in importlib.metadata.entry_points(group="sglang.srt.plugins") if e.name == "npugraph"]
    assert ep.load() is plugin.load_plugin


def test_the_plugin_does_nothing_unless_asked(monkeypatch):
    monkeypatch.delenv(plugin.ENV, raising=False)
    before = _targets()
    plugin.load_plugin()
    assert _targets() == before
    for target, _, hook in plugin._HOOKS + plugin._INTAKE:
        assert all(entry[1] is not hook for entry in hr.HookRegistry._hooks.get(target, []))


def test_install_hooks_sglangs_classes_and_uninstall_restores_them(monkeypatch):
    monkeypatch.setenv(plugin.ENV, "1")
    before = _targets()
    plugin.load_plugin()
    after = _targets()
    for target, original in before.items():
        assert after[target] is not original, f"{target} is not hooked"
    plugin.load_plugin()  # a second load hooks nothing twice
    for target, _, hook in plugin._HOOKS + plugin._INTAKE:
        assert sum(h is hook for _, h, _ in hr.HookRegistry._hooks[target]) == 1
    plugin.uninstall()
    assert _targets() == before


def test_a_bad_setting_is_one_error_line_and_sglang_is_left_untouched(monkeypatch, caplog):
    monkeypatch.setenv(plugin.ENV, "1")
    monkeypatch.setenv("NPUGRAPH_DEVICE", "cuda")
    before = _targets()
    with caplog.at_level(logging.ERROR, logger="sglang.npugraph"):
        plugin.load_plugin()
    assert _targets() == before
    (line,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert "NPUGRAPH_DEVICE='cuda' is not a device npugraph knows" in line and "SGLang left untouched" in line


def test_a_prompt_token_outside_the_vocabulary_is_refused_at_sglangs_intake(monkeypatch):
    """SGLang 0.5.23 checks no prompt id against the vocabulary and its scheduler dies on one;
    the plugin's hook on SGLang's own request validation refuses it there, with SGLang's request
    error (a ValueError: its endpoints answer 400 with the message).  A good prompt goes on to
    SGLang's own checks (here: its context-length refusal, its message, not ours)."""
    from types import SimpleNamespace

    from sglang.srt.managers import tokenizer_manager as tm
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    # the server's published execution config, which SGLang's checks read first (no server here)
    features = SimpleNamespace(enable_encoder_swa_bounded_replay=False)
    monkeypatch.setattr(tm, "get_exec", lambda: SimpleNamespace(features=features))

    manager = object.__new__(TokenizerManager)
    manager.model_config = SimpleNamespace(vocab_size=1024, joint_head_config=None, pointer_head=None)
    manager.context_len, manager.num_reserved_tokens, manager.allow_auto_truncate = 4, 0, False
    manager.validate_total_tokens = True
    obj = GenerateReqInput(input_ids=[5, 6, 7, 8, 9], sampling_params={"max_new_tokens": 2})
    sglangs_own = "Requested token count exceeds"  # SGLang's next check: 3 ids + 2 new tokens > 4

    def validate(ids):
        TokenizerManager._validate_one_request(manager, obj, ids)

    with pytest.raises(ValueError, match="longer than the model's context length"):
        validate([5, 6, 1023, 8, 9])  # not installed: SGLang's own check
    with pytest.raises(ValueError, match=sglangs_own):
        validate([5, 6, 99999])  # not installed: SGLang finds nothing wrong with the id
    monkeypatch.setenv(plugin.ENV, "1")
    plugin.load_plugin()
    for bad, where in ((99999, 2), (1024, 2), (-1, 0)):
        ids = [5, 6, bad] if where == 2 else [bad, 5, 6]
        with pytest.raises(ValueError, match=rf"token id {bad} at position {where}, outside the model's vocabulary"):
            validate(ids)
    with pytest.raises(ValueError, match="longer than the model's context length"):
        validate([0, 6, 1023, 8, 9])  # in the vocabulary, its first and last id: on to SGLang's own checks
    plugin.uninstall()
    with pytest.raises(ValueError, match=sglangs_own):
        validate([5, 6, 99999])
