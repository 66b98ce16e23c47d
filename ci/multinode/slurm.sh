#!/usr/bin/env bash
# Slurm across the simulated nodes: munged and slurmctld on node 0, a slurmd on every node (each
# in its node's namespaces, so srun's steps and PMIx wire-up cross the simulated network).
#
#   ci/multinode/slurm.sh start     # after up.sh; then, on a node:
#   SLURM_CONF=/var/tmp/hpcdp-mn-ci/slurm/slurm.conf ci/multinode/on.sh hpcdp-n0 sinfo
#   ci/multinode/slurm.sh stop      # down.sh also stops them (every process of the nodes)
#
# Uses Debian's slurm-wlm and munge (ci/slurm/start.sh installs them when missing).
set -euo pipefail
# shellcheck source=ci/multinode/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
need_root "$@"
STATE="$MN_DIR/slurm"
export SLURM_CONF="$STATE/slurm.conf"
MUNGE_SOCKET="$STATE/munge/munge.socket.2"
CPUS="${HPCDP_MN_SLURM_CPUS:-4}"
node0="$(mn_node 0)"

show_logs() {
    local f
    for f in "$STATE"/log/*.log "$MN_DIR"/nodes/*/tmp/slurmd.log; do
        [ -f "$f" ] || continue
        mn_say "--- last lines of $f"
        tail -n 15 "$f" >&2 || true
    done
}

# TERM the daemons of this cluster (pid files), wait up to 10 s, then KILL what is left.
stop() {
    if [ -f "$SLURM_CONF" ] && [ -e "/run/netns/$node0" ]; then
        mn_exec "$node0" / sh -c 'ids=$(squeue -h -o %i 2>/dev/null) && [ -n "$ids" ] && scancel --full $ids' \
            >/dev/null 2>&1 || true
    fi
    local f pid pids=()
    for f in "$MN_DIR"/nodes/*/tmp/slurmd.pid "$STATE/slurmctld.pid" "$STATE/munged.pid"; do
        pid="$(cat "$f" 2>/dev/null)" || continue
        rm -f "$f"
        [[ "$pid" =~ ^[0-9]+$ ]] && kill -TERM "$pid" 2>/dev/null && pids+=("$pid")
    done
    for _ in $(seq 1 100); do
        ((${#pids[@]})) || break
        kill -0 "${pids[@]}" 2>/dev/null || break
        sleep 0.1
    done
    ((${#pids[@]} == 0)) || kill -KILL "${pids[@]}" 2>/dev/null || true
}

start() {
    for b in munged slurmctld slurmd sbatch srun; do
        command -v "$b" >/dev/null || mn_die "$b not found: install slurm-wlm and munge (ci/slurm/start.sh does)"
    done
    [ -e "/run/netns/$node0" ] || mn_die "no cluster: run ci/multinode/up.sh first"
    stop
    rm -rf "$STATE"
    mkdir -p "$STATE"/{ctld,log,munge,out}
    chmod 711 "$STATE/munge"   # munged: the socket's directory must be searchable by all
    head -c 1024 /dev/urandom >"$STATE/munge/munge.key"
    chmod 400 "$STATE/munge/munge.key"
    local lines="" i
    for ((i = 0; i < MN_NODES; i++)); do
        lines+="NodeName=$(mn_node "$i") NodeAddr=$(mn_addr "$i") CPUs=$CPUS RealMemory=1024 State=UNKNOWN"$'\n'
    done
    sed -e "s|@STATE@|$STATE|g" -e "s|@NODE0@|$node0|g" -e "s|@ADDR0@|$(mn_addr 0)|g" \
        -e "s|@MUNGE_SOCKET@|$MUNGE_SOCKET|g" -e "s|@NODELIST@|${MN_PREFIX}[0-$((MN_NODES - 1))]|g" \
        "$MN_CI_DIR/slurm.conf.in" | awk -v lines="${lines%$'\n'}" '{ if ($0 == "@NODE_LINES@") print lines; else print }' \
        >"$SLURM_CONF"
    mn_exec "$node0" / munged --force --socket="$MUNGE_SOCKET" --key-file="$STATE/munge/munge.key" \
        --pid-file="$STATE/munged.pid" --log-file="$STATE/log/munged.log" \
        --seed-file="$STATE/munge/munged.seed" || { show_logs; mn_die "munged did not start"; }
    mn_exec "$node0" / slurmctld -f "$SLURM_CONF" || { show_logs; mn_die "slurmctld did not start"; }
    for ((i = 0; i < MN_NODES; i++)); do
        rm -rf "$MN_DIR/nodes/$(mn_node "$i")/tmp/slurmd-spool"
        mkdir -p "$MN_DIR/nodes/$(mn_node "$i")/tmp/slurmd-spool"
        mn_exec "$(mn_node "$i")" / slurmd -f "$SLURM_CONF" \
            || { show_logs; mn_die "slurmd did not start on $(mn_node "$i")"; }
    done
    local deadline=$((SECONDS + 60)) states=""
    while ((SECONDS < deadline)); do
        for f in "$STATE/slurmctld.pid" "$MN_DIR"/nodes/*/tmp/slurmd.pid; do
            [ -s "$f" ] || continue   # not written yet
            kill -0 "$(cat "$f")" 2>/dev/null \
                || { show_logs; mn_die "$(basename "$f" .pid) exited while starting up ($f)"; }
        done
        states="$(mn_exec "$node0" / sinfo -h -N -o '%N %t' 2>/dev/null | sort -u | tr '\n' ' ' || true)"
        [ "$(grep -o ' idle' <<<"$states" | wc -l)" = "$MN_NODES" ] && break
        sleep 0.5
    done
    [ "$(grep -o ' idle' <<<"$states" | wc -l)" = "$MN_NODES" ] \
        || { show_logs; mn_die "nodes not idle 60 s after starting the daemons: ${states:-no answer}"; }
    mn_say "slurm up: $states(SLURM_CONF=$SLURM_CONF)"
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    *) mn_die "usage: slurm.sh start|stop" ;;
esac
