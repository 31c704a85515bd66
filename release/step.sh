# Sourced by release/run.sh and release/sglang/run.sh (their $HERE names the check).
# step TITLE: the step's title with the minutes and seconds since the check began, so that
# CI's log shows where the time went; and into $CHECK_TIMES, where .ci/run collects every
# step's time for the end of its log.
# failed [WHAT]: the check fails (status=1), and which step and part failed goes into the same
# list: CI shows only its log's tail, and a failure in the middle of a long check was otherwise
# out of sight (stop 73's CI ended "done (status 1)" with every visible step passed).
step() {
    STEP_TITLE="$*"
    printf '== [%d:%02d] %s\n' $((SECONDS / 60)) $((SECONDS % 60)) "$*"
    if [ -n "${CHECK_TIMES:-}" ]; then
        printf '  %s check [%d:%02d] %s\n' "$(basename "$HERE")" $((SECONDS / 60)) $((SECONDS % 60)) "${STEP_TITLE:0:70}" \
            >>"$CHECK_TIMES"
    fi
}
failed() {
    status=1
    local line
    line="$(printf '  %s check [%d:%02d] FAILED: %s%s' "$(basename "$HERE")" $((SECONDS / 60)) $((SECONDS % 60)) \
        "${1:+$1, in }" "${STEP_TITLE:0:70}")"
    echo "$line"
    if [ -n "${CHECK_TIMES:-}" ]; then echo "$line" >>"$CHECK_TIMES"; fi
}
