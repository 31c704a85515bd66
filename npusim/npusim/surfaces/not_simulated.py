"""Names other code imports whose work the simulator does not do: each refuses when called,
naming itself, why, and where it runs instead (never at import)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["not_simulated"]


def not_simulated(qualname: str, why: str, instead: str = "run it on an Ascend host") -> Callable[..., Any]:
    """A stand-in for ``qualname`` that raises ``RuntimeError`` when called."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{qualname} is not simulated by npusim ({why}); {instead}")

    refuse.__name__ = refuse.__qualname__ = qualname.rsplit(".", 1)[-1]
    return refuse
