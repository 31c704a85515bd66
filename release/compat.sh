#!/usr/bin/env bash
# make compat: every release users can install, each in its own environment from its lock:
# the vllm-ascend releases (release/versions.sh's RELEASES, or those RELEASES= names) held to what
# release/run.sh checks at CHECK_SCOPE=compat (its own tests of the graph path from its sdist,
# npugraph's plugin test against it, the Llama and the Qwen3 generated in eager, vllm-ascend's
# graphs and npugraph's, tokens identical and Hugging Face's, vLLM's default mode and the v2
# runner, no traceback), then SGLang's (release/sglang/versions.sh's, or SGLANG_RELEASES=) to
# what release/sglang/run.sh checks there (the plugin test, the Llama and the Qwen3 in its three
# modes).  Each release's record goes into COMPAT_JSON (default compat.json; the committed one
# is docs/compat.json) and `release/compat.py table` makes the README's matrix from it.  Goes
# on past a failing release; fails if any failed.
set -uo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
# make compat RELEASES="0.27.1rc1" SGLANG_RELEASES=none: those; by default every one
WANTED="${RELEASES:-}" WANTED_SGLANG="${SGLANG_RELEASES:-}"
# shellcheck source=release/versions.sh
source "$HERE/versions.sh"
# shellcheck source=release/sglang/versions.sh
source "$HERE/sglang/versions.sh"
WANTED="${WANTED:-$RELEASES}" WANTED_SGLANG="${WANTED_SGLANG:-$SGLANG_RELEASES}"
[ "$WANTED" = none ] && WANTED=""
[ "$WANTED_SGLANG" = none ] && WANTED_SGLANG=""
OUT="$(realpath -m "${COMPAT_JSON:-compat.json}")"
# each release builds and keeps its own environment (.release-env-VERSION, .sglang-env-VERSION);
# one release alone may be pointed at another folder (RELEASE_ENV, SGLANG_ENV: make lock's trial)
[ "$(wc -w <<<"$WANTED")" -gt 1 ] && unset RELEASE_ENV
[ "$(wc -w <<<"$WANTED_SGLANG")" -gt 1 ] && unset SGLANG_ENV
status=0
checked() {  # ENGINE VERSION [VLLM_VERSION]: run the release's check at CHECK_SCOPE=compat, record it
    local engine="$1" version="$2" began=$SECONDS rc times
    times="$(mktemp)"
    if [ "$engine" = vllm ]; then
        VLLM_ASCEND_VERSION="$version" CHECK_SCOPE=compat CHECK_TIMES="$times" "$HERE/run.sh"
    else
        SGLANG_VERSION="$version" CHECK_SCOPE=compat CHECK_TIMES="$times" "$HERE/sglang/run.sh"
    fi
    rc=$?
    [ $rc -eq 0 ] || status=1
    python3 "$HERE/compat.py" record "$OUT" "$engine" "$version" "${@:3}" "$ENV_DIR/results" "$rc" \
        "$((SECONDS - began))" "$times" || status=1
    rm -f "$times"
}
for version in $WANTED; do
    release_of "$version"  # VLLM_VERSION, ENV_DIR; stops in one line for a release it does not know
    checked vllm "$version" "$VLLM_VERSION"
done
for version in $WANTED_SGLANG; do
    sglang_release_of "$version"  # ENV_DIR
    checked sglang "$version"
done
python3 "$HERE/compat.py" table "$OUT"
exit $status
