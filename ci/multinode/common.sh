# Shared by ci/multinode/*.sh (sourced, not run): what the simulated cluster is called and where
# it lives.  Nothing here touches the machine; up.sh builds the cluster, down.sh removes it.
# shellcheck shell=bash

# Everything the cluster writes: namespace handles, per-node /tmp, the shared directory, logs.
# Not under /tmp: each node gets a private /tmp of its own (as on a real cluster), and the
# directory every node must see (the "NFS" of the simulation) cannot live in one of them.
MN_DIR="${HPCDP_MN_DIR:-/var/tmp/hpcdp-mn-ci}"
# Nodes: 2 to 4.  Host names and network-namespace names are the same: hpcdp-n0, hpcdp-n1, ...
MN_NODES="${HPCDP_MN_NODES:-2}"
MN_PREFIX="hpcdp-n"
# The switch: a namespace of its own holding the bridge, so the host's own network namespace
# gets no interface, address or route from this cluster.
MN_SWITCH="hpcdp-mn-switch"
MN_BRIDGE="br0"
# The private subnet: node i is 10.213.0.(10+i).  Only these addresses (and loopback inside a
# node) are ever a target of the cluster's traffic.
MN_NET="${HPCDP_MN_NET:-10.213.0}"
MN_CIDR="$MN_NET.0/24"
MN_IFACE="eth0"
# The shared directory every node sees at the same path (see README.md: how it stands in for NFS).
MN_SHARED="$MN_DIR/shared"
MN_LOCK="${MN_DIR}.lock"

MN_CI_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
MN_REPO="$(cd "$MN_CI_DIR/../.." && pwd)"

mn_say() { printf '%s\n' "multinode: $*" >&2; }
mn_die() { mn_say "FAIL: $*"; exit 1; }

mn_node() { printf '%s%s' "$MN_PREFIX" "$1"; }        # index -> host name
mn_addr() { printf '%s.%s' "$MN_NET" "$((10 + $1))"; }  # index -> address
mn_nodes() { local i; for ((i = 0; i < MN_NODES; i++)); do mn_node "$i"; echo; done; }
# host name -> index (fails for a name that is not one of ours)
mn_index() {
    local i
    for ((i = 0; i < MN_NODES; i++)); do
        [ "$(mn_node "$i")" = "$1" ] && { echo "$i"; return 0; }
    done
    return 1
}

# The UTS namespace handle of a node (a bind mount made by up.sh; the network one is `ip netns`'s).
mn_uts() { printf '%s/ns/%s.uts' "$MN_DIR" "$1"; }

# Run "$@" on node $1 in directory $2: in its network and UTS namespaces and in a fresh mount
# namespace in which /etc/hosts names every node, /tmp and /dev/shm are the node's own and /sys
# shows its interfaces (with the machine's cgroup file systems, which slurmd wants, kept).  A mount namespace per entry (as `ip netns exec` does), not one per node:
# a process on one node must be able to enter another (mpirun's agent), and a persistent mount
# namespace cannot hold the handles of the namespaces made after it.  The node's /tmp and
# /dev/shm are directories on disk, so every entry into the same node sees the same files.
mn_exec() {
    local node="$1" wd="$2"; shift 2
    nsenter --net="/run/netns/$node" --uts="$(mn_uts "$node")" -- \
        unshare --mount --propagation private -- /bin/sh -euc '
            node="$1" dir="$2" wd="$3" repo="$4"; shift 4
            mount --rbind /sys/fs/cgroup "$dir/cgroup"     # kept across the new sysfs
            umount -l /sys && mount -t sysfs sysfs /sys
            mount --move "$dir/cgroup" /sys/fs/cgroup
            mount --bind "$dir/etc/hosts" /etc/hosts
            # a checkout (and its .venv) under /tmp stays visible at its path on every node, as
            # a cluster home directory would be: bound into the node tmp before that hides /tmp
            case "$repo" in /tmp/?*)
                mkdir -p "$dir/nodes/$node/tmp/${repo#/tmp/}"
                mount --bind "$repo" "$dir/nodes/$node/tmp/${repo#/tmp/}" ;;
            esac
            mount --rbind "$dir/nodes/$node/tmp" /tmp
            mount --bind "$dir/nodes/$node/shm" /dev/shm
            cd "$wd"
            exec "$@"' sh "$node" "$MN_DIR" "$wd" "$MN_REPO" "$@"
}

# Whether address $1 answers (no ping here): a TCP connect to port 9, where nothing listens, is
# refused by a host that is there and times out (or finds no route) otherwise.
mn_reachable() {
    local err
    err="$(timeout 2 bash -c "exec 3<>/dev/tcp/$1/9" 2>&1)" && return 0
    [[ "$err" == *refused* ]]
}

need_root() {
    [ "$(id -u)" = 0 ] && return 0
    if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
        exec sudo -n -E "$0" "$@"
    fi
    mn_die "needs root (or passwordless sudo) to create network, UTS and mount namespaces"
}
