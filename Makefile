# Two entry points, both create (or reuse) the local virtualenv .venv:
#   make demo   a short CPU training run; the loss falls
#   make test   the whole test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Reinstall when the requirements change.
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | cksum | cut -d' ' -f1)

.PHONY: demo test setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[dev,hf,plot,series,youtube]"
	rm -f $(VENV)/.installed-*
	touch $@

demo: $(STAMP)
	$(BIN)/ultrascale train --model small --steps 60 --seq-len 128 --micro-batch 8 --lr 3e-3 --log-every 5

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache
