"""``register_replacement``: one process-wide pattern pass every npugraph_ex compile applies."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch._inductor import pattern_matcher as pm

__all__ = ["register_replacement"]


def _inductor_patterns() -> ModuleType:
    """torch's pattern matcher, imported at first use: the simulator loads inside ``import
    torch`` (torch's device-backend autoload), and inductor imports Triton, which may be the
    very module whose import started torch's (vllm-ascend 0.30 imports triton first)."""
    from torch._inductor import pattern_matcher

    return pattern_matcher


def _return_true(match: Any) -> bool:
    return True


@functools.cache
def _pattern_manager() -> pm.PatternMatcherPass:
    """The pass the registered patterns go into (one per process, as npugraph_ex's)."""
    pass_type: type[pm.PatternMatcherPass] = _inductor_patterns().PatternMatcherPass
    return pass_type(pass_name="npugraph_ex_generic_pattern_pass")


def register_replacement(
    search_fn: Callable[..., Any],
    replace_fn: Callable[..., Any],
    example_inputs: Iterable[Any],
    trace_fn: Callable[..., Any] | None = None,
    extra_check: Callable[[Any], bool] = _return_true,
    search_fn_pattern: Any = None,
    scalar_workaround: Any = None,
    skip_duplicates: bool = False,
) -> bool:
    """Register ``search_fn`` → ``replace_fn`` (traced with ``trace_fn`` on ``example_inputs``,
    real tensors; default: torch's ``fwd_only``) for every npugraph_ex compile; a duplicate
    raises torch's ``RuntimeError("Duplicate pattern ...")`` unless ``skip_duplicates``."""
    patterns = _inductor_patterns()
    return bool(
        patterns.register_replacement(
            search_fn,
            replace_fn,
            list(example_inputs),
            trace_fn if trace_fn is not None else patterns.fwd_only,
            _pattern_manager(),
            extra_check=extra_check,
            scalar_workaround=scalar_workaround or {},
            search_fn_pattern=search_fn_pattern,
            skip_duplicates=skip_duplicates,
        )
    )
