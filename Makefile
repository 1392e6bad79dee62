# Two commands on a fresh machine: `make run` and `make test` (README).
VENV   ?= .venv
PYTHON ?= python3
PY      = $(VENV)/bin/python
FEDSD   = $(VENV)/bin/fedsd
RUN_OUT ?= runs/default
# Flower's tools (flwr, flower-superlink, flower-supernode) start one another by name.
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: run test test-fast test-slow test-flower-next lint data venv clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e ".[test]"
	touch $@

# Fashion-MNIST, the default data: found (FEDSD_DATA_DIR, Debian's package), else Debian's
# package (as root), else a torchvision download into data/.
data: venv
	@$(PY) -c "import sys; from fedsd.data.datasets import locate; p = locate('fmnist'); print('fmnist:', p); sys.exit(p is None)" \
	|| ( [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	     && (apt-get install -y -q dataset-fashion-mnist || (apt-get update -q && apt-get install -y -q dataset-fashion-mnist)) ) \
	|| $(PY) -c "from fedsd.data.datasets import load; load('fmnist', 'data', download=True)"

# The default federated simulation: Fashion-MNIST, 10 clients, IID, dp3sd, epsilon = 3.
# B = 256 a client with lr 3, the best lr at B = 256 on validation (results/README.md; an unset
# --lr would scale the papers' 3 at B = 1600 down linearly, to 0.48).
run: data
	$(FEDSD) simulate --dataset fmnist --method dp3sd --epsilon 3 --clients 10 --rounds 10 \
	    --batch-size 256 --lr 3 --out $(RUN_OUT) --overwrite

# Tiers: test-fast is unit tests and in-process Flower messages (a few minutes); test-slow is
# every test that trains for real or starts Ray or Flower processes; test is both. One pytest
# worker a core (pytest-xdist; each worker's torch takes its share of the cores, tests/conftest.py),
# idle workers taking tests from busy ones: the slow tier's deployments mostly wait on Flower's
# polls. TEST_WORKERS=0 runs them in this process, one after another.
TEST_WORKERS ?= $(shell $(PYTHON) -c "import os; print(min(4, len(os.sched_getaffinity(0))))")
PYTEST = $(PY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist worksteal)

test: data
	$(PYTEST)

test-fast: data
	$(PYTEST) -m "not slow"

test-slow: data
	$(PYTEST) -m slow

# The linter (ruff: pyflakes and pycodestyle, configured in pyproject.toml); CI runs it first.
lint: venv
	$(VENV)/bin/ruff check .

# The deployment tests against Flower's next release (flwr-nightly), in an environment of its
# own, not part of `make test`: .venv-next holds flwr-nightly and fedsd itself, and sees the
# project's .venv beneath it for everything else (torch, Opacus, Ray: no second copy).
NEXT ?= .venv-next
FLOWER_NEXT ?= flwr-nightly
NEXT_TESTS ?= tests/deployment/test_deploy.py tests/deployment/test_deploy_output.py tests/app/server/test_strategy.py
test-flower-next: data
	$(PYTHON) -m venv $(NEXT)
	$(NEXT)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > $(NEXT)/.purelib
	$(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > "$$(cat $(NEXT)/.purelib)/fedsd-base-venv.pth"
	$(NEXT)/bin/pip install -q --no-deps --pre --upgrade $(FLOWER_NEXT)
	$(NEXT)/bin/pip install -q --no-deps -e .
	$(NEXT)/bin/python -c "import importlib.metadata as m, flwr; print('flwr-nightly', m.version('flwr-nightly'), 'from', flwr.__file__)"
	PATH=$(abspath $(NEXT))/bin:$$PATH $(NEXT)/bin/python -m pytest -q $(NEXT_TESTS)

clean:
	rm -rf $(VENV) $(NEXT) runs .pytest_cache
