"""Benchmarks: ``python -m benchmarks SUITE [--quick] [--json PATH] [--plot PATH]
[--readme PATH] [--headline PATH] [--from-json PATH]`` (see ``benchmarks.cli``)."""
