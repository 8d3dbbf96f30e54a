# Two commands: `make demo` and `make test`. Both bootstrap .venv on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# torch==2.13.0 first: a bare torch requirement with no torch installed pulls a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
# pytest-xdist workers of `make test`, one thread each (tests/conftest.py): 2 fill a 2-core machine
TEST_WORKERS ?= 2

.PHONY: venv install install-test install-docs demo test docs clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

venv: $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install $(TORCH_PIN)

install: venv
	$(PIP) install -q -e .

install-test: venv
	$(PIP) install -q -e ".[test]"

install-docs: venv
	$(PIP) install -q -e ".[docs]"

demo: install
	$(VENV)/bin/gpnys fit --data elevators --split 0 --kernel matern32 --ard --iters 40 --lr 0.1 --seed 0

test: install-test
	$(PY) -m pytest -q -n $(TEST_WORKERS)

docs: install-docs
	$(VENV)/bin/mkdocs build --strict

clean:
	rm -rf site build *.egg-info
