"""The device: the ``npu`` torch device the simulator runs on.

PrivateUse1 renamed ``npu``, a small C++ backend (``csrc/npu_device.cpp``) whose memory is
host memory behind real pointers: its allocator and live/peak byte counters, pinned
memory, the device guard, and the fallback that runs every aten op's CPU kernel on the
same bytes (:mod:`.backend` builds, loads and wires it into torch).  It knows tensors and
bytes only: nothing of streams, graphs, kernels or torch_npu's names, and it imports
nothing else of the simulator.
"""
