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

# The figures a CPU's rounding can change, again on a second kernel set: the equivalence tests and
# the notebooks that print measured figures under the lowest set (default), whose summation orders
# differ most from any vector set's. A tolerance that holds for one CPU's rounding only is found
# here, not on the next machine. (A third pass under avx2 on AVX-512 machines cost 2-3 minutes of
# the suite; the tolerances were measured on all three sets: docs/engine.md.)
# Two test processes (pytest-xdist), a file each at a time: one alone keeps 1.3 of 2 cores busy, as
# its tests wait on process starts and rendezvous; module fixtures stay in one process. (Spreading the
# notebooks over both processes was slower: two notebooks' ranks at once oversubscribe the cores.)
PYTEST := $(BIN)/python -m pytest -q -n 2 --dist loadfile
AGAIN := $(PYTEST) -p no:cacheprovider

# The course's paced pipeline runs (-m paced: a recorded timeline against its simulation) run alone,
# one process, after the parallel pass: beside another test process's ranks a waiting rank wakes tens
# of milliseconds late, which the timeline would show as bubble. They print training losses too, so
# they go under both kernel sets.
SERIAL := $(BIN)/python -m pytest -q -p no:cacheprovider -m paced

test: $(STAMP)
	$(PYTEST) -m "not paced"
	$(SERIAL)
	ATEN_CPU_CAPABILITY=default $(AGAIN) -m "(equivalence or rounding) and not paced"
	ATEN_CPU_CAPABILITY=default $(SERIAL)

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
