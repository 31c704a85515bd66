"""npugraph_ex's pattern fusion (``npugraph_ex.patterns``)."""
