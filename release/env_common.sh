# Sourced by release/env.sh and release/sglang/env.sh.

# Stop here, successfully, if the environment $2 was built with what $1 (a stamp file) names;
# otherwise start it afresh (a stale one is removed). $3: its name, for the message.
reuse_or_start() {
    if [[ -f "$1" ]]; then
        echo "$3 env: $2 (cached)"
        exit 0
    fi
    rm -rf "$2"
    mkdir -p "$2/dl"
}

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

# The requirements of the wheel $2 (its METADATA's Requires-Dist, extras left out), less those
# whose name is one of the |-separated names (regexes) $3, any case; printed by the python $1
wheel_requirements() {
    "$1" - "$2" "$3" <<'PYEOF'
import re, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as whl:
    meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
    for line in whl.read(meta).decode().splitlines():
        if not line.startswith("Requires-Dist: ") or "extra ==" in line:
            continue
        req = line[len("Requires-Dist: "):]
        if re.match(rf"({sys.argv[2]})(?![\w.-])", req, re.IGNORECASE):
            continue
        print(req)
PYEOF
}
