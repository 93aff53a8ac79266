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

# pip byte-compiles what it installs one file at a time; compileall does it on every core (a fresh
# setup: 107 s instead of 125 on 2 cores). Its status is 1 for the few files of other Python versions
# that packages ship (pip skips them too), hence `|| true`.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q --no-compile -c constraints.txt -e ".[dev,hf,plot,series,tensorboard,wandb,youtube,fp8]"
	$(BIN)/python -m compileall -q -j 0 $$($(BIN)/python -c "import sysconfig; print(sysconfig.get_path('purelib'))") \
		> /dev/null || true
	rm -f $(VENV)/.installed-*
	touch $@

demo: $(STAMP)
	$(BIN)/ultrascale train --model small --steps 60 --seq-len 128 --micro-batch 8 --lr 3e-3 --log-every 5

# The passes (each timed; the 15 slowest tests at the end) are scripts/test_passes.py's: the whole
# suite on three pytest-xdist workers, then the equivalence tests and
# the notebooks whose figures or kernels depend on the CPU's kernel set again under the lowest set
# (ATEN_CPU_CAPABILITY=default): a tolerance that holds for one CPU's rounding only is found here,
# not on the next machine (docs/engine.md, "Tolerance classes").
test: $(STAMP)
	$(BIN)/python scripts/test_passes.py $(BIN)/python

clean:
	rm -rf $(VENV) .pytest_cache

# The course's notebooks rebuilt from notebooks/src and run on this CPU, written with their outputs
# (docs/series.md); `$(BIN)/python notebooks/src/build.py 1 5` for some parts only.
.PHONY: notebooks
notebooks: $(STAMP)
	$(BIN)/python notebooks/src/build.py

# Every valid combination of the engine's features (about 5 x 10^4 cells, ~1-2 s each on 2 cores),
# each against one process, with inductor for the compiled ones; resumable (cells already in the
# results file are skipped) and shardable over machines: make matrix SHARD=2/4. `make test` runs the
# covering set of every pair instead (tests/test_matrix.py). docs/engine.md holds the last result.
SHARD ?= 1/1
.PHONY: matrix
matrix: $(STAMP)
	$(BIN)/python -m ultrascale.testing.matrix --run full --backend inductor --shard $(SHARD) \
		--results matrix-results.jsonl

# The GPU kit (docs/benchmarks.md, "On a GPU"). gpu-wheels, here with network: the wheels a GPU
# machine's own Python may lack (pure Python or abi3, so its Python version does not matter), pinned
# by constraints.txt, into the ignored folder .whl/ that travels with the tree. gpu-check, on the GPU
# machine with its own CUDA torch: scripts/gpu_check.sh installs what is missing from .whl/ without
# touching torch, runs the CUDA tests and benchmarks in 9 minutes and writes OUT/gpu-report.md
# and .json; without CUDA it says so in one line and exits 2.
GPU_WHEELS := pytest pluggy iniconfig packaging pygments pytest-timeout tqdm torchao exceptiongroup tomli
OUT ?=

.PHONY: gpu-wheels gpu-check
gpu-wheels: $(STAMP)
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.10 \
		-c constraints.txt -d .whl $(GPU_WHEELS)
	du -sh .whl

gpu-check:
	GPU_PYTHON=$(or $(GPU_PYTHON),python3) scripts/gpu_check.sh $(OUT)
