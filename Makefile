# Two commands on a fresh machine: `make demo` and `make test`.
# Both create .venv, install the package and its dev tools, then run.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch: on a machine without CUDA an unpinned torch would pull a
# multi-GB CUDA wheel. Override with `make TORCH_SPEC=torch test` on a GPU machine.
TORCH_SPEC ?= $(shell if command -v nvidia-smi >/dev/null 2>&1; then echo "torch"; else echo "torch==2.13.0"; fi)
STAMP := $(VENV)/.installed

.PHONY: setup extras demo test check lint typecheck bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

# The optional extras into .venv: the framework adapters (DeepSpeed, Megatron Core, TorchTitan,
# Hugging Face), NIXL (its UCX backend runs the one-sided transfer tests on CPU too) and matplotlib
# (`lm-resiliency bench --plot`), held to the installed torch by a constraint: an install never
# replaces torch==2.13.0.
EXTRAS_STAMP := $(VENV)/.extras
$(EXTRAS_STAMP): $(STAMP) pyproject.toml
	echo "$(TORCH_SPEC)" > $(VENV)/torch-constraint.txt
	$(BIN)/pip install -q -c $(VENV)/torch-constraint.txt -e ".[dev,deepspeed,megatron,torchtitan,hf,nixl,plot]"
	touch $(EXTRAS_STAMP)

extras: $(EXTRAS_STAMP)

demo: $(STAMP)
	$(BIN)/lm-resiliency demo $(DEMO_ARGS)

LINTED := src tests benchmarks examples scripts

lint: $(STAMP)
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/lint-imports
	$(BIN)/mypy

# The fast loop while developing (about 2 minutes): lint, types and every test that starts no
# process. `make test` is the whole suite, and what CI runs.
check: lint
	$(BIN)/python -m pytest -q -m "not multiprocess and not slow"

test: $(STAMP) lint
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	for b in benchmarks/*.py; do $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info
