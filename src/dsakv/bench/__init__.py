"""Benchmarks behind `dsakv bench`."""
