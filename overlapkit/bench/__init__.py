"""Benchmarks: ``python -m overlapkit bench NAME``. Each compares inside one run (ratios)."""
