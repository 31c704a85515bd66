#!/usr/bin/env bash
# vLLM-on-Ascend as users install it, on npugraph's simulator (make release-check), for the
# release VLLM_ASCEND_VERSION names (0.23.0.post1 by default, or 0.30.0rc2: release/versions.sh):
#   1. builds (or reuses and checks) the environment of release/env.sh, from that release's lock
#      in envs/, and (0.23.0.post1) shows that its self-check stops a broken one in one line
#      (release/test_env_check.py);
#   2. runs that release's own tests from its sdist (0.23.0.post1's NPU tests; 0.30.0rc2's
#      attention, graph and MRV2 graph tests and its kernels' precision tests), with only its
#      tests/ut/conftest.py replaced by release/conftest_ut.py (no torch_npu mock: the
#      simulator is torch_npu), its unit-test files in one pytest, and prints collected / passed /
#      failed per file;
#   3. runs npugraph's plugin test against the release (every name it replaces is found);
#   4. a real generation (release/generate.py) as users start one (vLLM's default engine,
#      vllm-ascend's default configuration), on a Llama, a Qwen3, a Llama with n-gram
#      speculative decoding, the Llama at tensor parallel 2, and DeepSeek's MLA (alone, with
#      n-gram speculative decoding, at tensor parallel 2, and a DeepSeek-V3 with MTP, one and two
#      draft tokens; at CHECK_SCOPE=ci, as .ci/run runs it, no Qwen3, and MLA alone and with
#      MTP's one draft token only: release/generate.py's CI_MODELS; and where the release
#      ships vllm-ascend's UpdatableGraph, 0.30.0rc2, the 32-layer side-by-side, once per graph
#      mode, without eager; the full scope runs it five times per graph mode, and slowed): eager,
#      vllm-ascend's ACL graph mode and npugraph's plugin, each in its own process;
#      release/test_generate.py checks that every run's tokens are identical and Hugging
#      Face's, and that npugraph did every update; release/update_cost.py prints the
#      per-step update cost of the two graph modes, per run, and what the runs support;
#   5. three faults in a real engine (release/test_faults.py): a host copy inside a layer
#      under capture, a kernel fault at replay (also under vLLM's model runner v2 where npugraph
#      serves it: 0.30.0rc2), an event record the device loses (at CHECK_SCOPE=ci on
#      0.23.0.post1 only);
#   6. graph memory and the KV-cache budget, side by side (release/test_graph_memory.py; not at
#      CHECK_SCOPE=ci): on
#      MLA with DeepSeek-V3's heads and context, vllm-ascend's own graph mode runs out of
#      device memory at capture, and so does npugraph's with that KV cache; npugraph's plugin
#      as a user starts it counts its graphs in the budget and serves;
#   7. vLLM's default compilation config (no compilation_config: FULL_AND_PIECEWISE) on the
#      Llama, with and without npugraph's plugin (release/test_default_mode.py); vLLM's model
#      runner v2 with vllm-ascend's graphs and with npugraph's (release/test_runner_v2.py: from 0.30);
#      npugraph's update-free graphs on the Llama and the Qwen3 (release/test_update_free.py);
#   8. vLLM's Ray executor (release/test_ray.py; where the release's lock has Ray: 0.30.0rc2): a
#      two-node Ray cluster on this machine, the Llama at tensor parallel 2 (and pipeline
#      parallel 2, not at CHECK_SCOPE=ci), eager and with the plugin: eager's tokens, npugraph's
#      INFO line in each rank's Ray worker log, each rank on its own node;
#   9. `vllm serve` with the plugin, driven by the openai client (release/test_server.py): eight
#      completions at once, Hugging Face's choices, then one at a time, the same texts as the
#      release's eager server and its own graph mode's (at CHECK_SCOPE=ci: eager's, on 0.30.0rc2);
#      bad requests each get a 400 and the server serves on, right; 200 concurrent
#      connections; a client walking away mid-stream; the soak's two minutes; SIGINT.
# At CHECK_SCOPE=compat (make compat: release/compat.sh, every release) it runs 2, 3, 4 on the
# Llama and the Qwen3 without the update's cost, and 7.
# Fails if any of them fails.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(dirname "$HERE")"
export VLLM_ASCEND_VERSION="${VLLM_ASCEND_VERSION:-0.23.0.post1}"
# shellcheck source=release/versions.sh
source "$HERE/versions.sh"
release_of "$VLLM_ASCEND_VERSION"  # VLLM_VERSION, LOCK, ENV_DIR
"$HERE/env.sh"

