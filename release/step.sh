# Sourced by release/run.sh and release/sglang/run.sh (their $HERE names the check).
# step TITLE: the step's title with the minutes and seconds since the check began, so that
# CI's log shows where the time went; and into $CHECK_TIMES, where .ci/run collects every
# step's time for the end of its log.
step() {
    printf '== [%d:%02d] %s\n' $((SECONDS / 60)) $((SECONDS % 60)) "$*"
    if [ -n "${CHECK_TIMES:-}" ]; then
        local title="$*"
        printf '  %s check [%d:%02d] %s\n' "$(basename "$HERE")" $((SECONDS / 60)) $((SECONDS % 60)) "${title:0:70}" \
            >>"$CHECK_TIMES"
    fi
}
