"""The runtime: CANN's rules for work on the device, the part of the simulator that is a contract.

Streams, events and ``ExternalEvent`` and the scheduler that runs their work
(:mod:`.state`), device memory as pools, blocks and non-owning aliases (:mod:`.memory`),
stream-ordered eager aten work (:mod:`.eager`, :mod:`.aten`), capture by recording
(:mod:`.capture`) into graphs of nodes (:mod:`.nodes`, :mod:`.graph`), task groups and task
updates with one updater at a time (:mod:`.taskgroups`), and how any op is issued in
whichever mode its stream is in (:mod:`.launch`).  Where hardware hangs or corrupts
silently it raises (:mod:`npusim.errors`).  It knows no kernel's math, no argument
names of any op and no outside project's names: kernels describe themselves to it through
:class:`.launch.SimOp`.  It imports the device, never kernels or surfaces.
"""
