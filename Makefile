# Two commands on a fresh machine:  make publish   |   make test
# Both create .venv with the pinned toolchain first (torch 2.13.0 comes from local disk).
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export PATH := $(abspath $(BIN)):$(PATH)
export DVC_NO_ANALYTICS := 1
export HF_HUB_DISABLE_TELEMETRY := 1

.PHONY: setup browser publish test test-browser test-beta test-cluster lint dvc-repro verify bench mutate clean

setup: $(STAMP)

# torch by pip (it takes the pinned CPU build from local disk: pip's find-links), then the rest by uv
# (the same versions pip resolves, downloaded and installed in parallel, bytecode compiled: 52 s
# where pip alone took 144 s, docs/testing.md); the venv keeps pip (beta-watch installs with it)
UV := uv==0.13.8
$(STAMP): requirements.txt requirements-test.txt pyproject.toml
	@command -v $(PY) >/dev/null || { echo "error: $(PY) not found -- fix: install Python 3.11 or run make PY=/path/to/python3.11"; exit 1; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q $(UV) "$$(grep -m1 '^torch==' requirements.txt)"
	$(BIN)/uv pip install -q --python $(BIN)/python --compile-bytecode -r requirements-test.txt \
	  || { echo "note: uv could not install the requirements (its error above; it reads no pip.conf): pip installs them"; \
	       $(BIN)/pip install -q -r requirements-test.txt; }
	$(BIN)/uv pip install -q --python $(BIN)/python --no-deps -e . || $(BIN)/pip install -q --no-deps -e .
	touch $@

publish: setup
	snakemake --cores 1 publish

dvc-repro: setup
	dvc repro

# Debian's Chromium for the report's browser test: a system package, so not part of `make test`
# (tests/test_report_browser.py skips there, saying so); `make test-browser` installs it and runs
# that test on the whole default DAG's build
browser:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	  && apt-get update -qq && apt-get install -y -qq chromium >/dev/null; } \
	  || echo "note: chromium is missing and cannot be installed here (root and apt-get needed): the browser test will fail"

test: setup lint
	bash .ci/pytest.sh

test-browser: setup browser
	RECURRENT_COREAI_TEST_BROWSER=1 bash .ci/pytest.sh tests/test_report_browser.py

# the default DAG as SLURM jobs on a single-node SLURM started here (root; installs Debian's
# slurm-wlm, slurmdbd, munge, mariadb-server when missing), every job COMPLETED in sacct
test-cluster: setup
	bash tests/cluster/install.sh
	RECURRENT_COREAI_TEST_CLUSTER=1 PYTEST_WORKERS=0 timeout -k 30 2700 bash .ci/pytest.sh -s tests/test_cluster.py tests/test_cluster_nodes.py

# dvc status by content, not file times: an empty state cache makes DVC re-hash every output
verify: setup
	DVC_SITE_CACHE_DIR="$$(mktemp -d)" dvc status

# Snakemake's lint, dvc.yaml against the DAG, and the package's layers (import-linter, pyproject.toml)
lint: setup
	snakemake --lint
	python scripts/gen_dvc.py --check
	lint-imports

bench: setup
	python bench/bench_export_gate.py

# mutation testing of the code that decides pass or fail (scripts/mutate.py: mutmut, installed on
# first use beside the venv; CPU heavy, one worker, minutes); not part of make test
mutate: setup
	python scripts/mutate.py

# Issue 38: the scheduled rebuild from the previous real release. A clone of HEAD in $(BETA_DIR)
# pinned (requirements.txt and envs/*.yaml, committed there) to coreai-core $(BETA_CORE) +
# coreai-torch $(BETA_TORCH) (the pair apple/coreai-models pins) + coreai-opt $(BETA_OPT) (the release
# before the pin; 0.2.1, whose [coreai] extra names b2, caps torch at 2.11); its own venv, made by
# the clone's own `make setup` (torch 2.13.0 from local disk: requirements.txt pins it, pip.conf's
# find-links serves it); the toolchain contract checked there;
# the default DAG built there; then beta-watch --apply back to the newest releases (exit 0 or 1,
# with its report). CPU heavy (the DAG twice); not part of make test. See docs/toolchain.md.
BETA_DIR   ?= /tmp/recurrent-coreai-test-beta
BETA_CORE  ?= 1.0.0b2
BETA_TORCH ?= 0.4.2
BETA_OPT   ?= 0.3.0
BETA_PATH  := $(BETA_DIR)/.venv/bin:/usr/local/bin:/usr/bin:/bin
test-beta:
	rm -rf $(BETA_DIR) && git clone -q "$(CURDIR)" $(BETA_DIR)
	cd $(BETA_DIR) && sed -i -E -e 's/^(\s*(- )?coreai-core==)\S+/\1$(BETA_CORE)/' \
	  -e 's/^(\s*(- )?coreai-torch==)\S+/\1$(BETA_TORCH)/' -e 's/^(\s*(- )?coreai-opt==)\S+/\1$(BETA_OPT)/' \
	  requirements.txt envs/*.yaml && git -c user.name=test-beta -c user.email=test-beta@localhost commit -qam \
	  "pins: coreai-core $(BETA_CORE), coreai-torch $(BETA_TORCH), coreai-opt $(BETA_OPT)"
	$(MAKE) -C $(BETA_DIR) setup PY=$(PY)
	cd $(BETA_DIR) && .venv/bin/python -c "import torch; assert torch.__version__.split('+')[0] == '2.13.0', torch.__version__"
	cd $(BETA_DIR) && PATH=$(BETA_PATH) python -m recurrent_coreai.coreai.contract
	cd $(BETA_DIR) && PATH=$(BETA_PATH) bash -c 'time snakemake --cores 1 --keep-going publish'
	cd $(BETA_DIR) && PATH=$(BETA_PATH) bash -c 'time python -m recurrent_coreai beta-watch --apply'; test $$? -le 1

clean:
	rm -rf results .snakemake
