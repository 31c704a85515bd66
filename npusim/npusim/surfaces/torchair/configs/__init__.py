"""torchair's configuration (``torchair.configs``)."""
