"""``torch_npu.contrib``: torch_npu's contributed helpers (only ``transfer_to_npu`` here; it
is imported on demand, since importing it patches torch for the whole process)."""
