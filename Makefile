# The two commands a new machine needs are `make demo` and `make test`; both set up first.
VENV ?= .venv
BIN := $(VENV)/bin
NP ?= 4
# pytest-xdist workers for `make unit`: 0 runs the tests serially (the default until a parallel
# run of the whole suite is shown to pass: see the README); JOBS=auto is one worker per core.
JOBS ?= 0

.PHONY: setup demo test lint unit

setup:
	@./scripts/setup

demo: setup
	$(BIN)/ringtrain run -np $(NP) -- $(BIN)/python examples/train_digits.py

lint: setup
	$(BIN)/ruff check src tests examples
	$(BIN)/ruff format --check src tests examples
	$(BIN)/mypy
	$(BIN)/lint-imports

# --dist loadgroup: with JOBS > 0 the namespace-cluster tests share one worker (tests/conftest.py
# groups them), so they never contend with each other; everything else is spread over the workers.
unit: setup
	$(BIN)/pytest -q -n $(JOBS) --dist loadgroup

test: lint unit
