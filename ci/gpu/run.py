"""The GPU check's steps, each under a time cap; a log and report.json under one folder.

Called by ``ci/gpu/run.sh`` (which installs carried wheels first). Steps:

1. ``found``: the GPU, its driver, cupy, torch, the MPI library, and whether it is CUDA-aware
   (``hpcdp.backends.mpi._staging``'s functional probe).
2. ``cupy-single``: ``tests/backends/test_cupy.py`` in one process: every collective on simulated and TCP
   ranks against numpy, host staging, DDP/FSDP training with cupy parameters against numpy,
   checkpoints cupy -> numpy -> cupy, torch CUDA tensors through collectives.
3. ``cupy-mpi2``: the same file's MPI tests under ``mpirun -n 2``, CUDA-aware and staged.
4. ``bench``: ``python -m hpcdp.bench gpu`` under ``mpirun -n 2``: A6, staging overhead per size,
   DDP/FSDP step time on cupy against numpy on the CPU.

With ``--dry-run`` the steps run on the numpy stand-in for cupy (``hpcdp.testing.cupy_stand_in``),
fewer and smaller, so that ``make test`` keeps this script working on machines without a GPU.
Exit status: 0 when every step passed, else 1.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

_FOUND = r"""
import json, subprocess
out = {}
def attempt(key, fn):
    try:
        out[key] = fn()
    except Exception as exc:
        out[key] = f"unavailable ({type(exc).__name__}: {str(exc)[:160]})"
def smi():
    r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                        "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    return r.stdout.strip() or r.stderr.strip()
attempt("gpu", smi)
def cupy_info():
    import cupy
    props = cupy.cuda.runtime.getDeviceProperties(0)
    return {"version": cupy.__version__, "device": props["name"].decode(),
            "compute_capability": f"{props['major']}.{props['minor']}",
            "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
            "cuda_driver": cupy.cuda.runtime.driverGetVersion(), "stand_in": False}
def stand_in():
    from hpcdp.testing.cupy_stand_in import install_stand_in
    install_stand_in()
    return {"version": "stand-in (numpy)", "stand_in": True}
attempt("cupy", stand_in if DRY else cupy_info)
def torch_info():
    import torch
    return {"version": torch.__version__, "cuda": torch.cuda.is_available()}
attempt("torch", torch_info)
def mpi_info():
    import mpi4py
    from mpi4py import MPI
    return {"mpi4py": mpi4py.__version__, "library": MPI.Get_library_version().splitlines()[0].strip(),
            "standard": "%d.%d" % MPI.Get_version()}
attempt("mpi", mpi_info)
def aware():
    from hpcdp.backends.mpi import describe
    return describe()
