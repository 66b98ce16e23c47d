# Shared by ci/slurm/*.sh (sourced, not run): where the CI cluster lives and how to reach it.
# shellcheck shell=bash

# Everything the cluster writes: config, daemon state and logs, pid files, job output.
HPCDP_SLURM_DIR="${HPCDP_SLURM_DIR:-/tmp/hpcdp-slurm-ci}"
STATE="$HPCDP_SLURM_DIR"
export SLURM_CONF="$STATE/slurm.conf"
MUNGE_SOCKET="$STATE/munge/munge.socket.2"
# Ports of this cluster (Slurm's defaults); override when another Slurm already uses them.
CTLD_PORT="${HPCDP_SLURM_CTLD_PORT:-6817}"
SLURMD_PORT="${HPCDP_SLURM_SLURMD_PORT:-6818}"
# CPUs the node declares: more than the machine has, so 4-rank jobs fit on a 2-core box.
NODE_CPUS="${HPCDP_SLURM_CPUS:-8}"
NODE="$(hostname -s)"
CI_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$CI_DIR/../.." && pwd)"

say() { printf '%s\n' "slurm-ci: $*" >&2; }
die() { say "FAIL: $*"; exit 1; }

# True when the daemon whose pid file is $1 is alive and was started with this cluster's $STATE.
ours_alive() {
    local pid
    pid="$(cat "$1" 2>/dev/null)" || return 1
    [[ "$pid" =~ ^[0-9]+$ ]] || return 1
    local cmdline  # (not `tr | grep -q`: under pipefail, grep's early exit can fail tr)
    cmdline="$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null)" || return 1
    [[ $cmdline == *"$STATE/"* ]] || return 1
    printf '%s' "$pid"
}

# Run as root: re-run this script through passwordless sudo, or fail saying why.
need_root() {
    [ "$(id -u)" = 0 ] && return 0
    if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
        exec sudo -n -E "$0" "$@"
    fi
    die "needs root (or passwordless sudo) to install slurm-wlm/munge and to run munged, slurmctld and slurmd; this machine cannot, so the Slurm tests cannot run here"
}
