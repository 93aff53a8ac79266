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
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[dev,hf,plot,series,tensorboard,youtube,fp8]"
	rm -f $(VENV)/.installed-*
	touch $@

demo: $(STAMP)
	$(BIN)/ultrascale train --model small --steps 60 --seq-len 128 --micro-batch 8 --lr 3e-3 --log-every 5

# The equivalence tests again on other CPU kernel sets (vector widths change summation
# orders): a tolerance that holds for one CPU's rounding only is found here, not on the
# next machine. avx2 only where the CPU has it.
EQUIVALENCE := $(BIN)/python -m pytest -q -m equivalence -p no:cacheprovider

test: $(STAMP)
	$(BIN)/python -m pytest -q
	ATEN_CPU_CAPABILITY=default $(EQUIVALENCE)
	if grep -qw avx2 /proc/cpuinfo; then ATEN_CPU_CAPABILITY=avx2 $(EQUIVALENCE); fi

clean:
	rm -rf $(VENV) .pytest_cache
