"""Names other code imports whose work the simulator does not do: each refuses when called,
naming itself, why, and where it runs instead (never at import)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["not_simulated", "npu_mla_prolog", "npu_mla_prolog_v2", "npu_mla_prolog_v3"]


def not_simulated(qualname: str, why: str, instead: str = "run it on an Ascend host") -> Callable[..., Any]:
    """A stand-in for ``qualname`` that raises ``RuntimeError`` when called."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{qualname} is not simulated by npusim ({why}); {instead}")

    refuse.__name__ = refuse.__qualname__ = qualname.rsplit(".", 1)[-1]
    return refuse


# torch_npu's fused MLA pre-processing (q and kv down/up-projections, norms, rope and the cache
# write in one kernel): vllm-ascend calls it with its mlapo path on, and its tests patch it by
# name, so the name must exist; the simulator runs MLA's unfused path
_MLA_PROLOG = "MLA's fused pre-processing; the simulator runs vllm-ascend's unfused MLA path"
npu_mla_prolog = not_simulated("torch_npu.npu_mla_prolog", _MLA_PROLOG)
npu_mla_prolog_v2 = not_simulated("torch_npu.npu_mla_prolog_v2", _MLA_PROLOG)
npu_mla_prolog_v3 = not_simulated("torch_npu.npu_mla_prolog_v3", _MLA_PROLOG)
