#!/usr/bin/env bash
# Limit every node's link of the simulated cluster to RATE with tc's token bucket (tbf), in both
# directions: on the node's eth0 (what it sends) and on its port of the bridge (what it receives).
# This kernel has tbf and htb but not netem, so bandwidth can be shaped and latency cannot.
#
#   ci/multinode/shape.sh 2gbit      # every node's link at 2 Gbit/s each way
#   ci/multinode/shape.sh off        # remove the shaping (down.sh removes it with the namespaces)
set -euo pipefail
# shellcheck source=ci/multinode/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
need_root "$@"
(($# == 1)) || mn_die "usage: shape.sh RATE|off (RATE as tc writes it: 2gbit, 500mbit)"
rate="$1"
command -v tc >/dev/null || mn_die "tc not found (iproute2)"
for ((i = 0; i < MN_NODES; i++)); do
    node="$(mn_node "$i")"
    [ -e "/run/netns/$node" ] || mn_die "no cluster: run ci/multinode/up.sh first"
    for spec in "$node $MN_IFACE" "$MN_SWITCH v$i"; do
        read -r ns dev <<<"$spec"
        tc -n "$ns" qdisc del dev "$dev" root 2>/dev/null || true
        [ "$rate" = off ] && continue
        # burst: a few ms at the rate (at least what one 64 KiB GSO segment needs), so the
        # bucket does not throttle below the rate at this kernel's timer resolution
        tc -n "$ns" qdisc add dev "$dev" root tbf rate "$rate" burst 4mb latency 100ms \
            || mn_die "tc tbf on $ns/$dev refused (no sch_tbf in this kernel?)"
    done
done
if [ "$rate" = off ]; then mn_say "links unshaped"; else mn_say "every node's link shaped to $rate each way (tbf)"; fi
