"""torchair's HCOM all-reduce patch (importing it lets ``dist.all_reduce`` enter a GE graph as
an HCOM op).  On the simulator no graph is converted to GE, so there is nothing to patch:
collectives run through the ``hccl`` process group as they are."""
