"""torchair's GE converters: not simulated."""
