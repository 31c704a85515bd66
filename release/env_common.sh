# Sourced by release/env.sh and release/sglang/env.sh.
# pip without its known noise (this disk's index warnings; the pins we override on purpose);
# the status is pip's: a failed install stops the build (set -o pipefail)
quiet() {
    "$@" 2>&1 | { grep -v -e "^WARNING: Location" -e "dependency conflicts" -e "requires .*, which is not installed" \
        -e "but you have .* which is incompatible" || true; }
}

# A fresh virtual environment at $1/venv with torch $2 and torchvision $3 (from this machine's disk)
fresh_venv() {
    "${PY:-python3}" -m venv "$1/venv"
    quiet "$1/venv/bin/pip" install -q --upgrade pip
    quiet "$1/venv/bin/pip" install -q "torch==$2" "torchvision==$3"
}
