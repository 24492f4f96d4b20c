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

# Three groups run side by side, each in a runtime folder of its own (cache keepers, records and core claims apart):
# the Ray tests and the shared loader's (mostly waits: Ray's start-up, killed nodes, call deadlines; stopped and
# paused clients), and the rest. All must pass; the side groups' output follows the rest's.
RAY_TESTS := tests/test_remote.py tests/test_remote_gateway.py
SHARED_TESTS := tests/test_shared.py
SIDE = FUSIONFLOW_RUNTIME_DIR=/tmp/fusionflow-$$(id -u)-$(1) $(BIN)/python -m pytest -q -p no:cacheprovider $(2)

test: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	@ray_log=$$(mktemp $(VENV)/ray-tests.XXXXXX); shared_log=$$(mktemp $(VENV)/shared-tests.XXXXXX); \
	$(call SIDE,ray-tests,$(RAY_TESTS)) > $$ray_log 2>&1 & ray=$$!; \
	$(call SIDE,shared-tests,$(SHARED_TESTS)) > $$shared_log 2>&1 & shared=$$!; \
	trap 'kill $$ray $$shared 2>/dev/null; rm -f $$ray_log $$shared_log; exit 130' INT TERM; \
	$(BIN)/python -m pytest -q $(addprefix --ignore=,$(RAY_TESTS) $(SHARED_TESTS)); rest=$$?; \
	wait $$shared; sharedrc=$$?; echo "---- $(SHARED_TESTS), run beside the others:"; cat $$shared_log; \
	wait $$ray; rayrc=$$?; echo "---- $(RAY_TESTS), run beside the others:"; cat $$ray_log; \
	rm -f $$ray_log $$shared_log; \
	test $$rest -eq 0 -a $$sharedrc -eq 0 -a $$rayrc -eq 0

bench: $(STAMP)
	$(BIN)/python -m experiments.bench_cpu_pipeline

clean:
	rm -rf $(VENV) experiments/data
