#!/usr/bin/env bash
# Builds, from nothing, the environment SGLang-on-Ascend users install, on npugraph's simulator:
#   SGLang 0.5.23 (its wheel from the package index, without its dependencies)
#   its requirements less the CUDA ones (flashinfer, cuda-python, nvidia-*, sglang-kernel, ...)
#   torch 2.14.1 + torchvision 0.29.1 (SGLang's pin; from this machine's disk, as release/env.sh)
#   npugraph (editable, from this checkout) as torch_npu: NPUGRAPH_SIM_TORCH_NPU=1, which also
#   gives torchair and sgl_kernel_npu (npugraph/sim/surfaces), the Ascend stack's names no index has
# into $SGLANG_ENV (default .sglang-env, git-ignored), its interpreter at $SGLANG_ENV/venv/bin/python,
# and caches it there: a second run with the same versions does nothing.  No file of SGLang
# enters this repository.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(dirname "$(dirname "$HERE")")"
ENV_DIR="${SGLANG_ENV:-$REPO/.sglang-env}"
PY="${PY:-python3}"

SGLANG_VERSION=0.5.23
TORCH_VERSION=2.14.1
TORCHVISION_VERSION=0.29.1
ENV_REVISION=1  # bump when what this script installs changes: a cached environment is rebuilt

STAMP="$ENV_DIR/.built-$SGLANG_VERSION-$TORCH_VERSION-r$ENV_REVISION"
# shellcheck source=/dev/null
source "$(dirname "$HERE")/env_common.sh"
reuse_or_start "$STAMP" "$ENV_DIR" sglang
BIN="$ENV_DIR/venv/bin"

fresh_venv "$ENV_DIR" "$TORCH_VERSION" "$TORCHVISION_VERSION"

# SGLang: the wheel without its dependencies, then its requirements but the CUDA ones and torch's family
quiet "$BIN/pip" download -q --no-deps "sglang==$SGLANG_VERSION" -d "$ENV_DIR/dl"
WHEEL="$(ls "$ENV_DIR"/dl/sglang-"$SGLANG_VERSION"-*.whl)"
# what only a CUDA (or ROCm) machine can install or use; torch's family is pinned apart
CUDA="cuda-python|flash-attn-4|flashinfer[-_]python|humming-kernels|nvidia-[\w-]+|nvshmem4py-cu13|quack-kernels"
CUDA+="|sgl-deep-ep|sgl-deep-gemm|sgl-flash-mla|sglang-kernel|tilelang|apache-tvm-ffi|torch_memory_saver|kernels"
CUDA+="|torch|torchvision|torchaudio|torchcodec|av|decord2|deepseek-recipe|tml-renderers|smg-grpc-servicer|py-spy|numba"
wheel_requirements "$BIN/python" "$WHEEL" "$CUDA" >"$ENV_DIR/sglang-requirements.txt"
quiet "$BIN/pip" install -q --no-deps "$WHEEL"
quiet "$BIN/pip" install -q -r "$ENV_DIR/sglang-requirements.txt" pytest hypothesis "torch==$TORCH_VERSION" \
    "torchvision==$TORCHVISION_VERSION"

# npugraph, as torch_npu in every process of the environment
quiet "$BIN/pip" install -q -e "$REPO"
SITE="$("$BIN/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cp "$REPO/npugraph-sim.pth" "$SITE/"
# release/sglang/site.py from this checkout at every interpreter start (it acts only when
# generate.py asks, in SGLang's scheduler process): an edit needs no rebuild
echo "import runpy; runpy.run_path('$HERE/site.py')" >"$SITE/sglang_site.pth"
NPUGRAPH_SIM_TORCH_NPU=1 "$BIN/python" -c "from npugraph.sim.device import backend; backend.build()"

NPUGRAPH_SIM_TORCH_NPU=1 "$BIN/python" -c "
import torch, torch_npu, sglang, transformers
print('sglang env:', 'torch', torch.__version__, '| sglang', sglang.__version__, '| transformers', transformers.__version__,
      '| torch_npu =', torch_npu.__name__)
" 2>&1 | grep "sglang env:"
touch "$STAMP"
