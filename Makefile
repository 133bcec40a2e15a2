# The two commands a new machine needs are `make demo` and `make test`; both set up first.
# bash: the test target reads the tests' exit code through a pipe (PIPESTATUS).
SHELL := /bin/bash
VENV ?= .venv
BIN := $(VENV)/bin
NP ?= 4
# pytest-xdist workers for `make unit`: one more than the usable cores (the CPU quota of a
# container counts, not the host's cores), the namespace-cluster tests kept on one worker (see
# the README); JOBS=0 runs the tests serially. The extra worker fills the cores while other
# tests wait (transport timeouts, stall times, slow links, Spark and Ray): with one worker per
# core the 2 cores were 82-88% busy. On 2026-12-05, a quiet 2-core machine, two pairs of runs
# one after the other: 3 workers 19:45 and 20:26 (93-97% busy), 2 workers 21:16 and 21:11;
# beside `stress-ng --cpu 2`, 3 workers 26:45 (2 workers, earlier that day: 29:08, 30:49). (On
# 2026-12-04, when the suite kept the cores 92-99% busy, a third worker was slower: 19:26
# against 18:13.)
JOBS ?= $(shell $(BIN)/python -c 'from ringtrain.host.cpu_limits import usable_cpus; print(usable_cpus() + 1)')

.PHONY: setup demo test lint unit check bytecode

setup:
	@./scripts/setup

demo: setup
	$(BIN)/ringtrain run -np $(NP) -- $(BIN)/python examples/train_digits.py

lint: setup
	VENV=$(VENV) ./scripts/lint

# --dist loadgroup: the namespace-cluster tests share one worker (tests/conftest.py groups them),
# so they never contend with each other; everything else is spread over the workers. A worker
# that dies is not replaced (xdist's group scheduler cannot hand a dead worker's group on): the
# run stops with that test's failure instead of hanging.
UNIT = $(BIN)/pytest -q -n $(JOBS) --dist loadgroup --max-worker-restart 0 --durations=30
unit: bytecode
	$(UNIT)

# Lint beside the tests, its output after theirs: mypy keeps one core busy for ~30 s on a clean
# clone, which the tests would otherwise wait through (the suite keeps 2 cores busy). The tests'
# verdict comes last (the failed tests' lines of pytest's summary, not its skips, then its last
# lines, which say where a worker died), so that a log cut to its tail, as CI's report is, still
# names the failing tests.
test: bytecode
	@lint_out=$$(mktemp); unit_out=$$(mktemp); \
	VENV=$(VENV) ./scripts/lint > "$$lint_out" 2>&1 & lint_pid=$$!; \
	$(UNIT) 2>&1 | tee "$$unit_out"; unit_rc=$${PIPESTATUS[0]}; wait $$lint_pid; lint_rc=$$?; \
	echo "== lint (scripts/lint, run beside the tests): exit code $$lint_rc"; cat "$$lint_out"; \
	echo "== tests: exit code $$unit_rc"; \
	grep -E '^(FAILED|ERROR) ' "$$unit_out" | head -n 40; tail -n 3 "$$unit_out"; \
	rm -f "$$lint_out" "$$unit_out"; test $$lint_rc -eq 0 && test $$unit_rc -eq 0

# The quick tier for the inner loop: lint, then the tests that start no test world, cluster,
# launcher, agent or command (tests/conftest.py marks those `processes` by rule); `make test`
# (everything) stays what CI runs.
check: lint bytecode
	$(BIN)/pytest -q -n $(JOBS) -m "not processes" --durations=10

# The project's own bytecode, compiled once before the tests. The suite starts interpreters by
# the hundred (ranks, launchers, agents, stores, writers), and where PYTHONDONTWRITEBYTECODE is
# set (many container images set it) none of them may keep what it compiled: each rank compiled
# ringtrain's ~160 modules again (0.2 s of CPU), about a second of CPU per 2-rank `ringtrain run`
# job, on a machine the suite keeps busy. Python checks each file against its source's mtime
# and size, so an edited module is compiled afresh as always; a tree that cannot be written is
# only reported ('-').
bytecode: setup
	-$(BIN)/python -m compileall -q -j 0 src tests examples
