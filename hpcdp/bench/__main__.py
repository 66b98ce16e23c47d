"""``python -m hpcdp.bench NAME [options]``: dispatch to ``hpcdp.bench.NAME.main(argv)``."""
from __future__ import annotations

import importlib
import sys

BENCHES = {
    "collectives": "hpcdp.bench.collectives",
    "ddp": "hpcdp.bench.ddp",
    "checkpoint": "hpcdp.bench.checkpoint",
    "tcp": "hpcdp.bench.tcp",
    "sim": "hpcdp.bench.sim",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHES:
        print("usage: python -m hpcdp.bench {" + ",".join(BENCHES) + "} [options]\n"
              "  collectives   A1-A5 (under mpirun), B1/B2 with --backend tcp, C1 with --backend sim\n"
              "  ddp           D1, D2, D4 and the share of communication hidden by backward\n"
              "  checkpoint    G1, G2 against raw MPI-IO (under mpirun)", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    name, rest = argv[0], argv[1:]
    if name == "collectives" and "--backend" in rest:
        i = rest.index("--backend")
        if i + 1 < len(rest) and rest[i + 1] in ("tcp", "sim"):
            name = rest[i + 1]
            rest = rest[:i] + rest[i + 2:]
    mod = importlib.import_module(BENCHES[name])
    entry = getattr(mod, "main", None) or getattr(mod, "main_tcp")
    return int(entry(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
