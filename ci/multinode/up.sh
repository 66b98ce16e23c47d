#!/usr/bin/env bash
# Build the simulated cluster: HPCDP_MN_NODES (2-4) "nodes" on this one kernel, each with
#   - its own network namespace (`ip netns`, name = host name hpcdp-nI), loopback and eth0 with
#     10.213.0.(10+I)/24, joined to the others by a veth pair to a bridge;
#   - its own host name (a UTS namespace) and, whenever something runs there (common.sh,
#     mn_exec), a mount namespace in which /etc/hosts names every node, /tmp and /dev/shm are the
#     node's own (as on a real cluster: what one node writes there the others cannot see) and
#     /sys shows the node's own interfaces;
#   - the directory $MN_DIR/shared at the same path everywhere: the cluster's shared file system.
# The bridge lives in a switch namespace of its own, so the host's network namespace gets no
# interface, address or route, and nothing outside 10.213.0.0/24 is reachable from a node
# (no default route).  A cluster left behind by a killed run is removed first (down.sh).
#
#   ci/multinode/up.sh && ci/multinode/on.sh hpcdp-n1 hostname
#
# Needs root; fails, saying why, where this kernel or sandbox refuses namespaces.
set -euo pipefail
# shellcheck source=ci/multinode/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
need_root "$@"

[[ "$MN_NODES" =~ ^[2-4]$ ]] || mn_die "HPCDP_MN_NODES must be 2, 3 or 4, got '$MN_NODES'"
for b in ip nsenter unshare mount; do
    command -v "$b" >/dev/null || mn_die "$b not found (iproute2 / util-linux)"
done

"$MN_CI_DIR/down.sh" --quiet
# Whatever fails from here on leaves nothing behind.
trap 'rc=$?; if [ $rc != 0 ]; then mn_say "setup failed (exit $rc): removing what was made"; "$MN_CI_DIR/down.sh" --quiet || true; fi' EXIT

mkdir -p "$MN_DIR"/{ns,log,etc,cgroup} "$MN_SHARED"
chmod 755 "$MN_DIR"
chmod 1777 "$MN_SHARED"
# Namespace handles are bind mounts; a directory that is a private mount of itself keeps them
# from propagating into (and pinning) the namespaces made from it, as `ip netns` does.
mount --bind "$MN_DIR/ns" "$MN_DIR/ns"
mount --make-private "$MN_DIR/ns"

{
    echo "127.0.0.1 localhost"
    for ((i = 0; i < MN_NODES; i++)); do echo "$(mn_addr "$i") $(mn_node "$i")"; done
} >"$MN_DIR/etc/hosts"

ip netns add "$MN_SWITCH" || mn_die "cannot create a network namespace (ip netns add): this sandbox forbids it"
ip -n "$MN_SWITCH" link add "$MN_BRIDGE" type bridge
ip -n "$MN_SWITCH" link set "$MN_BRIDGE" up
ip -n "$MN_SWITCH" link set lo up

for ((i = 0; i < MN_NODES; i++)); do
    node="$(mn_node "$i")"
    ip netns add "$node"
    # the pair is created in the switch namespace, so no name ever appears in the host's
    ip -n "$MN_SWITCH" link add "v$i" type veth peer name "$MN_IFACE" netns "$node"
    ip -n "$MN_SWITCH" link set "v$i" master "$MN_BRIDGE" up
    ip -n "$node" link set lo up
    ip -n "$node" addr add "$(mn_addr "$i")/24" dev "$MN_IFACE"
    ip -n "$node" link set "$MN_IFACE" up

    mkdir -p "$MN_DIR/nodes/$node/tmp"
    chmod 1777 "$MN_DIR/nodes/$node/tmp"
    mkdir -p "$MN_DIR/nodes/$node/shm"
    chmod 1777 "$MN_DIR/nodes/$node/shm"
    touch "$(mn_uts "$node")"
    # The host name lives in a UTS namespace kept alive by a bind mount on a file (mn_exec
    # enters it with the network namespace, and a fresh mount namespace, on every entry).
    unshare --uts="$(mn_uts "$node")" hostname "$node" \
        || mn_die "cannot create a UTS namespace for $node (unshare): this sandbox forbids it"
done

# Every node reaches every other over the bridge before anything runs on them.
for ((i = 0; i < MN_NODES; i++)); do
    for ((j = 0; j < MN_NODES; j++)); do
        ((i == j)) && continue
        ok=0
        for _ in $(seq 1 50); do
            if mn_exec "$(mn_node "$i")" / bash -c "$(declare -f mn_reachable); mn_reachable $(mn_addr "$j")"; then
                ok=1; break
            fi
            sleep 0.1
        done
        ((ok)) || mn_die "$(mn_node "$i") cannot reach $(mn_node "$j") at $(mn_addr "$j")"
    done
done
trap - EXIT
mn_say "cluster up: $(mn_nodes | tr '\n' ' ')on $MN_CIDR; shared directory $MN_SHARED"
