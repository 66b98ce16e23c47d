# hpcdp developer Makefile.
#
#   make demo     DDP example on 4 MPI ranks
#   make test     whole test suite: single process, mpirun -n 2 and -n 4, jobs/ under Slurm, then
#                 the simulated multi-node cluster
#   make help     every target
#
# Works as root with no stdin (CI runs `bash .ci/run` on a fresh clone).
# Every target that needs Python depends on `install`, which is idempotent: a second run only
# checks stamp files under .venv/ and takes about a second.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help
MAKEFLAGS += --no-print-directory

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
CONSTRAINTS := $(VENV)/constraints.txt
# -c: every pip call in the venv obeys the pins below (written to $(CONSTRAINTS)).
PIP    := $(PY) -m pip --disable-pip-version-check
PIP_I  := $(PIP) install --progress-bar off -c $(CONSTRAINTS)

# ---------------------------------------------------------------------------------------------
# Pinned versions, verified together on Debian 12 / Python 3.11 / Open MPI 4.1.4 /
# HDF5 1.10.8 (libhdf5-openmpi-dev).  Changing a pin rewrites $(CONSTRAINTS), which re-runs the
# install steps that depend on it.
# ---------------------------------------------------------------------------------------------
PINS := \
  numpy==2.4.6 \
  mpi4py==4.1.2 \
  h5py==3.16.0 \
  Cython==3.3.1 \
  pkgconfig==1.6.0 \
  setuptools==84.2.1 \
  wheel==0.48.0 \
  packaging==26.3 \
  pytest==9.2.0 \
  pytest-mpi==0.6 \
  pytest-timeout==2.4.0 \
  pytest-xdist==3.8.0 \
  execnet==2.1.2 \
  scikit-learn==1.9.1 \
  scipy==1.17.1 \
  tqdm==4.70.1 \
  crc32c==2.9.post0 \
  xxhash==4.1.0 \
  msgpack==1.2.4 \
  matplotlib==3.11.2
H5PY_VERSION := $(patsubst h5py==%,%,$(filter h5py==%,$(PINS)))
# torch (CPU build) serves the torch adapter (hpcdp.nn.from_torch, DDP/FSDP/pipelines of torch
# models), its tests and examples, and the gloo baselines of the benchmarks.  `make test`,
# `make demo-torch` and `make bench` install it; `make install` and `make demo` do not.  Pinned:
# pip takes this version from the wheel on local disk, while an unpinned "torch" would download
# a CUDA build of several GB.
TORCH_VERSION := 2.13.0

# System packages (Debian/Ubuntu).  libhdf5-openmpi-dev brings the parallel HDF5 that h5py is
# built against; pkg-config lets h5py's build find it (HDF5_PKGCONFIG_NAME below).
APT_PKGS := openmpi-bin libopenmpi-dev libhdf5-openmpi-dev pkg-config

# h5py is built from source against the system's parallel HDF5 (PyPI's h5py wheels are serial).
# The built wheel is kept in this directory, outside the repo, so that a fresh clone installs it in
# seconds.  The sub-directory names the HDF5 version it was built against.
WHEELHOUSE ?= $(HOME)/.cache/hpcdp/wheels

# ---------------------------------------------------------------------------------------------
# Open MPI settings, exported to every recipe (so also to mpirun inside tests).
# - Open MPI refuses to start as root unless both of these are set (CI and containers run as root).
# - Oversubscribe: tests start more ranks than this machine has cores (also passed as a flag).
#   The PRTE variable is the Open MPI 5 spelling; Open MPI 4 ignores it.
# - Shared-memory single-copy (CMA) works in this container (checked with 64 MiB Send/Recv and
#   Allreduce between 4 ranks); in a container without CAP_SYS_PTRACE Open MPI 4 prints
#   "vader ... single-copy mechanism" errors: then run with
#       make test OMPI_MCA_btl_vader_single_copy_mechanism=none
# ---------------------------------------------------------------------------------------------
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export OMPI_MCA_rmaps_base_oversubscribe := 1
export PRTE_MCA_rmaps_default_mapping_policy := :oversubscribe
ifdef OMPI_MCA_btl_vader_single_copy_mechanism
export OMPI_MCA_btl_vader_single_copy_mechanism
endif

