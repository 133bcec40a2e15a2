# The two commands a new machine needs are `make demo` and `make test`; both set up first.
VENV ?= .venv
BIN := $(VENV)/bin
NP ?= 4
# pytest-xdist workers for `make unit`: 0 (the default) runs the tests serially; JOBS=auto is one
# worker per core. Not the default yet: with pytest 9, xdist 3.8's loadgroup no longer groups
# (it renames item._nodeid, which pytest 9 ignores), so namespace-cluster tests run beside each
# other, and two deploy tests then share /var/run/secrets/ringtrain/job.key (see the README).
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

# --dist loadgroup: the namespace-cluster tests share one worker (tests/conftest.py groups them),
# so they never contend with each other; everything else is spread over the workers. A worker
# that dies is not replaced (xdist's group scheduler cannot hand a dead worker's group on): the
# run stops with that test's failure instead of hanging.
unit: setup
	$(BIN)/pytest -q -n $(JOBS) --dist loadgroup --max-worker-restart 0 --durations=30

test: lint unit
