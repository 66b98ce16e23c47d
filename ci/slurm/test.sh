#!/usr/bin/env bash
# `make test-slurm`: install Slurm and munge when missing, start the one-node CI cluster, run every
# jobs/*.sbatch with `sbatch --wait`, and stop the daemons again (also on failure or Ctrl-C).
# Exits non-zero if the cluster cannot start here or any job fails.
set -euo pipefail
# shellcheck source=ci/slurm/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
need_root "$@"
t0=$SECONDS
# One CI cluster per machine at a time: a second `make test-slurm` waits for the first.
exec 9>"${HPCDP_SLURM_DIR}.lock"
flock -w 900 9 || die "another ci/slurm/test.sh held ${HPCDP_SLURM_DIR}.lock for 15 minutes"
trap '"$CI_DIR/stop.sh" --quiet' EXIT
"$CI_DIR/start.sh"
rc=0
"$CI_DIR/run-jobs.sh" "$@" || rc=$?
say "test-slurm: $([ $rc = 0 ] && echo passed || echo FAILED) in $((SECONDS - t0)) s"
exit $rc