# A hang must never eat CI's time budget: every mpirun runs under coreutils timeout
# (TERM after MPI_TIMEOUT seconds, KILL 30 s later).  pytest-timeout (300 s per test) fires first.
MPI_TIMEOUT ?= 900
MPIRUN := timeout --kill-after=30 $(MPI_TIMEOUT) mpirun --oversubscribe

PYTEST_ARGS ?=
# Stage [1/5] of `make test` runs on this many pytest-xdist workers: its tests spend much of
# their time waiting (timeouts, spawned ranks, launched jobs), so two overlap well even on two
# cores.  PYTEST_WORKERS=0 runs it in one process.
PYTEST_WORKERS ?= 2

.PHONY: help install sysdeps check test test-slurm test-multinode test-fast test-single test-mpi test-gpu gpu-wheels demo demo-collectives demo-fsdp demo-pipeline demo-torch torch bench-deps \
        bench info clean distclean

help:
	@echo "hpcdp make targets"
	@echo "  make demo              DDP training example on 4 MPI ranks (examples/02_ddp_train.py)"
	@echo "  make test              whole suite: pytest, then mpirun -n 2 and -n 4 (--with-mpi)"
	@echo "  make test-fast         single-process pytest only (sim + TCP backends)"
	@echo "  make test-mpi          only the MPI runs (-n 2 and -n 4)"
	@echo "  make test-slurm        every jobs/*.sbatch under a real one-node Slurm (sbatch --wait)"
	@echo "  make test-multinode    a simulated 2-node cluster (namespaces): mpirun, hpcdp-run, Slurm across nodes"
	@echo "  make test-gpu          the GPU check on a machine with CUDA + cupy (ci/gpu/run.sh; GPU_ARGS=--dry-run)"
	@echo "  make gpu-wheels        fetch the wheels test-gpu may need on an offline GPU machine into .whl/"
	@echo "  make demo-collectives  collectives tour on 4 MPI ranks (examples/01_collectives.py)"
	@echo "  make demo-fsdp         GPT with FSDP full_shard on 4 MPI ranks (examples/03_fsdp_gpt.py)"
	@echo "  make demo-pipeline     GPT in 4 pipeline stages on 4 MPI ranks (examples/04_pipeline_gpt.py)"
	@echo "  make install           .venv with MPI-enabled h5py, mpi4py and hpcdp (editable, [dev,examples])"
	@echo "  make check             verify parallel h5py and that mpirun ranks see one MPI world"
	@echo "  make demo-torch        a torch CNN on digits: hpcdp.DDP, then FSDP, on 4 MPI ranks (examples/07_torch_cnn.py)"
	@echo "  make torch             install torch $(TORCH_VERSION) (CPU): the adapter's tests, examples and baselines"
	@echo "  make bench             every PERF.md benchmark vs its baseline (JSON in .bench/; BENCH_ARGS=...)"
	@echo "  make clean|distclean   remove caches | also the venv"

# ---------------------------------------------------------------------------------------------
# install
# ---------------------------------------------------------------------------------------------
install: $(VENV)/.stamp-pkg

# System packages: checked with dpkg-query every time (about 50 ms); apt-get runs only when
# something is missing.  A C compiler is needed by mpicc to build h5py.
sysdeps:
	@missing=""; \
	for p in $(APT_PKGS); do \
	  dpkg-query -W -f='$${Status}' "$$p" 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	command -v gcc >/dev/null 2>&1 || missing="$$missing gcc"; \
	if [ -n "$$missing" ]; then \
	  echo "sysdeps: installing$$missing"; \
	  sudo=""; [ "$$(id -u)" = 0 ] || sudo="sudo -n"; \
	  $$sudo apt-get update -qq </dev/null; \
	  DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y --no-install-recommends $$missing </dev/null; \
	fi

$(PY): | sysdeps
	$(PYTHON) -m venv $(VENV)

# The constraints file is rewritten only when the pins change, so its mtime tracks the pins.
$(CONSTRAINTS): Makefile | $(PY)
	@printf '%s\n' $(PINS) > $@.tmp
	@if cmp -s $@.tmp $@; then rm -f $@.tmp; else mv $@.tmp $@; echo "pins -> $@"; fi

