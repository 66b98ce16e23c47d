#!/usr/bin/env bash
# Stop the CI cluster that ci/slurm/start.sh started: cancel its jobs, then TERM (and, after 10 s,
# KILL) slurmd, slurmctld and munged, each found by its pid file and checked to be ours.
#
#   ci/slurm/stop.sh [--quiet]
set -euo pipefail
# shellcheck source=ci/slurm/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
quiet=0
[ "${1:-}" = --quiet ] && quiet=1
need_root "$@"

if ours_alive "$STATE/slurmctld.pid" >/dev/null && [ -f "$SLURM_CONF" ]; then
    # Jobs still running would leave their slurmstepd and ranks behind once slurmd is gone.
    if [ -n "$(squeue -h -o %i 2>/dev/null)" ]; then
        scancel --full --quiet $(squeue -h -o %i) 2>/dev/null || true
        for _ in $(seq 1 40); do
            [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break
            sleep 0.5
        done
    fi
fi

stopped=()
for d in slurmd slurmctld munged; do
    pid="$(ours_alive "$STATE/$d.pid")" || continue
    kill -TERM "$pid" 2>/dev/null || continue
    for _ in $(seq 1 100); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then
        kill -KILL "$pid" 2>/dev/null || true
    fi
    stopped+=("$d($pid)")
done
if ((${#stopped[@]})); then
    say "stopped ${stopped[*]}"
elif ((!quiet)); then
    say "no daemons of this cluster were running"
fi
