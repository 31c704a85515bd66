"""torchair's ``CompilerConfig``: nested option groups, each option checked when set.

As torchair's ``NpuBaseConfig``: an option is an :class:`OptionValue` (reading the attribute
gives the option, ``.value`` its value); setting an option checks the value against its
choices; setting a name that is not an option raises ``ValueError`` naming the options.
The option set is the part of torchair's that SGLang and vllm-ascend touch, with
torchair's defaults; an option torchair has and this lacks is refused, by name.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CompilerConfig", "NpuBaseConfig", "OptionValue"]


class OptionValue:
    """One option: its default, and the values it may take (``None``: any)."""

    def __init__(self, default: Any, optional: list[Any] | None = None) -> None:
        self._default, self._optional = default, optional
        self._value = default

    def __bool__(self) -> bool:
        return bool(self._value)

    @property
    def default(self) -> Any:
        return self._default

    @property
    def optional(self) -> list[Any] | None:
        return self._optional

    @property
    def value(self) -> Any:
        return self._value

    @value.setter
    def value(self, v: Any) -> None:
        if self._optional is not None and v not in self._optional:
            raise ValueError(f"Value {v!r} (type: {type(v)}) not in optional list {self._optional}")
        self._value = v


class NpuBaseConfig:
    """A group of options; its attributes are fixed once made."""

    _fixed_attrs: list[str]

    def __init__(self) -> None:
        fixed = [k for k, v in self.__dict__.items() if isinstance(v, (OptionValue, NpuBaseConfig))]
        object.__setattr__(self, "_fixed_attrs", fixed)

    def __setattr__(self, key: str, value: Any) -> None:
        if "_fixed_attrs" in self.__dict__:
            if key not in self._fixed_attrs:
                raise ValueError(f"{type(self).__name__} has no option {key}, all options {self._fixed_attrs}")
            current = getattr(self, key)
            if isinstance(current, OptionValue):
                current.value = value
                return
        object.__setattr__(self, key, value)


def _bool(default: bool) -> OptionValue:
    return OptionValue(default, [True, False])


class _Dump(NpuBaseConfig):
    def __init__(self) -> None:
        self.type = OptionValue(None, ["txt", "pbtxt", "py"])
        super().__init__()


class _DebugConfig(NpuBaseConfig):
    def __init__(self) -> None:
        self.graph_dump = _Dump()
        self.run_eagerly = _bool(False)
        super().__init__()


class _ExperimentalConfig(NpuBaseConfig):
    def __init__(self) -> None:
        self.frozen_parameter = _bool(False)
        self.tiling_schedule_optimize = _bool(False)
        self.keep_inference_input_mutations = _bool(True)
        self.enable_view_optimize = _bool(True)
        super().__init__()


class _InferenceConfig(NpuBaseConfig):
    def __init__(self) -> None:
        self.dynamic_gears_merge_policy = OptionValue("zip", ["product", "zip"])
        super().__init__()


class _AclGraphConfig(NpuBaseConfig):
    def __init__(self) -> None:
        self.use_custom_pool = OptionValue(None)
        super().__init__()


class CompilerConfig(NpuBaseConfig):
    """torchair's compiler options (``CompilerConfig()``: every option at its default)."""

    def __init__(self) -> None:
        self.debug = _DebugConfig()
        self.experimental_config = _ExperimentalConfig()
        self.inference_config = _InferenceConfig()
        self.aclgraph_config = _AclGraphConfig()
        self.mode = OptionValue("max-autotune", ["max-autotune", "reduce-overhead", "npugraph_ex"])
        self.post_grad_custom_pre_pass = OptionValue(None)
        self.post_grad_custom_post_pass = OptionValue(None)
        super().__init__()