# Build tools and the binary wheels h5py's build needs.
# mpi4py: PyPI's binary wheel (4.1.x) carries two builds of mpi4py.MPI, one for the MPICH ABI
# (libmpi.so.12) and one for the Open MPI ABI (libmpi.so.40), and picks one at import from the
# libmpi.so it finds (Debian's `mpi` alternative; MPI4PY_MPIABI=openmpi or MPI4PY_LIBMPI=<path>
# override).  With Debian's Open MPI 4.1.4, `mpirun -n 2` gives ranks 0 and 1 of one world of
# size 2 (`make check` asserts it), so mpi4py is not compiled from source (minutes of compiling).
# If a machine with both MPICH and Open MPI ever shows singletons of size 1, build it instead:
#   CC=mpicc CFLAGS="-O1 -g0" pip install --no-binary=mpi4py mpi4py
$(VENV)/.stamp-build: $(CONSTRAINTS) | $(PY)
	$(PIP_I) -q setuptools wheel packaging Cython pkgconfig numpy mpi4py
	@touch $@

# h5py against parallel HDF5.  Why it is done this way:
# - A plain `HDF5_MPI=ON pip install --no-binary=h5py h5py` builds in an isolated environment, and
#   h5py's build backend then asks for mpi4py==4.0.0 (its oldest supported), which pip compiles
#   from source: one compiler process of that build grew past 20 GiB of memory here (24 GiB
#   machine).  --no-build-isolation builds against the mpi4py wheel (and Cython, numpy,
#   pkgconfig, setuptools) already in the venv instead: about 60-90 s, peak RSS under 0.5 GiB.
# - CC=mpicc and HDF5_PKGCONFIG_NAME=hdf5-openmpi select the MPI compiler and the parallel HDF5
#   (Debian installs serial and parallel HDF5 side by side).  -O1 -g0 keeps the compile quick and
#   small; h5py's hot paths are in HDF5 itself, not in the Cython glue.
# - The wheel is built with `pip wheel` into $(WHEELHOUSE)/hdf5-openmpi-<version>/ and installed
#   from there by file name (not by requirement, which could pick a serial manylinux wheel from an
#   index or find-links directory), so a fresh clone (CI) reuses it in seconds.  It is built with
#   --no-cache-dir: pip's own wheel cache is keyed by the sdist URL, not by HDF5_MPI, so it could
#   hand back a serial h5py built earlier by someone else.
# - Every install is checked with h5py.get_config().mpi; a wheel that fails the check (or no longer
#   imports, e.g. after a system HDF5 change) is removed and rebuilt once.
$(VENV)/.stamp-h5py: $(VENV)/.stamp-build
	@hdf5v=$$(pkg-config --modversion hdf5-openmpi); \
	wh="$(WHEELHOUSE)/hdf5-openmpi-$$hdf5v"; mkdir -p "$$wh"; \
	check() { $(PY) -c "import h5py, sys; sys.exit(0 if h5py.get_config().mpi else 1)" 2>/dev/null; }; \
	whl() { compgen -G "$$wh/h5py-$(H5PY_VERSION)-*.whl" | head -n1; }; \
	install_cached() { [ -n "$$(whl)" ] && $(PIP_I) -q --no-deps --force-reinstall "$$(whl)"; }; \
	if install_cached && check; then \
	  echo "h5py $(H5PY_VERSION): installed MPI build from $$wh"; \
	else \
	  rm -f "$$wh"/h5py-*.whl; \
	  echo "h5py $(H5PY_VERSION): building against parallel HDF5 $$hdf5v (about 1-2 minutes)"; \
	  CC=mpicc HDF5_MPI=ON HDF5_PKGCONFIG_NAME=hdf5-openmpi CFLAGS="-O1 -g0" H5PY_SETUP_REQUIRES=0 \
	    $(PIP) wheel -q --no-cache-dir --no-deps --no-build-isolation --no-binary=h5py \
	      -c $(CONSTRAINTS) -w "$$wh" "h5py==$(H5PY_VERSION)"; \
	  install_cached; \
	  check || { echo "h5py was built without MPI support" >&2; exit 1; }; \
	fi
	@touch $@

# hpcdp itself, editable, with the test and example dependencies (torch: the `torch` target).
# --no-build-isolation: setuptools is already in the venv; saves a download and ~5 s per run.
$(VENV)/.stamp-pkg: $(VENV)/.stamp-h5py setup.cfg pyproject.toml
	$(PIP_I) -q --no-build-isolation -e ".[dev,examples]"
	@touch $@