attempt("cuda_aware", aware)
import numpy, h5py
out["numpy"] = numpy.__version__
out["h5py"] = f"{h5py.__version__} (mpi={h5py.get_config().mpi})"
print("FOUND " + json.dumps(out))
"""


def _run(name: str, cmd: list[str], cap: float, env: dict[str, str], log: Any,
         shown: str | None = None) -> dict[str, Any]:
    """``cmd`` under a wall-clock cap (its whole process group killed there); its output to the
    log and the screen."""
    shown = shown or " ".join(cmd)
    print(f"\n== [{name}] {shown}  (cap {cap:g} s)", flush=True)
    log.write(f"\n== [{name}] {shown}\n")
    t0 = time.monotonic()
    try:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, errors="replace", stdin=subprocess.DEVNULL,
                             start_new_session=True)
    except OSError as exc:
        return {"name": name, "rc": 127, "seconds": 0.0, "summary": f"could not start: {exc}"}
    lines: list[str] = []

    def pump() -> None:
        assert p.stdout is not None
        for line in p.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            log.write(line)
            lines.append(line.rstrip("\n"))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = p.wait(timeout=cap)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        rc = 124
    reader.join(10)
    log.flush()
    text = [re.sub(r"\x1b\[[0-9;]*m", "", ln) for ln in lines if ln.strip()]
    summary = next((ln.strip("= ") for ln in reversed(text)
                    if re.search(r"\d+ (passed|failed)|no tests ran", ln)), text[-1] if text else "")
    if rc == 124:
        summary = f"killed at its {cap:g} s cap; last: {summary}"
    return {"name": name, "rc": rc, "seconds": round(time.monotonic() - t0, 1), "summary": summary[:300],
            "output": lines}


def _mpirun(python: str, n: int) -> list[str] | None:
    exe = shutil.which("mpirun") or shutil.which("mpiexec")
    if exe is None:
        return None
    try:
        version = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        version = ""
    extra = ["--oversubscribe"] if "Open MPI" in version or "OpenRTE" in version else []
    return [exe, *extra, "-n", str(n), python]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ci/gpu/run.sh", description="hpcdp's GPU check")
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, ".gpu-report"))
    p.add_argument("--dry-run", action="store_true", help="numpy stand-in for cupy, fewer and smaller steps")
    p.add_argument("--python", default=sys.executable)
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    dry = args.dry_run
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("HPCDP_CUDA_AWARE", None)  # the probe decides; the tests set it where they need to
    if dry:
        env.pop("HPCDP_TEST_CUPY", None)
    else:
        env["HPCDP_TEST_CUPY"] = "real"  # a missing GPU fails the tests, never skips them
    t_start = time.monotonic()
    report: dict[str, Any] = {"dry_run": dry, "steps": [], "figures": []}
    bench_json = os.path.join(args.out, "bench.jsonl")
    if os.path.lexists(bench_json):
        os.unlink(bench_json)
    with open(os.path.join(args.out, "gpu-check.log"), "w") as log:
        found = _run("found", [args.python, "-c", f"DRY = {dry!r}\n" + _FOUND], 60, env, log,
                     shown="python -c <what is on this machine>")
        report["steps"].append(found)
        report["found"] = next((json.loads(ln[6:]) for ln in found["output"] if ln.startswith("FOUND ")), {})
        pytest = [args.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/backends/test_cupy.py"]
        if dry:
            pytest += ["-k", "every_collective and sim or host_staging or probe"]
        report["steps"].append(_run("cupy-single", pytest + ["-m", "not mpi"], 120 if dry else 180, env, log))
        mpirun = _mpirun(args.python, 2)
        if mpirun is None:
            report["steps"].append({"name": "cupy-mpi2", "rc": 127, "seconds": 0.0,
                                    "summary": "no mpirun/mpiexec on PATH"})
        else:
            report["steps"].append(_run("cupy-mpi2", mpirun + ["tests/run_mpi.py", "tests/backends/test_cupy.py"],
                                        120 if dry else 90, env, log))
            bench = ["-m", "hpcdp.bench", "gpu", "--json", bench_json]
            if dry:
                bench += ["--array", "stand-in", "--sizes", "4096,1048576", "--trials", "2",
                          "--steps", "2", "--hidden", "64"]
            report["steps"].append(_run("bench", mpirun + bench, 120 if dry else 150, env, log))
    if os.path.exists(bench_json):
        with open(bench_json) as f:
            report["figures"] = [json.loads(line) for line in f if line.strip()]
    report["seconds"] = round(time.monotonic() - t_start, 1)
    report["passed"] = all(s["rc"] == 0 for s in report["steps"])
    for s in report["steps"]:
        s.pop("output", None)
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    print("\n== GPU check summary" + (" (dry run: numpy stand-in)" if dry else ""))
    for k, v in report.get("found", {}).items():
        print(f"  {k:<11} {v}")
    for s in report["steps"]:
        print(f"  {s['name']:<12} rc={s['rc']:<4} {s['seconds']:>6.1f} s  {s['summary']}")
    for r in report["figures"]:
        if r.get("bench") == "summary":
            print(f"  {r['id']} {r.get('name', '')}: {r['value']:.3f} (target {r['target']}: "
                  f"{'met' if r['met'] else 'MISSED'})")
        elif r.get("bench") == "gpu" and r.get("id") == "A6":  # (not the summary record)
            print(f"  A6 {r['size']:>10} B  hpcdp {r['time_us']:.1f} us  base {r['base_time_us']:.1f} us"
                  f"  A6 {r['a6']:.3f}  staging x{r['staging_overhead']:.2f} vs hpcdp on host numpy"
                  f" (which is x{r['host_ratio']:.2f} mpi4py's)")
        elif r.get("id") == "train":
            print(f"  {r['strategy']:<10} step  numpy {r['numpy_ms']:.2f} ms  cupy {r['cupy_ms']:.2f} ms")
    print(f"  total {report['seconds']} s; report: {os.path.join(args.out, 'report.json')}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
