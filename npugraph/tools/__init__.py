"""The command line's tools that run models on the runtime: the demo (:mod:`.demo`), the
self-test and its cost calibration (:mod:`.selftest`), and the kernel-choice measurement
(:mod:`.measure`).  ``npugraph/cli.py`` parses the command and calls them; the benchmark has
its own room (:mod:`npugraph.bench`)."""
