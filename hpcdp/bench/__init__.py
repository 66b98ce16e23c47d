"""Benchmarks: ``python -m hpcdp.bench {collectives,ddp,checkpoint} ...`` (see ../shared/PERF.md)."""
