"""Benchmarks and the one-command report: ``python -m bench``."""
