# Two commands on a fresh machine: `make run` and `make test` (README).
VENV   ?= .venv
PYTHON ?= python3
PY      = $(VENV)/bin/python
FEDSD   = $(VENV)/bin/fedsd
RUN_OUT ?= runs/default
# Flower's tools (flwr, flower-superlink, flower-supernode) start one another by name.
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: run test test-fast test-slow data venv clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e ".[test]"
	touch $@

# Fashion-MNIST, the default data: found (FEDSD_DATA_DIR, Debian's package), else Debian's
# package (as root), else a torchvision download into data/.
data: venv
	@$(PY) -c "import sys; from fedsd.data import locate; p = locate('fmnist'); print('fmnist:', p); sys.exit(p is None)" \
	|| ( [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	     && (apt-get install -y -q dataset-fashion-mnist || (apt-get update -q && apt-get install -y -q dataset-fashion-mnist)) ) \
	|| $(PY) -c "from fedsd.data import load; load('fmnist', 'data', download=True)"

# The default federated simulation: Fashion-MNIST, 10 clients, IID, dp3sd, epsilon = 3.
# B = 256 a client with lr 3, the best lr at B = 256 on validation (results/README.md; an unset
# --lr would scale the papers' 3 at B = 1600 down linearly, to 0.48).
run: data
	$(FEDSD) simulate --dataset fmnist --method dp3sd --epsilon 3 --clients 10 --rounds 10 \
	    --batch-size 256 --lr 3 --out $(RUN_OUT) --overwrite

# Tiers: test-fast is unit tests and in-process Flower messages (a few minutes); test-slow is
# every test that trains for real or starts Ray or Flower processes; test is both.
test: data
	$(PY) -m pytest -q

test-fast: data
	$(PY) -m pytest -q -m "not slow"

test-slow: data
	$(PY) -m pytest -q -m slow

clean:
	rm -rf $(VENV) runs .pytest_cache
