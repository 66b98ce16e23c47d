#!/usr/bin/env bash
# Submit every jobs/*.sbatch (or the scripts named) to the CI cluster with plain `sbatch --wait`
# and judge each by its exit code and its output, as its `# ci:` lines say (ci/slurm/README.md).
# Prints one PASS/FAIL line per job and exits non-zero if any failed: a job whose example file is
# missing, or that declares nothing to check, fails too; nothing is skipped.
#
#   ci/slurm/start.sh && ci/slurm/run-jobs.sh [jobs/foo.sbatch ...]; ci/slurm/stop.sh
#
# HPCDP_SLURM_PARALLEL=N runs up to N jobs at once (default 1: this box has few cores, and two
# 4-rank MPI jobs that busy-poll on 2 cores are slower together than one after the other).
set -euo pipefail
# shellcheck source=ci/slurm/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
need_root "$@"

PARALLEL="${HPCDP_SLURM_PARALLEL:-1}"
OUT="$STATE/out"
mkdir -p "$OUT" "$STATE/ckpt"
[ -f "$SLURM_CONF" ] && ours_alive "$STATE/slurmctld.pid" >/dev/null \
    || die "no CI cluster is running (ci/slurm/start.sh first)"

if (($#)); then
    JOBS=("$@")
else
    JOBS=("$REPO"/jobs/*.sbatch)
fi
[ -e "${JOBS[0]}" ] || die "no job scripts in $REPO/jobs"

# What jobs inherit from this shell: the repository's venv, scratch checkpoint and trace roots, and
# none of the rank/launcher variables a test harness may have left set.
unset HPCDP_BACKEND RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR MASTER_PORT HPCDP_MASTER_ADDR \
    HPCDP_MASTER_PORT HPCDP_SECRET HPCDP_RESTART_COUNT
export HPCDP_VENV="${HPCDP_VENV:-$REPO/.venv}"
export HPCDP_CKPT_ROOT="$STATE/ckpt"
# SIGUSR1 (the preemption job) also makes ranks write their flight records: not into the repo.
export HPCDP_TRACE_DIR="$STATE/trace"

# The values of the `# ci: KEY ...` lines of job $1 (one per line).
directive() { sed -n "s/^# ci: $2 //p" "$1"; }

# Whether job output $1 has a line matching ERE $2, NULs dropped.  Not `tr | grep -q`: grep -q
# exits at its first match, tr's next write gets SIGPIPE, and under pipefail a line that is there
# reads as missing.
has_line() { local text; text="$(tr -d '\0' <"$1")"; grep -Eq -- "$2" <<<"$text"; }

# Run job $1; write "PASS ..." or "FAIL ..." (first line) and any detail to $OUT/<name>.result.
run_one() {
    local job="$1" name t0 result sbatch_args args timeout out id rc=0 re
    name="$(basename "$job" .sbatch)"
    result="$OUT/$name.result"
    t0=$SECONDS
    fail() { { echo "FAIL $name: $1"; [ -z "${2:-}" ] || tail -n 40 "$2" | tr -d '\0'; } >"$result"; }
    if [ "$(directive "$job" expect | wc -l)" = 0 ]; then
        fail "declares no '# ci: expect REGEX' line, so its output cannot be checked"; return
    fi
    while read -r need; do
        [ -z "$need" ] || [ -e "$REPO/$need" ] || { fail "needs $need, which does not exist (yet)"; return; }
    done < <(directive "$job" needs)
    read -r -a sbatch_args <<<"$(directive "$job" sbatch | tr '\n' ' ')"
    read -r -a args <<<"$(directive "$job" args | tr '\n' ' ')"
    timeout="$(directive "$job" timeout | tail -n 1)"
    timeout="${timeout:-300}"
    out="$OUT/$name.out"
    rm -f "$out"
    # A unique name finds the job id without parsing sbatch's (buffered) stdout.
    (cd "$REPO" && exec sbatch --wait --job-name="ci-$name" --output="$out" \
        "${sbatch_args[@]}" "$job" "${args[@]}") >"$OUT/$name.sbatch" 2>&1 &
    local sb=$!
    while kill -0 "$sb" 2>/dev/null; do
        # A requeued job waits for its old credential to expire (cred_expire in slurm.conf.in);
        # it must not be released early: see there.
        id="$(squeue -h -n "ci-$name" -o %i 2>/dev/null | head -n 1)"
        if ((SECONDS - t0 > timeout)); then
            [ -z "$id" ] || scancel "$id" 2>/dev/null || true
            kill "$sb" 2>/dev/null || true
            wait "$sb" 2>/dev/null || true
            fail "still running after ${timeout} s: cancelled" "$out"; return
        fi
        sleep 1
    done
    wait "$sb" || rc=$?
    if ((rc != 0)); then
        fail "sbatch --wait exited with $rc (the job's exit code) after $((SECONDS - t0)) s" "$out"
        cat "$OUT/$name.sbatch" >>"$result"
        return
    fi
    while read -r re; do
        # sbatch --wait can return before a requeued job's earlier run has all its output in the
        # file (seen once: its lines landed seconds later, in a run of NULs left for them), so a
        # missing line is looked for again for a few seconds before the job fails
        local tries=0
        until has_line "$out" "$re"; do
            if ((++tries > 5)); then
                fail "exit code 0 but its output has no line matching /$re/" "$out"; return
            fi
            sleep 1
        done
    done < <(directive "$job" expect)
    echo "PASS $name ($((SECONDS - t0)) s, $(directive "$job" expect | wc -l) output checks)" >"$result"
}

t_all=$SECONDS
running=0
for job in "${JOBS[@]}"; do
    if ((running >= PARALLEL)); then
        wait -n || true
        running=$((running - 1))
    fi
    say "submitting $(basename "$job")"
    run_one "$job" &
    running=$((running + 1))
done
wait || true

passed=0 failed=0
for job in "${JOBS[@]}"; do
    result="$OUT/$(basename "$job" .sbatch).result"
    if [ -f "$result" ] && head -n 1 "$result" | grep -q '^PASS '; then
        passed=$((passed + 1))
        say "$(head -n 1 "$result")"
    else
        failed=$((failed + 1))
        [ -f "$result" ] || echo "FAIL $(basename "$job" .sbatch): the runner left no result" >"$result"
        say "$(head -n 1 "$result")"
        sed -n '2,$p' "$result" | sed 's/^/    | /' >&2
    fi
done
say "jobs: $passed passed, $failed failed, in $((SECONDS - t_all)) s (output in $OUT)"
((failed == 0))
