"""What the release environment adds at interpreter start (``ascend_site.pth``), for the one
piece of vllm-ascend it cannot have: ``vllm_ascend_C``, its C++ custom ops (built against CANN).

vllm-ascend decides lazily whether its custom ops exist (``vllm_ascend.utils.enable_custom_op``,
cached): it imports ``vllm_ascend.vllm_ascend_C`` the first time a layer asks.  With
``torch.compile`` (vllm-ascend's ACL graph mode) that first time is inside Dynamo's trace,
where an import that fails stops the compilation.  On an Ascend host the import succeeds;
here it cannot, so the answer ("disabled", logged once) is settled as soon as
``vllm_ascend.utils`` is imported, outside any trace.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Any

_MODULE = "vllm_ascend.utils"


class _AfterUtils(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != _MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            module.enable_custom_op()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if not any(isinstance(f, _AfterUtils) for f in sys.meta_path):
    sys.meta_path.insert(0, _AfterUtils())
