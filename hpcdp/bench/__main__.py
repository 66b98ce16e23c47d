"""``python -m hpcdp.bench NAME [options]``: dispatch to ``hpcdp.bench.NAME.main(argv)``.

``report`` (a tool in ``TOOLS``, not a benchmark) reads what the benchmarks wrote.

Any public module of this package that defines ``main(argv)`` is a benchmark, so a new layer adds
its benchmark by adding a module, with no registry to edit. Each benchmark is an argparse
sub-command whose options belong to the module's own parser: ``NAME --help`` is that parser's help,
so the two cannot drift apart, and this module imports a benchmark only to run it.
"""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

import hpcdp.bench as _pkg

#: one-line descriptions for the listing; a module not listed shows its docstring's first line
DESCRIPTIONS = {
    "collectives": "A1-A5 (under mpirun), B1/B2 with --backend tcp, C1 with --backend sim",
    "ddp": "D1, D2, D4 and the share of communication hidden by backward",
    "determinism": "H1, H2 (under mpirun) and the bit-for-bit check of deterministic training (outside it)",
    "checkpoint": "G1, G2 against raw MPI-IO (under mpirun)",
    "fsdp": "E1-E4: FSDP/ZeRO memory, bytes moved and step time against DDP",
    "multinode": "M1, M2: allreduce busbw across nodes vs the link, hierarchical vs flat, DDP over nodes",
    "gpu": "A6: cupy allreduce against MPI on the same device buffers, staging cost, DDP/FSDP on cupy",
    "p2p": "A7: send/recv latency, halo-exchange steps and batch_isend_irecv against mpi4py (under mpirun)",
    "pipeline": "F1, F2: pipeline step time and bubble against theory, stashed activations",
    "rpc": "R1, R2: RPC round trip and throughput against raw point-to-point",
    "tcp": "B1, B2 (same as collectives --backend tcp)",
    "torch": "D5: torch models under hpcdp.DDP against plain torch and torch's DDP over gloo (under mpirun)",
    "sim": "C1 (same as collectives --backend sim)",
    "trace": "T1: tracing on / off on the DDP example step, and the flight recorder's cost per op",
}


#: public modules that are tools over the benchmarks' output, not benchmarks: listed apart
TOOLS = {
    "report": "one table of every PERF.md id: figure, target, met / MISSED / not run (from --json files)",
}


def benchmarks() -> list[str]:
    """Names of the runnable benchmark modules."""
    return sorted(m.name for m in pkgutil.iter_modules(_pkg.__path__)
                  if not m.name.startswith("_") and m.name not in TOOLS)


def description(name: str) -> str:
    """The one line ``--help`` shows for benchmark ``name``."""
    if name in DESCRIPTIONS or name in TOOLS:
        return DESCRIPTIONS.get(name) or TOOLS[name]
    try:
        doc = importlib.import_module(f"hpcdp.bench.{name}").__doc__ or ""
    except Exception as exc:  # noqa: BLE001 - the listing must not fail on one broken module
        return f"(cannot import: {type(exc).__name__}: {exc})"
    return doc.strip().splitlines()[0].strip("`. ") if doc.strip() else ""


class _Formatter(argparse.HelpFormatter):
    """Each description on its benchmark's line: argparse measures sub-command names without the
    two columns it indents them by, so the longest name would push its description down a line."""

    def add_argument(self, action: argparse.Action) -> None:
        super().add_argument(action)
        if isinstance(action, argparse._SubParsersAction):
            self._action_max_length += 2


def _parser(names: list[str]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hpcdp.bench",
        formatter_class=_Formatter,
        description="Benchmarks of hpcdp against its baselines (raw mpi4py, sockets, gloo, numpy), "
                    "with the PERF.md targets. Most run under 'mpirun -n 2 --bind-to core'.",
        epilog="--json FILE appends a benchmark's results as JSON lines; 'python -m hpcdp.bench "
               "report FILE...' tables every id against its target, 'python -m hpcdp.trace "
               "plot-bench' draws them.")
    sub = p.add_subparsers(dest="name", required=True, metavar="BENCHMARK", title="benchmarks",
                           help="'python -m hpcdp.bench BENCHMARK --help' lists its options")
    for name in [*names, *TOOLS]:
        # the module's own parser reads the rest (--help included), so this one takes no options
        sub.add_parser(name, help=description(name), add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    names = benchmarks()
    parser = _parser(names)
    args, _ = parser.parse_known_args(argv)
    if argv[0] != args.name:  # options before the name are not the benchmark's: refuse, not drop
        parser.error(f"unrecognized arguments: {' '.join(argv[:argv.index(args.name)])}")
    rest = argv[1:]  # everything after the name, in order, for the benchmark's own parser
    mod = importlib.import_module(f"hpcdp.bench.{args.name}")
    entry = getattr(mod, "main", None)
    if entry is None:
        print(f"python -m hpcdp.bench: hpcdp.bench.{args.name} defines no main(argv)", file=sys.stderr)
        return 2
    return int(entry(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
