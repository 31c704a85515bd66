"""torchair's GE conversion (``torchair.ge_concrete_graph``): not simulated; only the module
paths importers touch exist."""
