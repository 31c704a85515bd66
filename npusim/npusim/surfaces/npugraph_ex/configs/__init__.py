"""npugraph_ex's configuration (``npugraph_ex.configs``)."""
