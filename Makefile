# One-command set-up: every target creates .venv (CPU torch from the local wheel cache) on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
export FASTPALS_DATA_DIR ?= $(abspath ../shared/data)
# JIT-built torch extensions (DeepSpeed's CPU shared-memory op, built only for multi-process CPU runs) stay in the venv
export TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch_extensions

.PHONY: setup train resume compare test lint bench bench-slow report clean gpu-session

$(VENV)/.installed: pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "torch==2.13.0"
	DS_BUILD_OPS=0 $(BIN)/python -m pip install -q -e ".[dev,demo]"
	touch $@

# builds the compiled weight solve, CPU dropout and CPU attention (csrc/, C++) just in time into ~/.cache/fastpals (a no-op once built)
setup: $(VENV)/.installed
	$(BIN)/python -c "from fastpals.surgery import compiled; from fastpals_kernels import attention_varlen, dropout; compiled.load(); dropout.compiled_dropout(); attention_varlen.compiled_attention()"

train: setup
	$(BIN)/python train.py --ds_config configs/cpu_auto.json --out runs/default --overwrite --epochs 1 \
		--steps-per-epoch 867 --sampling sqrt --batch-size 48 --max-length 128 --lr 1.2e-4 --pal-lr 6e-4 --head-lr 2.4e-4 \
		--warmup 0.06 --freeze-word-embeddings --freeze-layers 1 --pal-layers 5

# continue `make train` after a kill, Ctrl-C or power cut from its last checkpoint (every 100 updates)
resume: setup
	$(BIN)/python train.py --out runs/default --resume

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports  # the package's layers and no import circle: [tool.importlinter] in pyproject.toml

test: lint
	$(BIN)/python -m pytest -q tests
	FASTPALS_BENCH_INTERLEAVED_ROUNDS=1 FASTPALS_BENCH_ROUNDS=1 $(BIN)/python -m pytest -q bench --benchmark-only -m "not slow" -p no:cacheprovider

bench: setup
	$(BIN)/python -m pytest bench/ --benchmark-only

bench-slow: setup
	$(BIN)/python -m pytest bench/ --benchmark-only -m slow

report: setup
	$(BIN)/python -m bench.report

# On a lent GPU machine (its own python3 holds torch): `make gpu-session BUDGET=390` runs the steps in priority
# order within BUDGET seconds (STEPS=a,b: only those). Writes at most 8 files to $$OUT (the device tool's folder)
# or bench/results/gpu_session. See docs/gpu-session.md.
# `make gpu-session REHEARSE=1`: every step on this CPU at tiny shapes (what CI runs).
gpu-session:
	$(if $(REHEARSE),$(BIN)/python,$(PY)) bench/gpu_session.py $(if $(STEPS),--steps $(STEPS)) \
		$(if $(BUDGET),--budget-s $(BUDGET)) $(if $(REHEARSE),--rehearse)

clean:
	rm -rf $(VENV) build dist *.egg-info runs
