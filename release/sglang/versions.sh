# Sourced by release/sglang/env.sh, run.sh and release/compat.sh: the SGLang releases the checks
# know.  sglang_release_of VERSION (SGLANG_VERSION; 0.5.23 by default) sets, for that release:
#   LOCK     its environment's spec and lock, envs/$LOCK.toml and envs/$LOCK.lock
#   ENV_DIR  where its environment is built ($SGLANG_ENV, or .sglang-env[-VERSION])
# or stops in one line naming the releases it knows.  Adding one: its version here, its spec
# envs/sglang-VERSION.toml (extending envs/sglang.toml) and its lock.
SGLANG_RELEASES="0.5.21 0.5.22 0.5.23"
sglang_release_of() {
    local repo
    repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
    case " $SGLANG_RELEASES " in
        *" $1 "*) ;;
        *)
            echo "SGLang check: SGLANG_VERSION=$1 is not a release it knows: use one of $SGLANG_RELEASES" >&2
            exit 1
            ;;
    esac
    if [ "$1" = 0.5.23 ]; then
        LOCK=sglang ENV_DIR="${SGLANG_ENV:-$repo/.sglang-env}"
    else
        LOCK="sglang-$1" ENV_DIR="${SGLANG_ENV:-$repo/.sglang-env-$1}"
    fi
}
