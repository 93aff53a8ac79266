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

# The figures a CPU's rounding can change, again on other kernel sets (vector widths change
# summation orders): the equivalence tests and the notebooks that print measured figures under the lowest
# set (default), and the equivalence tests under avx2 where the CPU runs wider vectors by default
# (on an AVX2-only CPU the first pass already ran avx2). A tolerance that holds for one CPU's
# rounding only is found here, not on the next machine.
# Two test processes (pytest-xdist), a file each at a time: one alone keeps 1.3 of 2 cores busy, as
# its tests wait on process starts and rendezvous; module fixtures stay in one process. (Spreading the
# notebooks over both processes was slower: two notebooks' ranks at once oversubscribe the cores.)
PYTEST := $(BIN)/python -m pytest -q -n 2 --dist loadfile
AGAIN := $(PYTEST) -p no:cacheprovider
NATIVE = $(shell $(BIN)/python -c "import torch; print(torch.backends.cpu.get_cpu_capability())")

test: $(STAMP)
	$(PYTEST)
	ATEN_CPU_CAPABILITY=default $(AGAIN) -m "equivalence or rounding"
	if grep -qw avx2 /proc/cpuinfo && [ "$(NATIVE)" != "AVX2" ]; then ATEN_CPU_CAPABILITY=avx2 $(AGAIN) -m equivalence; fi

clean:
	rm -rf $(VENV) .pytest_cache
