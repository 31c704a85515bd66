#!/usr/bin/env bash
# SGLang 0.5.23 as users install and start it, on npugraph's simulator (make sglang-check):
#   1. builds (or reuses) the environment of release/sglang/env.sh ($SGLANG_ENV, default .sglang-env);
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
# Fails if any of them fails.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(dirname "$(dirname "$HERE")")"
ENV_DIR="${SGLANG_ENV:-$REPO/.sglang-env}"
"$HERE/env.sh"

PYTHON="$ENV_DIR/venv/bin/python"
RESULTS="$ENV_DIR/results"
rm -rf "$RESULTS" && mkdir -p "$RESULTS"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
status=0
# shellcheck source=release/step.sh
source "$(dirname "$HERE")/step.sh"
step "npugraph's plugin against SGLang's classes and hook registry"
(cd "$REPO" && NPUGRAPH_SIM_TORCH_NPU=1 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_sglang.py) 2>&1 | tee "$STEP_LOG" || failed
step "a real generation with SGLang $("$PYTHON" -c 'import importlib.metadata as m; print(m.version("sglang"))'): eager, SGLang's NPU graphs, npugraph"
"$PYTHON" "$HERE/generate.py" "$RESULTS" 2>&1 | tee "$STEP_LOG" || failed generate.py
(cd "$REPO" && NPUGRAPH_GENERATE_RESULTS="$RESULTS" "$PYTHON" -m pytest -q -p no:cacheprovider release/sglang/test_generate.py) 2>&1 | tee "$STEP_LOG" \
    || failed release/sglang/test_generate.py
"$PYTHON" "$HERE/update_cost.py" "$RESULTS" 2>&1 | tee -a "$STEP_LOG" || failed update_cost.py
step "SGLang's server (launch_server) with npugraph's plugin, driven by the openai client"
(cd "$REPO" && NPUGRAPH_GENERATE_RESULTS="$RESULTS" "$PYTHON" -m pytest -q -p no:cacheprovider release/sglang/test_server.py) 2>&1 | tee "$STEP_LOG" \
    || failed
step "faults through SGLang's server (npugraph's plugin): each ends the server in seconds and says where"
(cd "$REPO" && NPUGRAPH_GENERATE_RESULTS="$RESULTS" "$PYTHON" -m pytest -q -p no:cacheprovider release/sglang/test_faults.py) 2>&1 | tee "$STEP_LOG" \
    || failed
step "done (status $status)"
exit $status
