#!/usr/bin/env bash
# M1, M2 of PERF.md on the simulated cluster: every node's link shaped to HPCDP_MN_RATE (default
# 2gbit) with tc tbf, then `python -m hpcdp.bench multinode` on 2 nodes x 2 ranks under mpirun
# (MPI backend) and under hpcdp-run (TCP backend).  First a raw socket stream between two nodes
# shows what the shaped link really carries.  JSON lines: $MN_DIR/log/bench-multinode.jsonl.
#
#   ci/multinode/bench.sh [extra options of python -m hpcdp.bench multinode]
set -euo pipefail
# shellcheck source=ci/multinode/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
need_root "$@"
RATE="${HPCDP_MN_RATE:-2gbit}"
PER_NODE=2
PY="${HPCDP_VENV:-$MN_REPO/.venv}/bin/python"
exec 9>"$MN_LOCK"
flock -w 900 9 || mn_die "another run holds $MN_LOCK"
trap '"$MN_CI_DIR/down.sh" --quiet || true' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
"$MN_CI_DIR/up.sh"
mkdir -p "$MN_DIR/log"
JSON="$MN_DIR/log/bench-multinode.jsonl"
rm -f "$JSON"
if [ "$RATE" != off ]; then "$MN_CI_DIR/shape.sh" "$RATE"; fi
gbit="$(sed -n 's/^\([0-9.]*\)gbit$/\1/p' <<<"$RATE")"
link=()
[ -z "$gbit" ] || link=(--link-gbit "$gbit")
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
unset HPCDP_BACKEND RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR MASTER_PORT HPCDP_SECRET
node0="$(mn_node 0)" node1="$(mn_node 1)"

# raw: 256 MiB over one TCP socket from node 1 to node 0, no hpcdp involved
"$MN_CI_DIR/on.sh" "$node0" "$PY" -c '
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 5999)); s.listen(1); c, _ = s.accept(); n = 0; buf = bytearray(1 << 20)
t0 = time.perf_counter()
while (k := c.recv_into(buf)): n += k
dt = time.perf_counter() - t0
print(f"# raw TCP stream {sys.argv[2]} -> {sys.argv[3]}: {n / dt * 8 / 1e9:.2f} Gbit/s ({n >> 20} MiB in {dt:.2f} s; link shaped to {sys.argv[4]})")
' "$(mn_addr 0)" "$node1" "$node0" "$RATE" &
sleep 1
"$MN_CI_DIR/on.sh" "$node1" "$PY" -c '
import socket, sys
c = socket.create_connection((sys.argv[1], 5999)); chunk = bytes(1 << 20)
for _ in range(256): c.sendall(chunk)
c.close()' "$(mn_addr 0)"
wait

hosts="$(for ((i = 0; i < MN_NODES; i++)); do printf '%s:%s,' "$(mn_node "$i")" "$PER_NODE"; done)"
mn_say "== MPI (mpirun --host ${hosts%,})"
"$MN_CI_DIR/on.sh" "$node0" mpirun --mca plm_rsh_agent "$MN_CI_DIR/rsh.sh" --host "${hosts%,}" \
    -n $((MN_NODES * PER_NODE)) --map-by slot --oversubscribe --mca btl tcp,vader,self \
    --mca mpi_yield_when_idle 1 --mca btl_tcp_if_include "$MN_CIDR" \
    --mca oob_tcp_if_include "$MN_CIDR" -x OMP_NUM_THREADS --wdir "$MN_REPO" \
    "$PY" -m hpcdp.bench multinode "${link[@]}" --json "$JSON" "$@"

mn_say "== TCP (hpcdp-run --nnodes $MN_NODES on every node)"
HPCDP_SECRET="$("$PY" -c 'import secrets; print(secrets.token_hex(32))')"
export HPCDP_SECRET
pids=()
for ((k = MN_NODES - 1; k >= 0; k--)); do
    (cd "$MN_REPO" && exec "$MN_CI_DIR/on.sh" "$(mn_node "$k")" "$PY" -m hpcdp.run -n "$PER_NODE" \
        --nnodes "$MN_NODES" --node-rank "$k" --master-addr "$node0" \
        -m hpcdp.bench multinode "${link[@]}" --json "$JSON" "$@") &
    pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
mn_say "results: $JSON"
exit $rc