SRC="$ENV_DIR/src/vllm_ascend-$VLLM_ASCEND_VERSION"
PYTHON="$ENV_DIR/venv/bin/python"
RESULTS="$ENV_DIR/results"
rm -rf "$RESULTS" && mkdir -p "$RESULTS"
export NPUGRAPH_SIM_TORCH_NPU=1 HF_HUB_OFFLINE=1 HF_HUB_CACHE="$ENV_DIR/hub" TRANSFORMERS_OFFLINE=1
# vLLM's model-inspection cache, one for every engine of this check, as a user's ~/.cache/vllm
# keeps it between starts (release/runs.py's share_model_info); the check's first engines
# compute it from nothing.  Their compile caches stay each check's own, as they were.
export NPUGRAPH_CHECK_MODELINFOS="$RESULTS/modelinfos"

status=0
# shellcheck source=release/step.sh
source "$HERE/step.sh"
if [ "$VLLM_ASCEND_VERSION" = 0.23.0.post1 ] && ! compat; then  # the case was this release's (transformers 5.5.4)
    step "the environment's self-check stops a broken environment in one line (the kernels case)"
    (cd "$REPO" && "$PYTHON" -m pytest -q -p no:cacheprovider release/test_env_check.py) 2>&1 | tee "$STEP_LOG" || failed
fi

cp "$HERE/conftest_ut.py" "$SRC/tests/ut/conftest.py"
# Its tests of the graph path: whichever of these its sdist has.  Up to 0.26 its NPU tests (a2/:
# an Atlas A2 card); from 0.27 one flat tests/ut (every file runs on a CPU runner with torch_npu
# mocked), and the precision tests of its kernels in its end-to-end tests (one card), each file
# arriving in the release that added it.
FILES=()
for f in \
    tests/ut/attention/a2/test_attention_v1_precision.py \
    tests/ut/attention/a2/test_attention_v1.py \
    tests/ut/compilation/a2/test_acl_graph.py \
    tests/e2e/pull_request/one_card/test_attention_v1_precision.py \
    tests/e2e/pull_request/one_card/test_mla_precision.py \
    tests/ut/attention/test_attention_v1.py \
    tests/ut/attention/test_mla_v1.py \
    tests/ut/attention/test_fia_non_pa_inputs.py \
    tests/ut/attention/test_gqa_dcp_split.py \
    tests/ut/compilation/test_acl_graph.py \
    tests/ut/worker/v2/test_aclgraph.py \
    tests/ut/spec_decode/test_eagle_aclgraph_source_regression.py; do
    [ -f "$SRC/$f" ] && FILES+=("$f")
