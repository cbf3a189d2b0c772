"""Builders for tiny models used by the tests, the benchmarks and the embedded default model."""
