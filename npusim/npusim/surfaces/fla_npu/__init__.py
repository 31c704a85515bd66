"""``fla_npu``: flash-linear-attention-npu, the Ascend C kernels of linear attention (gated
delta rule, KDA, causal conv1d) that vllm-ascend 0.30 imports at start-up for its GDN, KDA and
GLM-5-next layers.  It ships as a wheel on the project's GitHub releases (vllm-ascend's
Dockerfile installs it), on no package index.  Here its names import, and each refuses when
called: no model the simulator serves has such a layer."""
