"""npugraph installed into vLLM (and vllm-ascend): :func:`register` is the plugin entry
point, :func:`install` replaces the graph wrappers, the capture's closing report and the
KV-cache budget, and :func:`uninstall` puts every original back."""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

from npugraph.errors import ConfigError
from npugraph.integrations.common import (
    ENV_DEVICE,
    ENV_ENABLE,
    check_settings,
    enabled,
    restore,
    unwrap_method,
    vocabulary_refusal,
    wrap_method,
)
from npugraph.integrations.common import say_captured as _say_captured
from npugraph.integrations.vllm import runner_v2, vllm_ascend
from npugraph.integrations.vllm.kv_budget import ESTIMATE_ATTR, MIB, RUNNER, patch_kv_budget, unpatch_kv_budget
from npugraph.integrations.vllm.wrapper import (
    RUNTIME_ATTR,
    DraftNpuGraphWrapper,
    NpuGraphWrapper,
    platform_has_npu_graphs,
)
from npugraph.runtime import Runtime

__all__ = ["WRAPPER_PATH", "install", "register", "say_captured", "uninstall"]

logger = logging.getLogger("vllm.npugraph")

WRAPPER_PATH = "npugraph.integrations.vllm.NpuGraphWrapper"  # what vLLM resolves by name


@functools.cache
def _log_once(message: str) -> None:
    logger.info(message)


def install(platform: Any = None) -> str | None:
    """Make vLLM (and vllm-ascend, if installed) use npugraph's wrapper and updater.

    Replaced names, and why it is safe:

    * ``<platform class>.get_static_graph_wrapper_cls`` → returns
      ``npugraph.integrations.vllm.NpuGraphWrapper``: vLLM resolves the wrapper
      class through it by name each time it builds one;
    * vllm-ascend ``vllm_ascend.compilation.acl_graph.ACLGraphWrapper`` (and the
      alias in ``vllm_ascend.worker.model_runner_v1``) → :class:`NpuGraphWrapper`,
      which has the same constructor and call contract;
    * vllm-ascend's own graph recorders and per-step update → npugraph's
      (:func:`npugraph.integrations.vllm.vllm_ascend.install`, for its Aug and Sept 2026
      generations): its backends become thin clients, and its update a no-op, since
      npugraph's wrapper updates the graph itself (a second update would record each
      event twice: a lost record, then a hang).

    Every original is kept on the patched object (``_npugraph_original_*``) and
    restored by :func:`uninstall`.  What was replaced is logged.  A vllm-ascend lacking a name
    it replaces (a release whose internals moved) gets nothing: every name is put back and one
    ERROR line names what is missing (:func:`refusal`); vLLM then serves with vllm-ascend's
    own graphs.  Returns that line, or None where npugraph is installed.
    """
    if platform is None:
        from vllm.platforms import current_platform as platform
    cls = type(platform)
    if not hasattr(cls, "_npugraph_original_wrapper_cls"):
        cls._npugraph_original_wrapper_cls = cls.__dict__.get("get_static_graph_wrapper_cls")
        cls.get_static_graph_wrapper_cls = classmethod(lambda c: WRAPPER_PATH)
    for module_name, names in _PATCHED:
        _patch(module_name, names, NpuGraphWrapper)
    _patch_capture_model()
    _patch_input_guard()
    _patch_render_guard()
    patch_kv_budget()
    found = vllm_ascend.install()
    if found is not None and found.missing:
        uninstall(platform)
        refused = refusal(found.missing)
        logger.error(refused)
        return refused
    # whether this process runs the v2 runner, vLLM decides later from its configuration
    # (its per-model default, or VLLM_USE_V2_MODEL_RUNNER): served either way
    served_v2 = runner_v2.install()
    if uses_model_runner_v2():
        logger.info("npugraph: vLLM's model runner v2: replaced %s", ", ".join(served_v2) or "nothing")
    for module_name, names in _PATCHED_DRAFT:  # after vllm-ascend's own import order (vllm_ascend.install)
        _patch(module_name, names, DraftNpuGraphWrapper)
    _log_once(f"npugraph: installed as the graph wrapper of {cls.__name__} (pid {os.getpid()})")
    return None


def refusal(missing: tuple[str, ...]) -> str:
    """The one line that says npugraph refused this vllm-ascend, naming what it lacks."""
    return (
        f"npugraph: vllm-ascend {vllm_ascend.version()} has no {', '.join(missing)}, which npugraph replaces: "
        "npugraph is not installed, and vLLM serves with vllm-ascend's own graphs (a release whose internals "
        "moved: pin one of those docs/vllm-ascend-release.md lists, or report it)"
    )


# vllm-ascend names install() replaces (where the module and the name exist), and uninstall() restores.
_PATCHED = (
    ("vllm_ascend.compilation.acl_graph", ("ACLGraphWrapper",)),
    ("vllm_ascend.worker.model_runner_v1", ("ACLGraphWrapper",)),
)


# vllm-ascend's speculative proposer (MTP, EAGLE): its draft model's graph wrapper
_PATCHED_DRAFT = (("vllm_ascend.spec_decode.llm_base_proposer", ("ACLGraphWrapper",)),)


