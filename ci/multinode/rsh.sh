#!/usr/bin/env bash
# The launch agent of mpirun on the simulated cluster, in place of ssh:
#
#   mpirun --mca plm_rsh_agent ci/multinode/rsh.sh --host hpcdp-n0:2,hpcdp-n1:2 ...
#
# runs the command mpirun gives (its orted) on node $1, the way ssh would: in that node's
# namespaces, from $HOME, with a fresh login-like environment (PATH, HOME, LANG) instead of the
# caller's, so that whatever a rank needs must reach it as it would on a real cluster (mpirun -x,
# MCA parameters on orted's command line), not by leaking through this shell.
set -euo pipefail
# shellcheck source=ci/multinode/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
# ssh's own options, should a caller pass any (-x, -q, -o X=Y): not meaningful here
while [[ "${1:-}" == -* ]]; do
    case "$1" in -o|-p|-l|-i) shift 2 ;; *) shift ;; esac
done
(($# >= 2)) || mn_die "rsh.sh: usage: rsh.sh NODE COMMAND..."
node="$1"; shift
mn_index "$node" >/dev/null || mn_die "rsh.sh: no node '$node' (nodes: $(mn_nodes | tr '\n' ' '))"
mn_exec "$node" "${HOME:-/root}" \
    env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME="${HOME:-/root}" \
    LANG=C.UTF-8 /bin/sh -c "$*"