# Checks the two things that break silently: h5py without MPI, and mpi4py loading a different MPI
# than mpirun's (each rank would then be a singleton of size 1).
check: install
	$(PY) -c "import h5py, mpi4py; assert h5py.get_config().mpi, 'h5py lacks MPI'; \
	  print('h5py', h5py.__version__, 'HDF5', h5py.version.hdf5_version, 'mpi=True; mpi4py', mpi4py.__version__)"
	$(MPIRUN) -n 2 $(PY) -c "from mpi4py import MPI; c = MPI.COMM_WORLD; \
	  assert c.Get_size() == 2, 'rank is a singleton: mpi4py loaded another MPI than mpirun'; \
	  print(c.Get_rank(), c.Get_size(), MPI.Get_library_version()[:40])"

# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------
# Each stage's output is also written to .pytest-mpi/<stage>.out; the last line printed is a
# combined count over all stages ("make test: N passed, M failed").  All stages run even when one
# fails; the target fails if any did.  Every stage collects tests/ and its layer folders
# (tests/README.md).  --min-tests: a bit below the MPI tests that run on each rank (182 at -n 2,
# 185 at -n 4 when last raised), so a broken collection cannot pass for a green stage.
define SUMMARY_PY
import re, sys
ansi = re.compile(r"\x1b\[[0-9;]*m")
summary = re.compile(r"\d+ (passed|failed|errors?|skipped|deselected)|no tests ran")
passed = failed = 0
for arg in sys.argv[1:]:
    path, _, rc = arg.rpartition(":")
    try:
        text = open(path, errors="replace").read()
    except OSError:
        text = ""
    # Rank 0's lines, and each failed rank's log that run_mpi.py copied in between markers.
    outputs, block = {"rank 0": []}, "rank 0"
    for line in ansi.sub("", text.replace("\0", "")).splitlines():
        if line.startswith("===== rank "):
            block = line.split(":")[0].strip("= ")
            outputs[block] = []
        elif line.startswith("===== end of rank"):
            block = "rank 0"
        else:
            outputs[block].append(line)
    stats = {}
    for who, lines in outputs.items():
        last = next((l for l in reversed(lines) if summary.search(l)), None)
        if last is not None:
            stats[who] = (last.strip("= "), {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|errors?)", last)})
    p = min((c.get("passed", 0) for _, c in stats.values()), default=0)
    f = max((c.get("failed", 0) + c.get("error", 0) + c.get("errors", 0) for _, c in stats.values()), default=0)
    if rc != "0" and f == 0:
        f = 1   # crashed, aborted or timed out without a pytest failure count
    passed += p
    failed += f
    shown = stats.get("rank 0", ("(no pytest summary)",))[0]
    if rc in ("124", "137"):
        shown += f" (killed by timeout after MPI_TIMEOUT s)"
    others = "".join(f"; {who}: {s}" for who, (s, _) in stats.items() if who != "rank 0")
    print(f"  {path.split('/')[-1].rsplit('.', 1)[0]:<7} rc={rc:<3} {shown}{others}")
print(f"make test: {passed} passed, {failed} failed")
endef
export SUMMARY_PY

test: install torch
	@mkdir -p .pytest-mpi; rm -f .pytest-mpi/*.out; start=$$(date +%s); \
	echo "== [1/5] pytest (no mpirun: sim + TCP backends, fault tests; $(PYTEST_WORKERS) workers)"; \
	rc1=0; $(PY) -m pytest -q -m "not mpi" -n $(PYTEST_WORKERS) tests $(PYTEST_ARGS) 2>&1 | tee .pytest-mpi/single.out || rc1=$$?; \
	echo "== [2/5] mpirun -n 2 pytest --with-mpi -m mpi"; \
	rc2=0; PY_COLORS=0 $(MPIRUN) -n 2 $(PY) tests/run_mpi.py --min-tests 165 $(PYTEST_ARGS) 2>&1 | tee .pytest-mpi/mpi2.out || rc2=$$?; \
	echo "== [3/5] mpirun -n 4 pytest --with-mpi -m mpi"; \
	rc3=0; PY_COLORS=0 $(MPIRUN) -n 4 $(PY) tests/run_mpi.py --min-tests 165 $(PYTEST_ARGS) 2>&1 | tee .pytest-mpi/mpi4.out || rc3=$$?; \
	echo "== [4/5] make test-slurm: every jobs/*.sbatch under a real one-node Slurm"; \
	rc4=0; ci/slurm/test.sh 2>&1 | tee .pytest-mpi/slurm.out || rc4=$$?; \
	echo "== [5/5] make test-multinode: a simulated cluster of $(MN_NODES) nodes (ci/multinode)"; \
	rc5=0; HPCDP_MN_NODES=$(MN_NODES) ci/multinode/test.sh 2>&1 | tee .pytest-mpi/multinode.out || rc5=$$?; \
	echo "== summary ($$(( $$(date +%s) - start )) s)"; \
	$(PY) -c "$$SUMMARY_PY" .pytest-mpi/single.out:$$rc1 .pytest-mpi/mpi2.out:$$rc2 .pytest-mpi/mpi4.out:$$rc3 \
	  .pytest-mpi/slurm.out:$$rc4 .pytest-mpi/multinode.out:$$rc5; \
	[ $$rc1 = 0 ] && [ $$rc2 = 0 ] && [ $$rc3 = 0 ] && [ $$rc4 = 0 ] && [ $$rc5 = 0 ]

# Every jobs/*.sbatch under a real one-node Slurm (ci/slurm/README.md): installs slurm-wlm and
# munge when missing, starts munged, slurmctld and slurmd as root, submits each job with
# `sbatch --wait`, checks its exit code and output, and stops the daemons it started.  Where the
# machine cannot run them (not root, no apt, daemons refused) it says so and fails: never skips.
test-slurm: install torch
	ci/slurm/test.sh

# A simulated cluster of MN_NODES (2-4) nodes on this one kernel (ci/multinode/README.md): network,
# UTS and mount namespaces joined by a bridge on 10.213.0.0/24, removed afterwards (also on failure
# or Ctrl-C).  Runs tests/multinode under mpirun --host, hpcdp-run --nnodes and a per-node slurmd
# (sbatch --nodes=2), every jobs/*.sbatch on 2 nodes, and cuts a node's link mid-step.  Needs root.
MN_NODES ?= 2
test-multinode: install torch
	HPCDP_MN_NODES=$(MN_NODES) ci/multinode/test.sh

test-fast test-single: install torch
	$(PY) -m pytest -q -m "not mpi" -n $(PYTEST_WORKERS) tests $(PYTEST_ARGS)

test-mpi: install torch
	$(MPIRUN) -n 2 $(PY) tests/run_mpi.py $(PYTEST_ARGS)
	$(MPIRUN) -n 4 $(PY) tests/run_mpi.py $(PYTEST_ARGS)

# The GPU check, for a lent GPU machine (README, "GPUs"): no `install` dependency, on purpose.
# That machine is bare and offline: its own Python (with CUDA, cupy, mpi4py) runs hpcdp from the
# working tree, and ci/gpu/run.sh installs only wheels carried in .whl/.  `make test` runs the
# same script with --dry-run on the numpy stand-in for cupy (tests/project/test_gpu_script.py).
GPU_PYTHON ?= python3
test-gpu:
	PYTHON=$(GPU_PYTHON) bash ci/gpu/run.sh $(GPU_ARGS)

# The wheels test-gpu may need there (Python 3.12, manylinux x86-64), fetched here into .whl/.
gpu-wheels:
	@mkdir -p .whl
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  --platform manylinux1_x86_64 --platform any -d .whl openmpi mpich pytest-mpi crc32c

# ---------------------------------------------------------------------------------------------
# examples, benchmarks
# ---------------------------------------------------------------------------------------------
demo: install
	$(MPIRUN) -n 4 $(PY) -m hpcdp.run examples/02_ddp_train.py

demo-collectives: install
	$(MPIRUN) -n 4 $(PY) -m hpcdp.run examples/01_collectives.py

# A char-level GPT trained with FSDP (full_shard, one unit per block) on 4 MPI ranks.
demo-fsdp: install
	$(MPIRUN) -n 4 $(PY) -m hpcdp.run examples/03_fsdp_gpt.py

# A char-level GPT split into 4 pipeline stages (1F1B), checked against the unpipelined model.
demo-pipeline: install
	$(MPIRUN) -n 4 $(PY) -m hpcdp.run examples/04_pipeline_gpt.py --check

# A torch CNN on digits (examples/07_torch_cnn.py): hpcdp.DDP, then FSDP full_shard, 4 MPI ranks.
demo-torch: install torch
	$(MPIRUN) -n 4 $(PY) -m hpcdp.run examples/07_torch_cnn.py --check
	$(MPIRUN) -n 4 $(PY) -m hpcdp.run examples/07_torch_cnn.py --check --parallel fsdp --strategy full_shard

info: install
	$(PY) -m hpcdp info

# torch comes from the CPU wheel on local disk (pip's find-links); see TORCH_VERSION above.
torch bench-deps: $(VENV)/.stamp-torch

$(VENV)/.stamp-torch: $(VENV)/.stamp-pkg
	$(PIP_I) "torch==$(TORCH_VERSION)"
	@touch $@

# Every benchmark of PERF.md, each against its baseline in the same run; JSON lines go to
# $(BENCH_OUT)/.  Gated figures run on 2 ranks bound to cores (PERF.md); the checkpoint runs at 4
# ranks too, as its issue asks.  One benchmark alone: make bench BENCH_ARGS="ddp --trials 9".
BENCH_ARGS ?=
BENCH_OUT ?= .bench
bench: torch
	@mkdir -p $(BENCH_OUT)
ifeq ($(strip $(BENCH_ARGS)),)
	$(MPIRUN) -n 2 --bind-to core $(PY) -m hpcdp.bench collectives --json $(BENCH_OUT)/collectives.jsonl
	$(MPIRUN) -n 2 --bind-to core $(PY) -m hpcdp.bench collectives --import-order mpi4py-first \
	  --json $(BENCH_OUT)/collectives-mpi4py-first.jsonl
	$(PY) -m hpcdp.bench collectives --backend tcp --json $(BENCH_OUT)/tcp.jsonl
	$(PY) -m hpcdp.bench collectives --backend sim --json $(BENCH_OUT)/sim.jsonl
	$(MPIRUN) -n 2 --bind-to core $(PY) -m hpcdp.bench ddp --json $(BENCH_OUT)/ddp.jsonl
	OMP_NUM_THREADS=1 $(MPIRUN) -n 2 --bind-to core $(PY) -m hpcdp.bench torch --json $(BENCH_OUT)/torch.jsonl
	$(MPIRUN) -n 2 --bind-to core $(PY) -m hpcdp.bench checkpoint --json $(BENCH_OUT)/checkpoint-2.jsonl
	$(MPIRUN) -n 4 $(PY) -m hpcdp.bench checkpoint --json $(BENCH_OUT)/checkpoint-4.jsonl
	$(MPIRUN) -n 2 --bind-to core $(PY) -m hpcdp.bench fsdp --json $(BENCH_OUT)/fsdp.jsonl
	$(PY) -m hpcdp.bench pipeline --json $(BENCH_OUT)/pipeline.jsonl
	$(MPIRUN) -n 2 --bind-to core $(PY) -m hpcdp.bench rpc --json $(BENCH_OUT)/rpc.jsonl
	$(PY) -m hpcdp.bench rpc --backend tcp --json $(BENCH_OUT)/rpc-tcp.jsonl
	$(MPIRUN) -n 2 --bind-to core $(PY) -m hpcdp.bench trace --json $(BENCH_OUT)/trace.jsonl
	$(MPIRUN) -n 4 $(PY) -m hpcdp.bench p2p --json $(BENCH_OUT)/p2p.jsonl
	OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 $(MPIRUN) -n 2 --bind-to core $(PY) -m hpcdp.bench determinism \
	  --part H1,H2 --json $(BENCH_OUT)/determinism.jsonl
	OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 $(PY) -m hpcdp.bench determinism --part check \
	  --json $(BENCH_OUT)/determinism-check.jsonl
	$(PY) -m hpcdp.trace plot-bench $(BENCH_OUT)/*.jsonl -o $(BENCH_OUT)/bench.png
	$(PY) -m hpcdp.bench report $(BENCH_OUT)/*.jsonl
else
	$(MPIRUN) -n 2 --bind-to core $(PY) -m hpcdp.bench $(BENCH_ARGS)
endif

clean:
	rm -rf .pytest-mpi .pytest_cache build dist *.egg-info
	find . -name __pycache__ -type d -not -path "./$(VENV)/*" -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
