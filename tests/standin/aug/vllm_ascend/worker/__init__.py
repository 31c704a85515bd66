"""A stand-in of vllm-ascend for npugraph's tests: its names and signatures, not its code."""