def say_captured(runtime: Runtime) -> str:
    """:func:`npugraph.integrations.report.say_captured` in vLLM's log."""
    return _say_captured(runtime, logger)


def _patch_capture_model() -> None:
    """After vLLM's ``capture_model`` returns, say what npugraph captured in this process."""
    wrap_method(RUNNER, "capture_model", _saying_captured)


def _saying_captured(original: Any) -> Any:
    @functools.wraps(original)
    def capture_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        config = getattr(self, "vllm_config", None)
        runtime = getattr(config, RUNTIME_ATTR, None)
        if runtime is not None and runtime.manager.entries():
            say_captured(runtime)
            estimate = getattr(config, ESTIMATE_ATTR, None)
            if estimate is not None:
                held = sum(e.memory_bytes for e in runtime.entries())
                logger.info(
                    "npugraph: graph memory: %.2f MiB estimated before the KV cache and left out of its budget; "
                    "the capture took %.2f MiB (each size measured alone; a pool the profiling capture grew is "
                    "reused)",
                    estimate.bytes / MIB,
                    held / MIB,
                )
        return out

    return capture_model


# vLLM's input processor, whose _validate_model_input checks a prompt before it reaches the engine
_INPUTS = ("vllm.v1.engine.input_processor", "InputProcessor")


def _patch_input_guard() -> None:
    """Refuse a token prompt holding an id outside the model's vocabulary where vLLM validates
    it, with vLLM's own request error (a ``ValueError``: a 400 with the message).

    vLLM 0.23 compares the largest id with its tokenizer's ``max_token_id``, which it takes as
    at least ``tokenizer.vocab_size``: a count, one past the last id.  So an id equal to the
    vocabulary's size, or a negative one, passes, the engine core's embedding lookup fails (on
    a device it faults the NPU) and the server stops (``EngineDeadError``, HTTP 500 for every
    request after).  Multimodal prompts keep vLLM's rule: their placeholder ids may lie past
    the model's vocabulary and are replaced before the lookup."""
    if wrap_method(_INPUTS, "_validate_model_input", _guarded_validation) is False:
        logger.warning("npugraph: vLLM has no %s.%s._validate_model_input; prompt ids go unguarded", *_INPUTS)


def _guarded_validation(original: Any) -> Any:
    @functools.wraps(original)
    def _validate_model_input(self: Any, prompt_input: Any, *args: Any, **kwargs: Any) -> Any:
        refused = _token_refusal(prompt_input, self.model_config.get_vocab_size())
        if refused is not None:
            raise _request_error(refused)
        return original(self, prompt_input, *args, **kwargs)

    return _validate_model_input


def _request_error(message: str) -> Exception:
    """vLLM's own error for a bad request (``VLLMValidationError``), which its server answers
    with a 400: a ``ValueError`` in vLLM 0.23; from 0.30 a ``VLLMClientError``, and a plain
    ``ValueError`` there is a 500."""
    try:
        from vllm.exceptions import VLLMValidationError
    except ImportError:  # a vLLM before it: its server answers a ValueError with a 400
        return ValueError(message)
    return VLLMValidationError(message)


def _token_refusal(prompt_input: Any, vocab: int) -> str | None:
    """Why vLLM's engine input ``prompt_input`` cannot reach a model of ``vocab`` ids, if it is a
    token prompt holding one outside them (a multimodal prompt keeps vLLM's own rule)."""
    if not isinstance(prompt_input, Mapping) or prompt_input.get("type") != "token":
        return None
    return vocabulary_refusal(prompt_input.get("prompt_token_ids"), vocab, "vLLM", "vLLM's engine core")


# vLLM's server's rendering of a completion's prompts (where it refuses a bad one with a 400)
_RENDER = ("vllm.entrypoints.serve.render.serving", "OpenAIServingRender")


def _patch_render_guard() -> None:
    """The same refusal where vLLM's server renders a completion's prompts, answered as the
    render's own refusals are: an error response (a 400), before the engine sees the request.
    The input processor's guard alone would be logged by uvicorn with its stack ("Exception in
    ASGI application"), as vLLM's own out-of-vocabulary refusal is; this one is quiet, and the
    input processor's still covers every other way in (``vllm.LLM``, chat)."""
    # a vLLM without it (another version's server): the input processor's guard covers its requests
    wrap_method(_RENDER, "render_completion", _guarded_render)


def _guarded_render(original: Any) -> Any:
    @functools.wraps(original)
    async def render_completion(self: Any, *args: Any, **kwargs: Any) -> Any:
        inputs = await original(self, *args, **kwargs)
        if isinstance(inputs, list):
            vocab = self.model_config.get_vocab_size()
            for prompt_input in inputs:
                refused = _token_refusal(prompt_input, vocab)
                if refused is not None:
                    return self.create_error_response(refused)
        return inputs

    return render_completion


def _unpatch_capture_model() -> None:
    unwrap_method(RUNNER, "capture_model")


