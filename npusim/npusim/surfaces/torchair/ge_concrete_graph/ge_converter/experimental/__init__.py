"""torchair's experimental GE converters: not simulated."""
