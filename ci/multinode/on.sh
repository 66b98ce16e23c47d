#!/usr/bin/env bash
# Run a command on one node of the simulated cluster (its network, host name and mount
# namespaces), in the current directory and with the caller's environment:
#
#   ci/multinode/on.sh hpcdp-n1 hostname
set -euo pipefail
# shellcheck source=ci/multinode/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
(($# >= 2)) || mn_die "usage: on.sh NODE COMMAND [ARGS...]"
node="$1"; shift
mn_index "$node" >/dev/null || mn_die "no node '$node' (nodes: $(mn_nodes | tr '\n' ' '))"
mn_exec "$node" "$PWD" "$@"
