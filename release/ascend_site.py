"""What the release environment runs at interpreter start (``ascend_site.pth``), for the one
piece of vllm-ascend it cannot have: ``vllm_ascend_C``, its C++ custom ops (built against CANN).

vllm-ascend decides lazily whether its custom ops exist (``vllm_ascend.utils.enable_custom_op``,
cached): it imports ``vllm_ascend.vllm_ascend_C`` the first time a layer asks.  With
``torch.compile`` (vllm-ascend's ACL graph mode) that first time is inside Dynamo's trace,
where an import that fails stops the compilation.  On an Ascend host the import succeeds;
here it cannot, so the answer ("disabled", logged once) is settled as soon as
``vllm_ascend.utils`` is imported, outside any trace.
"""

from __future__ import annotations

from npugraph_hook import after_import

after_import("vllm_ascend.utils", lambda utils: utils.enable_custom_op())
