"""``python -m hpcdp {info}``: versions, MPI library, CUDA-awareness, h5py MPI support, backends,
and every ``HPCDP_*`` setting with its value and where it came from (``hpcdp._config``).

argparse sub-commands, as ``python -m hpcdp.trace`` and ``python -m hpcdp.bench`` have, so
``--help`` lists every command and option and ``--version`` answers without a command.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import platform
import sys

import hpcdp
from hpcdp import _config
from hpcdp._version import __version__


def _version(mod: str) -> str:
    try:
        m = importlib.import_module(mod)
    except Exception as exc:  # noqa: BLE001 - report, never fail
        return f"not available ({type(exc).__name__}: {exc})"
    return str(getattr(m, "__version__", "?"))


def info() -> dict[str, str]:
    """What a bug report needs, as name -> value."""
    out = {
        "hpcdp": hpcdp.__version__,
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": platform.platform(),
        "numpy": _version("numpy"),
        "mpi4py": _version("mpi4py"),
        "h5py": _version("h5py"),
        "cupy": _version("cupy"),
        "backends": ", ".join(hpcdp.available_backends()),
        "detected backend": hpcdp.comm.world.detect_backend(),
    }
    try:
        from hpcdp.backends.mpi import get_mpi

        MPI = get_mpi()
        out["MPI library"] = MPI.Get_library_version().splitlines()[0].strip()
        out["MPI standard"] = "%d.%d" % MPI.Get_version()
        out["MPI thread level"] = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
                                   MPI.THREAD_SERIALIZED: "serialized",
                                   MPI.THREAD_MULTIPLE: "multiple"}.get(MPI.Query_thread(), "?")
        if importlib.util.find_spec("cupy") is None:
            out["MPI CUDA-aware"] = "not probed (cupy is not installed)"
        else:  # a child process sends device memory to itself (backends/_mpi_staging.py)
            from hpcdp.backends.mpi import describe

            out["MPI CUDA-aware"] = describe().split(": ", 1)[1]
    except Exception as exc:  # noqa: BLE001
        out["MPI library"] = f"not available ({exc})"
    try:
        import h5py

        cfg = h5py.get_config()
        out["h5py MPI support"] = str(bool(cfg.mpi))
        out["HDF5"] = ".".join(map(str, h5py.version.hdf5_version_tuple))
    except Exception as exc:  # noqa: BLE001
        out["h5py MPI support"] = f"unknown ({exc})"
    return out


def settings() -> dict[str, list[tuple[str, str, str]]]:
    """``info``'s settings sections: section title -> ``(variable, value, source)`` rows, the
    source "default" or "environment". Internal switches appear only when set."""
    rows = _config.listing()
    internal = {s.name for s in _config.internal_switches()}
    return {"settings (HPCDP_* environment variables)": [r for r in rows if r[0] not in internal],
            "internal switches set (tests and benchmarks; not settings)":
                [r for r in rows if r[0] in internal]}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hpcdp",
        description="hpcdp: distributed training on HPC clusters (MPI, TCP sockets, simulated ranks).",
        epilog="Related commands: 'hpcdp-run' (or 'python -m hpcdp.run') launches N ranks; "
               "'python -m hpcdp.bench --help' lists the benchmarks; 'python -m hpcdp.trace --help' "
               "reads flight records and timelines.")
    p.add_argument("--version", action="version", version=f"hpcdp {__version__}",
                   help="print the hpcdp version and exit")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{info}", title="commands",
                           help="'python -m hpcdp COMMAND --help' describes one")
    sub.add_parser("info", help="versions, MPI library, CUDA-awareness, h5py MPI support, backends, "
                                "settings",
                   description="Print what a bug report needs: hpcdp, Python, numpy, mpi4py, h5py and "
                               "cupy versions, the MPI library and its thread level and CUDA-awareness, "
                               "whether h5py was built with MPI, the backends available here, and "
                               "every HPCDP_* setting with its value and its source (default or "
                               "environment).")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.cmd == "info":
        rows = info()
        width = max(map(len, rows))
        for k, v in rows.items():
            print(f"{k:<{width}} : {v}")
        for title, found in settings().items():
            if not found:
                continue
            print(f"\n{title}")
            name_w = max(len(name) for name, _, _ in found)
            for name, value, src in found:
                print(f"  {name:<{name_w}} : {value}  [{src}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
