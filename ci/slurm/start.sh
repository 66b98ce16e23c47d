#!/usr/bin/env bash
# Start a single-node Slurm cluster (munged, slurmctld, slurmd) for CI, installing Debian's
# slurm-wlm and munge first when missing.  Idempotent: a cluster this script started before (even
# one left behind by a killed run) is stopped and replaced by a fresh one.
#
#   ci/slurm/start.sh && SLURM_CONF=/tmp/hpcdp-slurm-ci/slurm.conf sinfo
#
# Needs root.  Fails, saying why, where the packages cannot be installed or the daemons do not
# come up (e.g. a sandbox that forbids them): it never skips.
set -euo pipefail
# shellcheck source=ci/slurm/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
need_root "$@"
t0=$SECONDS

# -- packages ---------------------------------------------------------------------------------
PKGS=(slurm-wlm munge)
missing=()
for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    command -v apt-get >/dev/null || die "apt-get not found: install ${missing[*]} by hand"
    say "installing ${missing[*]} (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    apt_opts=(-q -y -o DPkg::Lock::Timeout=300)
    apt-get "${apt_opts[@]}" update </dev/null >/dev/null || die "apt-get update failed"
    apt-get "${apt_opts[@]}" install --no-install-recommends "${missing[@]}" </dev/null >/dev/null \
        || die "apt-get install ${missing[*]} failed"
fi
for b in munged slurmctld slurmd sbatch scontrol sinfo; do
    command -v "$b" >/dev/null || die "$b not found after installing ${PKGS[*]}"
done

# -- a clean slate ----------------------------------------------------------------------------
"$CI_DIR/stop.sh" --quiet
for port in "$CTLD_PORT" "$SLURMD_PORT"; do
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
        die "port $port is in use (another Slurm?); set HPCDP_SLURM_CTLD_PORT/HPCDP_SLURM_SLURMD_PORT"
    fi
done
rm -rf "$STATE"
mkdir -p "$STATE"/{ctld,spool,log,munge,out}
chmod 700 "$STATE" "$STATE/munge"

# -- munged: our own key and socket, so a system munged (if any) is left alone -----------------
head -c 1024 /dev/urandom >"$STATE/munge/munge.key"
chmod 400 "$STATE/munge/munge.key"
munged --force --socket="$MUNGE_SOCKET" --key-file="$STATE/munge/munge.key" \
    --pid-file="$STATE/munged.pid" --log-file="$STATE/log/munged.log" \
    --seed-file="$STATE/munge/munged.seed" \
    || die "munged did not start (this machine cannot run it?): $(tail -n 5 "$STATE/log/munged.log" 2>/dev/null)"

# -- slurm.conf from the template -------------------------------------------------------------
sed -e "s|@NODE@|$NODE|g" -e "s|@STATE@|$STATE|g" -e "s|@CPUS@|$NODE_CPUS|g" \
    -e "s|@CTLD_PORT@|$CTLD_PORT|g" -e "s|@SLURMD_PORT@|$SLURMD_PORT|g" \
    -e "s|@MUNGE_SOCKET@|$MUNGE_SOCKET|g" -e "s|@MEM_MB@|1024|g" \
    "$CI_DIR/slurm.conf.in" >"$SLURM_CONF"

show_logs() {
    for f in "$STATE"/log/*.log; do
        say "--- last lines of $f"
        tail -n 15 "$f" >&2 || true
    done
}

slurmctld -f "$SLURM_CONF" || { show_logs; die "slurmctld did not start"; }
slurmd -f "$SLURM_CONF" || { show_logs; die "slurmd did not start"; }

# -- wait until the node takes jobs ------------------------------------------------------------
deadline=$((SECONDS + 60))
state=""
while ((SECONDS < deadline)); do
    state="$(sinfo -h -n "$NODE" -o %t 2>/dev/null || true)"
    [ "$state" = idle ] && break
    for d in munged slurmctld slurmd; do
        ours_alive "$STATE/$d.pid" >/dev/null || { show_logs; die "$d exited while starting up"; }
    done
    sleep 0.5
done
if [ "$state" != idle ]; then
    show_logs
    die "node $NODE is '${state:-unreachable}' 60 s after starting the daemons (this machine cannot run them?)"
fi
say "cluster up in $((SECONDS - t0)) s: node $NODE, $NODE_CPUS CPUs, SLURM_CONF=$SLURM_CONF"
