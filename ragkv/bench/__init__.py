"""Benchmarks behind `ragkv bench store | fusion | sparse`."""
