"""Benchmarks: ``python -m benchmarks SUITE [--quick] [--json PATH] [--plot PATH] [--readme PATH]``."""
