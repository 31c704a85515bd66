#!/usr/bin/env bash
# Builds, from nothing, the environment SGLang-on-Ascend users install, on npugraph's simulator:
#   SGLang 0.5.23 (or the release SGLANG_VERSION names: release/sglang/versions.sh) and its
#   requirements less the CUDA ones (flashinfer, cuda-python, sglang-kernel, ...)
#   torch 2.14.1 + torchvision 0.29.1 (SGLang's pin; from this machine's disk, as release/env.sh)
#   npugraph (editable, from this checkout) as torch_npu: NPUGRAPH_SIM_TORCH_NPU=1, which also
#   gives torchair and sgl_kernel_npu (npusim/npusim/surfaces), the Ascend stack's names no index has
# into $SGLANG_ENV (default .sglang-env, git-ignored), its interpreter at $SGLANG_ENV/venv/bin/python,
# and caches it there: a second run with the same lock does nothing but check it.  No file of
# SGLang enters this repository.  Every distribution comes from envs/sglang.lock (one uv
# resolution of envs/sglang.toml, at exact versions with hashes; `make lock` refreshes it).
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=release/sglang/versions.sh
source "$HERE/versions.sh"
sglang_release_of "${SGLANG_VERSION:-0.5.23}"  # LOCK, ENV_DIR
export PY="${PY:-python3}"
ENV_REVISION=3  # bump when what this script adds to the lock changes: a cached environment is rebuilt

# shellcheck source=/dev/null
source "$(dirname "$HERE")/env_common.sh"
STAMP="$ENV_DIR/$(env_stamp "$LOCK" "$ENV_REVISION")"
reuse_or_start "$STAMP" "$ENV_DIR" "$LOCK"
BIN="$ENV_DIR/venv/bin"

# npugraph, as torch_npu in every process of the environment
SITE="$(sync_env "$LOCK" "$ENV_DIR")"
# release/sglang/site.py from this checkout at every interpreter start (it acts only when
# generate.py asks, in SGLang's scheduler process): an edit needs no rebuild
echo "import runpy; runpy.run_path('$HERE/site.py')" >"$SITE/sglang_site.pth"
NPUGRAPH_SIM_TORCH_NPU=1 "$BIN/python" -c "from npusim.device import backend; backend.build()"

check_env "$LOCK" "$ENV_DIR"
touch "$STAMP"