done
if [ ${#FILES[@]} -eq 0 ]; then
    echo "release check: vllm-ascend $VLLM_ASCEND_VERSION's sdist has none of the graph-path tests this check knows (release/run.sh): its tests moved" >&2
    exit 1
fi
# what a file runs less, where this machine cannot hold it (pytest -k), and why
declare -A DESELECT=(
    # 8 requests of 4,096 context tokens at DeepSeek-V2's 128 heads: its context's up-projected
    # keys and values take more device memory than the simulated card (half this host's 23 GB)
    [tests/e2e/pull_request/one_card/test_mla_precision.py]="not large_prefill"
)
if [ "${CHECK_SCOPE:-full}" != full ]; then
    # CI's time: each MLA case takes about 35 s here (a DeepSeek-V2 config of 128 heads built
    # each time); a decode, a mixed batch and MTP's speculative decode stand for the ten
    DESELECT[tests/e2e/pull_request/one_card/test_mla_precision.py]="small_decode or mixed_small or mtp_1_plus_3"
fi
# The unit-test files run together, in one pytest: each alone spent about 27 s importing vLLM
# for a second or two of tests (2026-12-05); a file that fails to collect still leaves the
# others run.  The rest (the precision tests, under tests/e2e's own conftest) run one by one.
# JUnit's xunit1 family names each case's file: release/table.py counts them per file.
# Two streams side by side: the last of those files (0.30's MLA precision cases, about three
# minutes of the tests' own bfloat16 weights drawn and multiplied, mostly in one thread), and
# the others in turn.  One pytest kept this two-core machine about 60% busy (2026-12-06).
UNIT=()
ALONE=()
for f in "${FILES[@]}"; do
    if [[ "$f" == tests/ut/* && -z "${DESELECT[$f]:-}" ]]; then UNIT+=("$f"); else ALONE+=("$f"); fi
done
run_files() {  # NAME [-k EXPR] FILE...: one pytest, its log and JUnit XML into $RESULTS/NAME.*; fails as it fails
    local name="$1" began=$SECONDS rc=0
    shift
    (cd "$SRC" && "$PYTHON" -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning \
        --continue-on-collection-errors -o junit_family=xunit1 --junitxml="$RESULTS/$name.xml" "$@" \
        >"$RESULTS/$name.log" 2>&1) || rc=1
    echo "    $name: $(tail -n 1 "$RESULTS/$name.log") ($((SECONDS - began)) s)"
    return $rc
}
run_file() {  # FILE: one of the release's own test files alone, with what DESELECT leaves out of it
    local only=()
    [ -n "${DESELECT[$1]:-}" ] && only=(-k "${DESELECT[$1]}")
    run_files "$(basename "$1" .py)" "${only[@]}" "$1"
}
BESIDE=()
if [ ${#ALONE[@]} -gt 0 ] && [ $((${#UNIT[@]} + ${#ALONE[@]})) -gt 1 ]; then
    BESIDE=("${ALONE[-1]}")
    unset 'ALONE[-1]'
fi
described=()
[ ${#UNIT[@]} -gt 0 ] && described+=("its unit tests together (${UNIT[*]})")
for f in "${ALONE[@]}" "${BESIDE[@]}"; do described+=("$f${DESELECT[$f]:+ (-k '${DESELECT[$f]}')}"); done
step "vllm-ascend's own tests${BESIDE[*]:+, ${BESIDE[*]} beside the others}: ${described[*]}"
if [ ${#BESIDE[@]} -gt 0 ]; then
    run_file "${BESIDE[0]}" &
    beside=$!
fi
if [ ${#UNIT[@]} -gt 0 ]; then
    run_files unit-tests "${UNIT[@]}" || failed "the unit tests" "$RESULTS/unit-tests.log"
fi
for f in "${ALONE[@]}"; do
    run_file "$f" || failed "$f" "$RESULTS/$(basename "$f" .py).log"
done
if [ ${#BESIDE[@]} -gt 0 ]; then
    wait "$beside" || failed "${BESIDE[0]}" "$RESULTS/$(basename "${BESIDE[0]}" .py).log"
fi
"$PYTHON" "$HERE/table.py" "$RESULTS" "${FILES[@]}" | tee "$RESULTS/table.md"

step "npugraph's plugin against vllm-ascend $(basename "$SRC")"
(cd "$REPO" && NPUGRAPH_REQUIRE_VLLM_ASCEND=1 NPUGRAPH_VLLM_ASCEND_SRC="$SRC" "$PYTHON" -m pytest -q \
    -p no:cacheprovider -o junit_family=xunit1 --junitxml="$RESULTS/plugin/plugin.xml" tests/test_vllm_ascend.py \
    -k real_vllm_ascend) 2>&1 | tee "$STEP_LOG" || failed
if ! compat; then  # the simulator's Triton, checked on the releases CI runs
    step "triton-ascend's language extension in Triton's interpreter (vllm-ascend's fused kernels use it); the simulator's torch substitutes for this release's Triton kernels against the interpreter"
    (cd "$REPO" && "$PYTHON" -m pytest -q -p no:cacheprovider tests/sim/test_triton_ascend.py \
        tests/sim/test_triton_substitutes.py) 2>&1 | tee "$STEP_LOG" || failed
    step "vllm-ascend's own test of its fused q/k-norm + rope Triton kernel (its nightly's; 1 and 16 tokens)"
    OPS="$RESULTS/ops"
    mkdir -p "$OPS"
    cp "$SRC/tests/e2e/nightly/single_node/ops/singlecard_ops/triton/test_split_qkv_rmsnorm_rope.py" "$OPS/"
    cp "$HERE/conftest_ops.py" "$OPS/conftest.py"
    # 1,024 and 10,240 tokens left out: Triton's interpreter runs them for hours
    (cd "$OPS" && "$PYTHON" -m pytest -q -p no:cacheprovider test_split_qkv_rmsnorm_rope.py -k "not 1024") 2>&1 | tee "$STEP_LOG" || failed
fi

step "a real generation on vllm-ascend's platform: eager, ACL graph, npugraph"
GENERATED="$RESULTS/generate"
mkdir -p "$GENERATED"
# each model and mode once (a fresh engine of two to three minutes on the simulator): the
# update cost's noise between runs is wider than within one, and its verdict takes both the
# Llama's and the n-gram Llama's run (release/update_cost.py)
"$PYTHON" "$HERE/generate.py" "$GENERATED" 2>&1 | tee "$STEP_LOG" || failed generate.py
engine_test release/test_generate.py || failed release/test_generate.py
if compat; then  # its verdict takes the n-gram Llama's run, which make compat does not make
    step "the update's cost: not at CHECK_SCOPE=compat"
else
    "$PYTHON" "$HERE/update_cost.py" "$GENERATED" 2>&1 | tee -a "$STEP_LOG" || failed update_cost.py
fi

if compat; then
    step "faults and graph memory in a real engine: not at CHECK_SCOPE=compat (make release-check's)"
elif [ "${CHECK_SCOPE:-full}" = ci ] && [ "$VLLM_ASCEND_VERSION" != 0.23.0.post1 ]; then
    # the faults are npugraph's and the simulator's behaviour in an engine: CI checks them on the
    # first release, inside its time limit; make release-check checks them on both
    step "faults in a real engine: on 0.23.0.post1 only at CHECK_SCOPE=ci"
else
    step "faults in a real engine (npugraph's plugin): each ends the engine cleanly and says where"
    engine_test release/test_faults.py || failed
fi

if ! compat; then
    step "graph memory and the KV-cache budget: vllm-ascend's own graph mode, npugraph's, side by side"
    engine_test release/test_graph_memory.py || failed
fi

step "vLLM's default compilation config (FULL_AND_PIECEWISE), without and with npugraph's plugin"
engine_test release/test_default_mode.py || failed

step "vLLM's model runner v2 (VLLM_USE_V2_MODEL_RUNNER=1), vllm-ascend's graphs and npugraph's (0.30.0rc2 on)"
engine_test release/test_runner_v2.py || failed

step "npugraph's update-free graphs (NPUGRAPH_UPDATE_FREE=1): the Llama and the Qwen3 against eager and Hugging Face"
engine_test release/test_update_free.py || failed

if compat; then
    step "vLLM's Ray executor and vllm serve: not at CHECK_SCOPE=compat (make release-check's)"
else
    step "vLLM's Ray executor on a two-node Ray cluster: tensor parallel 2 (and pipeline parallel 2 but at CHECK_SCOPE=ci), eager and npugraph"
    engine_test release/test_ray.py || failed

    step "vllm serve with npugraph's plugin, driven by the openai client: eager's and vllm-ascend's texts, bad requests, a burst, a soak, SIGINT"
    engine_test release/test_server.py || failed
fi
step "done (status $status)"
exit $status
