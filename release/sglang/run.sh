#!/usr/bin/env bash
# SGLang 0.5.23 as users install and start it, on npugraph's simulator (make sglang-check):
#   1. builds (or reuses) the environment of release/sglang/env.sh ($SGLANG_ENV, default .sglang-env;
#      another release, SGLANG_VERSION=0.5.21 or 0.5.22: release/sglang/versions.sh);
#   2. npugraph's plugin test against SGLang's own classes (tests/test_sglang.py);
#   3. a real generation (release/sglang/generate.py): a Llama and a Qwen3, each in eager mode,
#      SGLang's own NPU graphs and npugraph's plugin, each in its own process (SGLang's engine,
#      its scheduler in its own process), the Llama's graph modes three times, in turn
#      (once at CHECK_SCOPE=ci, as .ci/run runs it);
#      release/sglang/test_generate.py checks identical tokens, Hugging Face's choices, and that
#      npugraph did every update; release/sglang/update_cost.py prints the per-step update cost
#      of the two graph modes, per run, and what the runs support;
#   4. SGLang's server as users start it (python -m sglang.launch_server, the Llama, npugraph's
#      plugin), driven by the openai client (release/sglang/test_server.py): a prompt token id
#      outside the vocabulary is a 400 (the plugin guards an SGLang defect that takes the server
#      down), good requests before and after it are right, a two-minute soak, SIGINT ends the
#      server cleanly; then at --tp-size 2 (not at CHECK_SCOPE=ci).
#   5. three faults through that server (release/sglang/test_faults.py): a host copy inside a
#      layer under capture, a kernel fault at replay, an event record the device loses; each
#      ends the server within seconds (SGLang's own response to a scheduler failure), the
#      scheduler's log naming npugraph's graph, the layer and the op, every streamed token right.
# At CHECK_SCOPE=compat (make compat, every release) it runs 2 and 3, once each, without the update's cost.
# Fails if any of them fails.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(dirname "$(dirname "$HERE")")"
# shellcheck source=release/sglang/versions.sh
source "$HERE/versions.sh"
sglang_release_of "${SGLANG_VERSION:-0.5.23}"  # LOCK, ENV_DIR
"$HERE/env.sh"

PYTHON="$ENV_DIR/venv/bin/python"
RESULTS="$ENV_DIR/results"
rm -rf "$RESULTS" && mkdir -p "$RESULTS"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
status=0
# shellcheck source=release/step.sh
source "$(dirname "$HERE")/step.sh"
GENERATED="$RESULTS"  # its engine runs' results, for engine_test
step "npugraph's plugin against SGLang's classes and hook registry; the simulator's torch stand-ins for its Triton kernels"
(cd "$REPO" && NPUGRAPH_SIM_TORCH_NPU=1 "$PYTHON" -m pytest -q -p no:cacheprovider -o junit_family=xunit1 \
    --junitxml="$RESULTS/plugin/plugin.xml" tests/test_sglang.py tests/sim/test_triton_substitutes_sglang.py) 2>&1 | tee "$STEP_LOG" || failed
step "a real generation with SGLang $("$PYTHON" -c 'import importlib.metadata as m; print(m.version("sglang"))'): eager, SGLang's NPU graphs, npugraph"
"$PYTHON" "$HERE/generate.py" "$RESULTS" 2>&1 | tee "$STEP_LOG" || failed generate.py
engine_test release/sglang/test_generate.py || failed release/sglang/test_generate.py
if compat; then  # make compat: the plugin and the generation only
    step "the update's cost, the server and faults: not at CHECK_SCOPE=compat (make sglang-check's)"
else
    "$PYTHON" "$HERE/update_cost.py" "$RESULTS" 2>&1 | tee -a "$STEP_LOG" || failed update_cost.py
    step "SGLang's server (launch_server) with npugraph's plugin, driven by the openai client"
    engine_test release/sglang/test_server.py || failed
    step "faults through SGLang's server (npugraph's plugin): each ends the server in seconds and says where"
    engine_test release/sglang/test_faults.py || failed
fi
step "done (status $status)"
exit $status
