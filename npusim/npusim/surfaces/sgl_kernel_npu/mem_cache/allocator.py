"""``sgl_kernel_npu.mem_cache.allocator``: ``alloc_extend_kernel``, the KV slots of a prefill
batch's new tokens (SGLang's paged allocator on Ascend, for fewer than 200 new pages)."""

from __future__ import annotations

from typing import Any

import torch

from npusim.kernels.cache import alloc_extend
from npusim.surfaces.sgl_kernel_npu.launch import GridKernel

__all__ = ["alloc_extend_kernel"]


def _launch(
    grid: tuple[Any, ...],
    pre_lens_ptr: torch.Tensor,
    seq_lens_ptr: torch.Tensor,
    last_loc_ptr: torch.Tensor,
    free_page_ptr: torch.Tensor,
    out_indices: torch.Tensor,
    bs_upper: int,
    page_size: int,
    max_num_extend_tokens: int,
    BLOCK_SIZE: int = 2048,
) -> None:
    # one program per request: the grid's first dimension is the batch
    alloc_extend(pre_lens_ptr, seq_lens_ptr, last_loc_ptr, free_page_ptr, out_indices, page_size, int(grid[0]))


alloc_extend_kernel = GridKernel("alloc_extend_kernel", _launch)
