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
    return {target: pkgutil.resolve_name(target) for target, _, _ in plugin._HOOKS}


def test_the_entry_point_is_sglangs_plugin_group():
    (ep,) = [e for e in importlib.metadata.entry_points(group="sglang.srt.plugins") if e.name == "npugraph"]
    assert ep.load() is plugin.load_plugin


def test_the_plugin_does_nothing_unless_asked(monkeypatch):
    monkeypatch.delenv(plugin.ENV, raising=False)
    before = _targets()
    plugin.load_plugin()
    assert _targets() == before
    for target, _, hook in plugin._HOOKS:
        assert all(entry[1] is not hook for entry in hr.HookRegistry._hooks.get(target, []))


def test_install_hooks_sglangs_classes_and_uninstall_restores_them(monkeypatch):
    monkeypatch.setenv(plugin.ENV, "1")
    before = _targets()
    plugin.load_plugin()
    after = _targets()
    for target, original in before.items():
        assert after[target] is not original, f"{target} is not hooked"
    plugin.load_plugin()  # a second load hooks nothing twice
    for target, _, hook in plugin._HOOKS:
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
