# Set-up on a fresh machine: `make test`, then `make bench`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test bench bench-quick bench-all clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile

$(VENV)/.compare: $(STAMP)
	$(PY) -m pip install -q -e '.[compare]' || echo "tokamax did not install: its benchmark rows are skipped"
	touch $@

# The seed suite at full size; its table lands in README.md and benchmarks/results/.
bench: $(STAMP) $(VENV)/.compare
	$(PY) -m benchmarks seed --json benchmarks/results/seed-cpu.json --plot benchmarks/results/seed-cpu.png --readme README.md

bench-quick: $(STAMP) $(VENV)/.compare
	$(PY) -m benchmarks seed --quick

clean:
	rm -rf $(VENV) .pytest_cache
