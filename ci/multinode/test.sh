#!/usr/bin/env bash
# `make test-multinode`: build the simulated cluster (up.sh), run everything that only a second
# node exercises on it, and remove it again (down.sh), also when a stage fails or this script is
# interrupted or killed by TERM.  Stages, each judged by its own exit code:
#
#   [a] mpirun --host hpcdp-n0:2,hpcdp-n1:2 (agent rsh.sh)   tests/multinode/cluster, MPI backend
#   [b] hpcdp-run --nnodes 2 --node-rank K on every node     tests/multinode/cluster, TCP backend
#   [c] Slurm, one slurmd per node: sbatch --nodes=2, srun   tests/multinode/cluster, MPI (PMIx)
#       and srun -n 2 --ntasks-per-node=1 hpcdp-run -n 2      tests/multinode/cluster, TCP
#   [d] Slurm: every jobs/*.sbatch on 2 nodes x 2 ranks      (slurm-jobs.sh)
#   [e] from outside the nodes: a node's link cut mid-step   tests/multinode/host
#
# The last line is a count over all stages for `make test`'s summary.  Logs: $MN_DIR/log.
# HPCDP_MN_NODES (2-4) nodes; HPCDP_MN_STAGES="a b c d e" runs a subset.
set -euo pipefail
# shellcheck source=ci/multinode/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
need_root "$@"
t_start=$SECONDS
STAGES="${HPCDP_MN_STAGES:-a b c d e}"
PER_NODE=2
STAGE_TIMEOUT="${HPCDP_MN_STAGE_TIMEOUT:-300}"
PY="${HPCDP_VENV:-$MN_REPO/.venv}/bin/python"
[ -x "$PY" ] || mn_die "no $PY: run make install first"

