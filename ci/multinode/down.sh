#!/usr/bin/env bash
# Remove the simulated cluster (up.sh): stop every process still running on a node (found by its
# network namespace, so only processes of this cluster), remove any tc shaping, release the UTS
# and mount namespaces, delete the network namespaces, the node-local /tmp folders and the shared
# directory.  Safe to run when nothing is there; logs under $MN_DIR/log are kept.
#
#   ci/multinode/down.sh [--quiet]
set -euo pipefail
# shellcheck source=ci/multinode/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
quiet=0
[ "${1:-}" = --quiet ] && quiet=1
need_root "$@"

removed=()
# The namespaces of this cluster: the switch and every hpcdp-nI that exists (any count, so a
# cluster of 4 left behind is removed by a run asking for 2).
mapfile -t spaces < <(ip netns list 2>/dev/null | awk '{print $1}' \
    | grep -E "^(${MN_PREFIX}[0-9]+|${MN_SWITCH})\$" || true)

# Processes whose network namespace is one of ours: TERM, then KILL what is left after 3 s.
ns_pids() {
    local ino pid
    for s in "${spaces[@]}"; do
        ino="$(stat -L -c %i "/run/netns/$s" 2>/dev/null)" || continue
        for pid in /proc/[0-9]*; do
            pid="${pid#/proc/}"
            [ "$(readlink "/proc/$pid/ns/net" 2>/dev/null)" = "net:[$ino]" ] && echo "$pid"
        done
    done
    return 0
}
if ((${#spaces[@]})); then
    mapfile -t pids < <(ns_pids)
    if ((${#pids[@]})); then
        kill -TERM "${pids[@]}" 2>/dev/null || true
        for _ in $(seq 1 30); do
            mapfile -t pids < <(ns_pids)
            ((${#pids[@]})) || break
            sleep 0.1
        done
        ((${#pids[@]} == 0)) || kill -KILL "${pids[@]}" 2>/dev/null || true
        removed+=("processes")
    fi
fi

if [ -d "$MN_DIR/ns" ]; then
    for f in "$MN_DIR"/ns/*.uts; do
        [ -e "$f" ] || continue
        umount "$f" 2>/dev/null || umount -l "$f" 2>/dev/null || true
        rm -f "$f"
    done
    while mountpoint -q "$MN_DIR/ns"; do umount "$MN_DIR/ns" 2>/dev/null || umount -l "$MN_DIR/ns"; done
fi
for s in "${spaces[@]}"; do
    ip netns del "$s" 2>/dev/null || true   # its veth ends, bridge and qdiscs go with it
    removed+=("$s")
done
rm -rf "$MN_DIR/nodes" "$MN_DIR/ns" "$MN_DIR/etc" "$MN_SHARED" "$MN_DIR/slurm"
rmdir "$MN_DIR/cgroup" 2>/dev/null || true
if ((${#removed[@]})); then
    mn_say "removed ${removed[*]}"
elif ((!quiet)); then
    mn_say "no cluster was there"
fi
