# Everything a fresh machine needs: a venv with pinned torch/torchvision, then this package.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat setup.cfg Makefile | cksum | cut -d' ' -f1)

.PHONY: demo test bench install clean

$(STAMP): setup.cfg Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.14.1 torchvision==0.29.1
	$(BIN)/pip install -q -e '.[test,plot,ray]'
	rm -f $(VENV)/.installed-* && touch $@

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m fusionflow demo

test: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python -m experiments.bench_cpu_pipeline

clean:
	rm -rf $(VENV) experiments/data