# One simulated cluster per machine at a time: a second run waits for the first.
mkdir -p "$(dirname "$MN_LOCK")"
exec 9>"$MN_LOCK"
flock -w 900 9 || mn_die "another ci/multinode/test.sh held $MN_LOCK for 15 minutes"
STAGE_PID=""
cleanup() {
    # the running stage first (its own process group, see run_stage), then the cluster
    if [ -n "$STAGE_PID" ] && kill -0 "$STAGE_PID" 2>/dev/null; then
        kill -TERM -- "-$STAGE_PID" 2>/dev/null || true
        sleep 1
        kill -KILL -- "-$STAGE_PID" 2>/dev/null || true
    fi
    "$MN_CI_DIR/slurm.sh" stop >/dev/null 2>&1 || true
    "$MN_CI_DIR/down.sh" --quiet || true
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

"$MN_CI_DIR/up.sh"
LOG="$MN_DIR/log"
rm -rf "$LOG"
mkdir -p "$LOG/ranks"

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# What every rank of a cluster stage is told (the checks compare hpcdp's view with it), and the
# shared directory: checkpoints, rank logs and hpcdp.testing's shared_tmp_path live there.
export HPCDP_MN_NODES="$MN_NODES" HPCDP_MN_PER_NODE="$PER_NODE" HPCDP_MN_LOGS="$LOG/ranks" \
    HPCDP_SHARED_TMPDIR="$MN_SHARED" HPCDP_MN_SHARED="$MN_SHARED" HPCDP_TRACE_DIR="$MN_SHARED/trace"
# Every node of this cluster shares the machine's few cores: one BLAS thread per rank (as the
# jobs/ scripts do), and MPI ranks that yield while they wait instead of spinning (srun's ranks
# read it from the environment sbatch exports; mpirun's get it as --mca as well).
export OMP_NUM_THREADS=1 OMPI_MCA_mpi_yield_when_idle=1
unset HPCDP_BACKEND RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT \
    HPCDP_MASTER_ADDR HPCDP_MASTER_PORT HPCDP_SECRET
node0="$(mn_node 0)"
hosts="$(for ((i = 0; i < MN_NODES; i++)); do printf '%s:%s,' "$(mn_node "$i")" "$PER_NODE"; done)"
hosts="${hosts%,}"
CHECKS=(tests/multinode/run_cluster.py --min-tests "${HPCDP_MN_MIN_TESTS:-40}")

declare -A RC PASSED FAILED
# The pytest count of a stage's output: rank 0's last summary line ("N passed, M failed ...").
count() {
    local line
    line="$(tr -d '\0' <"$LOG/$1.out" | sed 's/\x1b\[[0-9;]*m//g' \
        | grep -E '^((\[rank 0\] )?=*\s*|multinode: slurm jobs: )[0-9]+ (passed|failed)' | tail -n 1 || true)"
    PASSED[$1]="$(awk '{for (i = 2; i <= NF; i++) if ($i ~ /^passed/) n += $(i-1)} END {print n + 0}' <<<"$line")"
    FAILED[$1]="$(awk '{for (i = 2; i <= NF; i++) if ($i ~ /^(failed|error)/) n += $(i-1)} END {print n + 0}' <<<"$line")"
}
run_stage() {  # name, description, command...
    local name="$1" what="$2" t0=$SECONDS rc=0
    shift 2
    mn_say "== [$name] $what"
    # In the background, in a process group of its own (set -m), and waited for with `wait`,
    # which a signal interrupts: INT/TERM then clean up at once, not when the stage ends.
    set -m
    ( (cd "$MN_REPO" && "$@") 2>&1 | tee "$LOG/$name.out"; exit "${PIPESTATUS[0]}" ) &
    STAGE_PID=$!
    set +m
    wait "$STAGE_PID" || rc=$?
    STAGE_PID=""
    RC[$name]=$rc
    count "$name"
    mn_say "== [$name] exit code $rc, ${PASSED[$name]} passed, ${FAILED[$name]} failed, $((SECONDS - t0)) s"
}

stage_mpirun() {
    export HPCDP_MN_LAUNCHER=mpirun
    timeout --kill-after=15 "$STAGE_TIMEOUT" "$MN_CI_DIR/on.sh" "$node0" \
        mpirun --mca plm_rsh_agent "$MN_CI_DIR/rsh.sh" --host "$hosts" -n $((MN_NODES * PER_NODE)) \
        --map-by slot --oversubscribe --mca btl tcp,vader,self --mca mpi_yield_when_idle 1 \
        --mca btl_tcp_if_include "$MN_CIDR" --mca oob_tcp_if_include "$MN_CIDR" \
        -x HPCDP_MN_LAUNCHER -x HPCDP_MN_NODES -x HPCDP_MN_PER_NODE -x HPCDP_MN_LOGS \
        -x HPCDP_SHARED_TMPDIR -x HPCDP_TRACE_DIR -x OMP_NUM_THREADS -x PY_COLORS=0 \
        --wdir "$MN_REPO" "$PY" "${CHECKS[@]}"
}

stage_hpcdp_run() {
    # One launcher per node, as a user starts them (a strong secret exported on every node).
    local k pids=() rc=0
    export HPCDP_MN_LAUNCHER=hpcdp-run PY_COLORS=0
    HPCDP_SECRET="$("$PY" -c 'import secrets; print(secrets.token_hex(32))')"
    export HPCDP_SECRET
    for ((k = MN_NODES - 1; k >= 0; k--)); do
        timeout --kill-after=15 "$STAGE_TIMEOUT" "$MN_CI_DIR/on.sh" "$(mn_node "$k")" \
            "$PY" -m hpcdp.run -n "$PER_NODE" --nnodes "$MN_NODES" --node-rank "$k" \
            --master-addr "$node0" "${CHECKS[@]}" >"$LOG/hpcdp-run-node$k.out" 2>&1 &
        pids+=($!)
    done
    for k in "${pids[@]}"; do wait "$k" || rc=$?; done
    unset HPCDP_SECRET
    cat "$LOG"/hpcdp-run-node*.out
    return $rc
}

stage_srun() {
    export HPCDP_MN_LAUNCHER=srun PY_COLORS=0
    SLURM_CONF="$MN_DIR/slurm/slurm.conf" timeout --kill-after=15 "$STAGE_TIMEOUT" \
        "$MN_CI_DIR/on.sh" "$node0" sbatch --wait --job-name=mn-checks --nodes="$MN_NODES" \
        --ntasks-per-node="$PER_NODE" --output="$LOG/srun-job.out" \
        --wrap "srun --mpi=pmix --kill-on-bad-exit=1 $PY ${CHECKS[*]}" || { cat "$LOG/srun-job.out"; return 1; }
    cat "$LOG/srun-job.out"
}

stage_srun_hpcdp_run() {
    # one launcher per node, its layout (nodes, node rank, master) read from Slurm's variables
    export HPCDP_MN_LAUNCHER=srun+hpcdp-run PY_COLORS=0
    HPCDP_SECRET="$("$PY" -c 'import secrets; print(secrets.token_hex(32))')"
    export HPCDP_SECRET
    SLURM_CONF="$MN_DIR/slurm/slurm.conf" timeout --kill-after=15 "$STAGE_TIMEOUT" \
        "$MN_CI_DIR/on.sh" "$node0" sbatch --wait --job-name=mn-checks-tcp --nodes="$MN_NODES" \
        --ntasks-per-node="$PER_NODE" --output="$LOG/srun-hpcdp-run-job.out" \
        --wrap "srun -n $MN_NODES --ntasks-per-node=1 $PY -m hpcdp.run -n $PER_NODE ${CHECKS[*]}" \
        || { cat "$LOG/srun-hpcdp-run-job.out"; return 1; }
    cat "$LOG/srun-hpcdp-run-job.out"
}

stage_host() {
    PY_COLORS=0 timeout --kill-after=15 "$STAGE_TIMEOUT" "$PY" -m pytest -q -p no:cacheprovider \
        -o python_files='check_*.py' tests/multinode/host
}

for s in $STAGES; do
    case "$s" in
        a) run_stage mpirun "mpirun --host $hosts: the cluster checks on MPI" stage_mpirun ;;
        b) run_stage hpcdp-run "hpcdp-run --nnodes $MN_NODES on every node: the cluster checks on TCP" stage_hpcdp_run ;;
        c|d)
            if [ ! -f "$MN_DIR/slurm/slurm.conf" ]; then
                rc=0; "$MN_CI_DIR/slurm.sh" start || rc=$?
                if ((rc)); then RC[slurm]=$rc PASSED[slurm]=0 FAILED[slurm]=1; continue; fi
            fi
            if [ "$s" = c ]; then
                run_stage srun "sbatch --nodes=$MN_NODES, srun --mpi=pmix: the cluster checks on MPI" stage_srun
                run_stage srun-hpcdp-run "sbatch --nodes=$MN_NODES, srun -n $MN_NODES --ntasks-per-node=1 hpcdp-run: the cluster checks on TCP" stage_srun_hpcdp_run
            else
                # each job counts as one test (the runner's "slurm jobs: N passed, M failed")
                run_stage jobs "every jobs/*.sbatch on $MN_NODES nodes x $PER_NODE ranks" "$MN_CI_DIR/slurm-jobs.sh"
            fi ;;
        e) run_stage host "outside the nodes: a node's link cut mid-step, hpcdp-run --max-restarts" stage_host ;;
        *) mn_die "unknown stage '$s' in HPCDP_MN_STAGES (a b c d e)" ;;
    esac
done

passed=0 failed=0 bad=()
for name in "${!RC[@]}"; do
    passed=$((passed + ${PASSED[$name]:-0}))
    f=${FAILED[$name]:-0}
    if ((RC[$name] != 0)); then
        bad+=("$name(rc=${RC[$name]})")
        ((f > 0)) || f=1   # crashed or timed out without a pytest count
    fi
    failed=$((failed + f))
done
mn_say "stages: $(for n in "${!RC[@]}"; do printf '%s=%s ' "$n" "${RC[$n]}"; done)"
why=""
((${#bad[@]} == 0)) || why=" (failed stages: ${bad[*]})"
echo "multinode: $passed passed, $failed failed on $MN_NODES nodes in $((SECONDS - t_start)) s$why"
((${#bad[@]} == 0))
