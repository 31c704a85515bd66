# Sourced by release/run.sh and release/sglang/run.sh (their $HERE names the check).
# step TITLE: the step's title with the minutes and seconds since the check began, so that
# CI's log shows where the time went; and into $CHECK_TIMES, where .ci/run collects every
# step's time for the end of its log.  The step's commands tee their output into $STEP_LOG.
# failed [WHAT [LOG]]: the check fails (status=1); which step and part failed, and the first
# lines of the failure's own words from LOG (default $STEP_LOG: pytest's FAILED and ERROR
# summary lines, an exception's last line), go into the same list.  CI shows only its log's
# tail and that list, and a failure in the middle of a long check was otherwise out of sight
# (stop 73's CI ended the 0.30.0rc2 check "done (status 1)" with every visible step passed).
# engine_test FILE: one of npugraph's checks of the engine runs in $GENERATED, run from the
# checkout ($REPO) in the check's interpreter ($PYTHON), its output into the step's log.
# compat: whether this is make compat's scope (CHECK_SCOPE=compat: what every release is held to).
STEP_LOG="${RESULTS:-$(mktemp -d)}/step.log"  # the current step's output, beside its results
step() {
    STEP_TITLE="$*"
    : >"$STEP_LOG"
    printf '== [%d:%02d] %s\n' $((SECONDS / 60)) $((SECONDS % 60)) "$*"
    if [ -n "${CHECK_TIMES:-}" ]; then
        printf '  %s check [%d:%02d] %s\n' "$(basename "$HERE")" $((SECONDS / 60)) $((SECONDS % 60)) "${STEP_TITLE:0:70}" \
            >>"$CHECK_TIMES"
    fi
}
failed() {
    status=1
    local lines
    lines="$(printf '  %s check [%d:%02d] FAILED: %s%s' "$(basename "$HERE")" $((SECONDS / 60)) $((SECONDS % 60)) \
        "${1:+$1, in }" "${STEP_TITLE:0:70}")"
    local log="${2:-$STEP_LOG}" why
    if [ -f "$log" ]; then
        why="$(grep -E '^(FAILED|ERROR) |^[A-Za-z_.]*(Error|Exception|Exit)[A-Za-z]*: ' "$log" | head -n 8 | cut -c1-300 |
            sed 's/^/      /')" || true
        [ -n "$why" ] && lines="$lines"$'\n'"$why"
    fi
    echo "$lines"
    if [ -n "${CHECK_TIMES:-}" ]; then echo "$lines" >>"$CHECK_TIMES"; fi
}
engine_test() {
    (cd "$REPO" && NPUGRAPH_GENERATE_RESULTS="$GENERATED" "$PYTHON" -m pytest -q -p no:cacheprovider "$1") 2>&1 \
        | tee "$STEP_LOG"
}
compat() { [ "${CHECK_SCOPE:-full}" = compat ]; }
