# Sourced by release/env.sh and release/sglang/env.sh: an environment is its lock
# (envs/NAME.lock, installed by envs/envs.py with uv), then what the script adds on top.

ENVS="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/envs/envs.py"

# The stamp of environment $1: its lock's digest (a new lock rebuilds it) and the script's revision $2
env_stamp() {
    echo ".built-$(sha256sum "${NPUGRAPH_LOCKS:-$(dirname "$ENVS")}/$1.lock" | cut -c1-16)-r$2"
}

# The environment $2 (named $3) was built as the stamp file $1 says: check it (uv's consistency
# check and the imports its tests use; one line and a stop if broken) and stop here, successfully.
# Otherwise start it afresh (a stale one is removed).
reuse_or_start() {
    if [[ -f "$1" ]]; then
        echo "$3 env: $2 (cached)"
        "${PY:-python3}" "$ENVS" check "$3" "$2/venv" || exit 1
        exit 0
    fi
    rm -rf "$2"
    mkdir -p "$2/dl"
}

# The lock of environment $1 into the virtual environment $2/venv, npugraph and npusim editable from
# this checkout, and npusim.pth beside them (an editable install does not carry it); prints site-packages
sync_env() {
    "${PY:-python3}" "$ENVS" sync "$1" "$2/venv" >&2 || exit 1
    local site
    site="$("$2/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    cp "$(dirname "$(dirname "$ENVS")")/npusim/npusim.pth" "$site/"
    echo "$site"
}

# The checks of environment $1 ($2): one line naming the package at fault, and a stop, if broken
check_env() {
    "${PY:-python3}" "$ENVS" check "$1" "$2/venv" || exit 1
}
