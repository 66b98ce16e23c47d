"""Benchmarks: ``python -m hpcdp.bench NAME ...`` (see ../shared/PERF.md); ``python -m hpcdp.bench
report FILE...`` tables what they wrote against the targets of ``_targets``."""
