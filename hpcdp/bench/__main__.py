"""``python -m hpcdp.bench NAME [options]``: dispatch to ``hpcdp.bench.NAME.main(argv)``.

Any public module of this package that defines ``main(argv)`` is a benchmark, so a new layer adds
its benchmark by adding a module, with no registry to edit.
"""
from __future__ import annotations

import importlib
import pkgutil
import sys

import hpcdp.bench as _pkg

#: one-line descriptions for the usage text; modules not listed still run
DESCRIPTIONS = {
    "collectives": "A1-A5 (under mpirun), B1/B2 with --backend tcp, C1 with --backend sim",
    "ddp": "D1, D2, D4 and the share of communication hidden by backward",
    "checkpoint": "G1, G2 against raw MPI-IO (under mpirun)",
    "fsdp": "E1-E4: FSDP/ZeRO memory, bytes moved and step time against DDP",
    "pipeline": "F1, F2: pipeline step time and bubble against theory, stashed activations",
    "rpc": "R1, R2: RPC round trip and throughput against raw point-to-point",
    "tcp": "B1, B2 (same as collectives --backend tcp)",
    "sim": "C1 (same as collectives --backend sim)",
    "trace": "T1: tracing on / off on the DDP example step, and the flight recorder's cost per op",
}


def benchmarks() -> list[str]:
    """Names of the runnable benchmark modules."""
    return sorted(m.name for m in pkgutil.iter_modules(_pkg.__path__) if not m.name.startswith("_"))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    names = benchmarks()
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in names:
        lines = [f"  {n:<12}  {DESCRIPTIONS.get(n, '')}".rstrip() for n in names]
        print("usage: python -m hpcdp.bench {" + ",".join(names) + "} [options]\n" + "\n".join(lines),
              file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    name, rest = argv[0], argv[1:]
    if name == "collectives" and "--backend" in rest:
        i = rest.index("--backend")
        if i + 1 < len(rest) and rest[i + 1] in ("tcp", "sim"):
            name = rest[i + 1]
            rest = rest[:i] + rest[i + 2:]
    mod = importlib.import_module(f"hpcdp.bench.{name}")
    entry = getattr(mod, "main", None) or getattr(mod, "main_tcp", None)
    if entry is None:
        print(f"hpcdp.bench.{name} defines no main(argv)", file=sys.stderr)
        return 2
    return int(entry(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
