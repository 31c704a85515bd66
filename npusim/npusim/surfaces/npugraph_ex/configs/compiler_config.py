"""``CompilerConfig``: npugraph_ex's flat option set, each option validated when set."""

from __future__ import annotations

from typing import Any

__all__ = ["CompilerConfig", "_process_kwargs_options"]

# option -> default (npugraph_ex's); an option missing here is refused when set
_OPTIONS: dict[str, Any] = {
    "mode": "npugraph_ex",
    "force_eager": False,
    "use_graph_pool": None,
    "reuse_graph_pool_in_same_fx": True,
    "capture_limit": 64,
    "clone_input": True,
    "clone_output": False,
    "static_kernel_compile": False,
    "disable_static_kernel_compile_cache": False,
    "frozen_parameter": False,
    "remove_noop_ops": True,
    "remove_cat_ops": True,
    "inplace_pass": True,
    "input_inplace_pass": True,
    "pattern_fusion_pass": True,
    "post_grad_custom_pre_pass": None,
    "post_grad_custom_post_pass": None,
    "dump_tensor_data": False,
    "data_dump_stage": "optimized",
    "data_dump_dir": "./",
    "_vllm_aclnn_static_kernel_sym_index": 0,
    "_vllm_aclnn_static_kernel_sym_range": None,
    "deadlock_check": False,
    "capture_error_mode": "global",
    "force_recapture": False,
}
_CHOICES = {"mode": ("npugraph_ex",), "capture_error_mode": ("global", "thread_local", "relaxed")}


class CompilerConfig:
    """npugraph_ex's compiler options (``CompilerConfig()``: every option at its default)."""

    def __init__(self) -> None:
        object.__setattr__(self, "_values", dict(_OPTIONS))

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        raise AttributeError(f"CompilerConfig has no option {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in _OPTIONS:
            raise ValueError(
                f"Invalid option '{name}'. Supported attributes are: {sorted(k for k in _OPTIONS if not k.startswith('_'))}"
            )
        choices = _CHOICES.get(name)
        if choices is not None and value not in choices:
            raise ValueError(f"Invalid value {value!r} for option '{name}': expected one of {list(choices)}")
        self._values[name] = value

    def as_dict(self) -> tuple[dict[str, Any], dict[str, Any]]:
        return {k: v for k, v in self._values.items() if v != _OPTIONS[k]}, {}


def _process_kwargs_options(config: CompilerConfig, kwargs: dict[str, Any]) -> None:
    """Apply ``kwargs["options"]`` (``torch.compile(..., options=...)``) to ``config``."""
    for key, value in (kwargs.get("options") or {}).items():
        setattr(config, key, value)