def _patch(module_name: str, names: tuple[str, ...], value: Any) -> None:
    try:
        module = __import__(module_name, fromlist=["_"])
    except Exception:  # vllm-ascend absent (or broken): nothing to replace
        return
    for name in names:
        if hasattr(module, name) and not hasattr(module, f"_npugraph_original_{name}"):
            current = getattr(module, name)
            if isinstance(current, type) and issubclass(current, NpuGraphWrapper):
                # imported from a module patched before it: vllm-ascend's own class is
                # the one that module keeps (what uninstall() puts back here too)
                current = _original_wrapper(name, current)
            setattr(module, f"_npugraph_original_{name}", current)
            setattr(module, name, value)


def _original_wrapper(name: str, default: Any) -> Any:
    for module_name, names in _PATCHED:
        module = sys.modules.get(module_name)
        if name in names and module is not None and hasattr(module, f"_npugraph_original_{name}"):
            return getattr(module, f"_npugraph_original_{name}")
    return default


def _unpatch(module_name: str, names: tuple[str, ...]) -> None:
    for name in names:
        restore(sys.modules.get(module_name), name)


def uninstall(platform: Any = None) -> None:
    """Undo :func:`install` on ``platform``: every name it replaced gets its original back."""
    if platform is None:
        from vllm.platforms import current_platform as platform
    cls = type(platform)
    if hasattr(cls, "_npugraph_original_wrapper_cls"):
        original = cls._npugraph_original_wrapper_cls
        del cls.get_static_graph_wrapper_cls
        if original is not None:
            cls.get_static_graph_wrapper_cls = original
        del cls._npugraph_original_wrapper_cls
    for module_name, names in _PATCHED + _PATCHED_DRAFT:
        _unpatch(module_name, names)
    _unpatch_capture_model()
    unwrap_method(_INPUTS, "_validate_model_input")
    unwrap_method(_RENDER, "render_completion")
    unpatch_kv_budget()
    vllm_ascend.uninstall()
    runner_v2.uninstall()


# vLLM's own knob for more variables to copy from the driver to its Ray workers
RAY_PREFIXES = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"


def carry_settings_to_ray_workers() -> None:
    """Add ``NPUGRAPH_`` to vLLM's ``VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY``.

    vLLM's Ray executor starts each worker with only the variables it knows copied from the
    driver (``VLLM_*``, ``HF_*``, ``NCCL_*``, ...: ``vllm.ray.ray_env``); without this, a
    worker on another host would start without ``NPUGRAPH_ENABLE`` and serve with the
    platform's own graphs, silently.  The multiprocessing executor's workers inherit the
    environment and need nothing."""
    prefixes = [p.strip() for p in os.environ.get(RAY_PREFIXES, "").split(",") if p.strip()]
    if "NPUGRAPH_" not in prefixes:
        os.environ[RAY_PREFIXES] = ",".join([*prefixes, "NPUGRAPH_"])


def uses_model_runner_v2() -> bool:
    """Whether the user asked for vLLM's model runner v2 (``VLLM_USE_V2_MODEL_RUNNER=1``;
    vllm-ascend's ``worker/v2``): its FULL graphs are captured by its graph manager, not a
    static wrapper (npugraph serves them there: :mod:`npugraph.integrations.vllm.runner_v2`).
    Without the variable vLLM may still choose it, per model, once configured: the capture
    loop npugraph wraps serves or refuses it then."""
    return os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower() in ("1", "true")


def check_model_runner() -> None:
    """Refuse vLLM's model runner v2 where it has no graph manager npugraph serves (a vLLM or
    vllm-ascend without ``ModelAclGraphManager``): with npugraph's recorders installed, its
    captures would record the attention with no task group to update: stale lengths,
    silently.  Left untouched, the engine serves with its own graphs."""
    if uses_model_runner_v2() and not runner_v2.available():
        raise ConfigError(
            "VLLM_USE_V2_MODEL_RUNNER=1: this vLLM / vllm-ascend has no v2 graph manager npugraph serves "
            "(vllm_ascend.worker.v2.aclgraph_utils.ModelAclGraphManager); unset it to serve with npugraph "
            "(the v1 runner), or set NPUGRAPH_ENABLE=0"
        )


def register() -> None:
    """vLLM general-plugin entry point: install npugraph when ``NPUGRAPH_ENABLE=1``.

    It never raises (vLLM's plugin loader would print a traceback and go on): a bad
    setting is one error line in vLLM's log, and vLLM is left untouched.
    """
    if not enabled():
        return
    try:
        device = check_settings()
        check_model_runner()
    except ConfigError as exc:
        logger.error("npugraph: %s; vLLM left untouched", exc)
        return
    carry_settings_to_ray_workers()  # before any executor starts: register runs at vLLM's start
    try:
        from vllm.platforms import current_platform
    except ImportError as exc:
        _log_once(f"npugraph: {ENV_ENABLE}=1 but vLLM cannot be imported ({exc}); nothing installed")
        return
    if device is None and not platform_has_npu_graphs(current_platform):
        _log_once(
            f"npugraph: platform {type(current_platform).__name__} has no NPU graphs; vLLM left "
            f"untouched (set {ENV_DEVICE}=sim to use npugraph's simulator)"
        )
        return
    install(current_platform)
