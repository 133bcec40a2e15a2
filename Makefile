# The two commands a new machine needs are `make demo` and `make test`; both set up first.
VENV ?= .venv
BIN := $(VENV)/bin
NP ?= 4

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

unit: setup
	$(BIN)/pytest -q

test: lint unit
