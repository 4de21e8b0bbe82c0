# Set-up on a fresh machine: `make test`, then `make bench`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test bench bench-quick bench-tables clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $(STAMP)

# The multi-device tests run in a process of their own, on 8 simulated CPU devices.
SHARDING_ENV := XLA_FLAGS=--xla_force_host_platform_device_count=8 JAXFUSE_REQUIRE_DEVICES=8
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile --ignore=tests/sharding
	$(SHARDING_ENV) $(PY) -m pytest -q -n 2 --dist loadfile tests/sharding

$(VENV)/.compare: $(STAMP)
	$(PY) -m pip install -q -e '.[compare]' || echo "tokamax did not install: its benchmark rows are skipped"
	touch $@

# The seed suite at full size; its records and plot land in benchmarks/results/, its full table
# in benchmarks/README.md and its headline table in README.md.
bench: $(STAMP) $(VENV)/.compare
	$(PY) -m benchmarks seed --json benchmarks/results/seed-cpu.json --plot benchmarks/results/seed-cpu.png --readme benchmarks/README.md --headline README.md

# Every suite's tables rewritten from its recorded run in benchmarks/results/ (nothing is run).
TABLES := --readme benchmarks/README.md --headline README.md
bench-tables: $(STAMP)
	$(PY) -m benchmarks seed --from-json benchmarks/results/seed-cpu.json $(TABLES)
	$(PY) -m benchmarks norm --from-json benchmarks/results/norm-cpu-quick.json $(TABLES)
	$(PY) -m benchmarks attention --from-json benchmarks/results/attention-cpu-quick.json $(TABLES)
	$(PY) -m benchmarks xent --from-json benchmarks/results/xent-cpu-quick.json $(TABLES)
	$(PY) -m benchmarks train --from-json benchmarks/results/train-cpu-quick.json $(TABLES)
	$(PY) -m benchmarks train-cli --from-json benchmarks/results/train-cli-cpu.json $(TABLES)
	$(PY) -m benchmarks finetune --from-json benchmarks/results/finetune-cpu-quick.json $(TABLES)
	$(PY) -m benchmarks layouts --from-json benchmarks/results/layouts-cpu-quick.json --readme benchmarks/README.md
	$(PY) -m benchmarks kernels --from-json benchmarks/results/kernels-sm90a-quick.json $(TABLES)
	$(PY) -m benchmarks remat --from-json benchmarks/results/remat-cpu-quick.json $(TABLES)
	$(PY) -m benchmarks shard --from-json benchmarks/results/shard-cpu-quick.json $(TABLES)
	$(PY) -m benchmarks moe --from-json benchmarks/results/moe-cpu-quick.json $(TABLES)
	$(PY) -m benchmarks posttrain --from-json benchmarks/results/posttrain-cpu-quick.json $(TABLES)
	$(PY) -m benchmarks rl --from-json benchmarks/results/rl-cpu.json $(TABLES)

bench-quick: $(STAMP) $(VENV)/.compare
	$(PY) -m benchmarks seed --quick

clean:
	rm -rf $(VENV) .pytest_cache
