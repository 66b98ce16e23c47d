#!/usr/bin/env bash
# Every jobs/*.sbatch (or the scripts named) on the simulated cluster's Slurm (slurm.sh start),
# submitted with plain `sbatch --wait` from node 0 as written, except for the job size: the
# scripts ask for 2 nodes x 4 ranks; here they run on HPCDP_MN_NODES nodes x 2 ranks, so that
# their `# ci: expect` lines (written for 4 ranks) hold at 2 nodes.  Their `# ci: sbatch` lines
# (--nodes=1, for ci/slurm's one-node cluster) are not used; `args`, `needs`, `expect` and
# `timeout` are, as ci/slurm/README.md describes.  One PASS/FAIL line per job; exits non-zero if
# any failed.
#
#   ci/multinode/up.sh && ci/multinode/slurm.sh start && ci/multinode/slurm-jobs.sh [jobs/x.sbatch]
set -euo pipefail
# shellcheck source=ci/multinode/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
need_root "$@"
export SLURM_CONF="$MN_DIR/slurm/slurm.conf"
[ -f "$SLURM_CONF" ] || mn_die "no Slurm on the cluster (ci/multinode/slurm.sh start first)"
PER_NODE="${HPCDP_MN_JOB_RANKS_PER_NODE:-2}"
OUT="$MN_DIR/log/slurm-jobs"
mkdir -p "$OUT" "$MN_SHARED/ckpt"

if (($#)); then JOBS=("$@"); else JOBS=("$MN_REPO"/jobs/*.sbatch); fi

# What jobs inherit from this shell (sbatch exports it): the repository's venv, scratch roots on
# the shared directory (checkpoints must be seen by every node), and none of the rank/launcher
# variables a harness may have left set.
unset HPCDP_BACKEND RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT \
    HPCDP_MASTER_ADDR HPCDP_MASTER_PORT HPCDP_SECRET HPCDP_RESTART_COUNT
export HPCDP_VENV="${HPCDP_VENV:-$MN_REPO/.venv}"
export HPCDP_CKPT_ROOT="$MN_SHARED/ckpt"
export HPCDP_TRACE_DIR="$MN_SHARED/trace"
export HEAT_CKPT="$MN_SHARED/heat2d-ckpt"
# The simulated nodes share this machine's few cores: MPI ranks yield while they wait instead of
# spinning (a real cluster does not need this: its nodes' cores are their own).
export OMPI_MCA_mpi_yield_when_idle=1

directive() { sed -n "s/^# ci: $2 //p" "$1"; }
# Whether job output $1 has a line matching ERE $2, NULs dropped.  Not `tr | grep -q`: grep -q
# exits at its first match, tr's next write gets SIGPIPE, and under pipefail a line that is there
# reads as missing (seen in CI: "did not run on 2 nodes" above a first line that said it did).
has_line() { local text; text="$(tr -d '\0' <"$1")"; grep -Eq -- "$2" <<<"$text"; }

passed=0 failed=0 t_all=$SECONDS verdicts=()
for job in "${JOBS[@]}"; do
    name="$(basename "$job" .sbatch)"
    out="$OUT/$name.out"
    rm -f "$out"
    t0=$SECONDS
    verdict=""
    while read -r need; do
        [ -z "$need" ] || [ -e "$MN_REPO/$need" ] || verdict="needs $need, which does not exist"
    done < <(directive "$job" needs)
    [ "$(directive "$job" expect | wc -l)" != 0 ] || verdict="declares no '# ci: expect' line"
    read -r -a args <<<"$(directive "$job" args | tr '\n' ' ')"
    timeout="$(directive "$job" timeout | tail -n 1)"
    if [ -z "$verdict" ]; then
        rc=0
        # sbatch on node 0, from the repository (the submit directory every node mounts);
        # `timeout` cancels the job when it outlives its budget.
        (cd "$MN_REPO" && exec timeout --kill-after=10 "${timeout:-300}" \
            "$MN_CI_DIR/on.sh" "$(mn_node 0)" sbatch --wait --job-name="mn-$name" --output="$out" \
            --nodes="$MN_NODES" --ntasks-per-node="$PER_NODE" "$job" "${args[@]}") \
            >"$OUT/$name.sbatch" 2>&1 || rc=$?
        # `sbatch --wait` may return while a requeued job's next run is still to come (seen once
        # in three runs of preempt_requeue here): judge the output once no run of it is left.
        while ((rc == 0)) && [ -n "$("$MN_CI_DIR/on.sh" "$(mn_node 0)" squeue -h -n "mn-$name" -o %i 2>/dev/null)" ]; do
            ((SECONDS - t0 < ${timeout:-300})) || { rc=124; break; }
            sleep 1
        done
        if ((rc == 124 || rc == 137)); then
            "$MN_CI_DIR/on.sh" "$(mn_node 0)" scancel --name="mn-$name" 2>/dev/null || true
            verdict="still running after ${timeout:-300} s: cancelled"
        elif ((rc != 0)); then
            verdict="sbatch --wait exited with $rc (the job's exit code)"
        elif ! has_line "$out" "^job [0-9]+.*: $MN_NODES nodes \\(${MN_PREFIX}"; then
            verdict="did not run on $MN_NODES nodes (its first line says: $(head -n 1 "$out"))"
        else
            # As in ci/slurm/run-jobs.sh: a requeued job's earlier run may have its lines land
            # in the file seconds after sbatch --wait returned, so a missing one is looked for
            # again for a few seconds before the job fails.
            while read -r re; do
                tries=0
                until has_line "$out" "$re"; do
                    ((++tries <= 5)) || { verdict="no output line matches /$re/"; break; }
                    sleep 1
                done
                [ -z "$verdict" ] || break
            done < <(directive "$job" expect)
        fi
    fi
    if [ -z "$verdict" ]; then
        passed=$((passed + 1))
        mn_say "PASS $name ($((SECONDS - t0)) s on $MN_NODES nodes x $PER_NODE ranks)"
    else
        failed=$((failed + 1))
        mn_say "FAIL $name: $verdict"
        { tail -n 40 "$out" 2>/dev/null | tr -d '\0'; cat "$OUT/$name.sbatch"; } | sed 's/^/    | /' >&2 || true
        verdicts+=("$name: $verdict")
    fi
done
# the verdicts again, after the outputs: a log cut to its head and tail still shows why
for v in "${verdicts[@]}"; do mn_say "FAILED $v"; done
mn_say "slurm jobs: $passed passed, $failed failed, in $((SECONDS - t_all)) s (output in $OUT)"
((failed == 0))
