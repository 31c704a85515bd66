"""The 4-in-1 FIA update (``_C._npu_fused_infer_attention_score_out_graph``)."""

from __future__ import annotations

from typing import Any

import torch

from npusim.kernels.fia import fia_out
from npusim.runtime import state as rt
from npusim.runtime.external import ExternalEvent
from npusim.runtime.taskgroups import NPUTaskGroupHandle, graph_task_update_begin, graph_task_update_end

__all__ = ["_npu_fused_infer_attention_score_out_graph"]


def _npu_fused_infer_attention_score_out_graph(
    update_stream: rt.Stream,
    handle: NPUTaskGroupHandle,
    event: ExternalEvent,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The 4-in-1 fast path: update begin + FIA ``.out`` + update end + event record.

    On hardware it is one C++ call that releases the GIL; the simulator spends its
    modelled host time (with a cost model) after the work, without the GIL, so several
    host threads can update concurrently.
    """
    st = rt.get_state()

    def body() -> tuple[torch.Tensor, torch.Tensor]:
        prev = st.current_stream
        st.current_stream = update_stream
        try:
            graph_task_update_begin(update_stream, handle)
            try:
                res = fia_out(query, key, value, **kwargs)
            except BaseException:
                update_stream._updating = None
                st.update_session = None
                raise
            graph_task_update_end(update_stream)
            event.record(update_stream)
        finally:
            st.current_stream = prev
        return res

    return st.gil_free(body)  # type: ignore[no-any-return]
