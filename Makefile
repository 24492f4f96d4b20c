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

# The Ray tests (mostly waits: Ray's start-up, killed nodes, call deadlines) run beside the others, in a runtime
# folder of their own (their cache keepers, records and core claims apart): the suite in about two thirds of the
# time on 2 cores. Both halves must pass; the Ray half's output follows the other's.
RAY_TESTS := tests/test_remote.py tests/test_remote_gateway.py

test: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	@log=$$(mktemp $(VENV)/ray-tests.XXXXXX); \
	FUSIONFLOW_RUNTIME_DIR=/tmp/fusionflow-$$(id -u)-ray-tests $(BIN)/python -m pytest -q -p no:cacheprovider \
		$(RAY_TESTS) > $$log 2>&1 & ray=$$!; \
	trap 'kill $$ray 2>/dev/null; rm -f $$log; exit 130' INT TERM; \
	$(BIN)/python -m pytest -q $(addprefix --ignore=,$(RAY_TESTS)); rest=$$?; \
	wait $$ray; rayrc=$$?; echo "---- $(RAY_TESTS), run beside the others:"; cat $$log; rm -f $$log; \
	test $$rest -eq 0 -a $$rayrc -eq 0

bench: $(STAMP)
	$(BIN)/python -m experiments.bench_cpu_pipeline

clean:
	rm -rf $(VENV) experiments/data
