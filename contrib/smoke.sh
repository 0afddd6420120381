#!/usr/bin/env bash
# slurm-hai smoke test: submit a small resumable job with hai-submit, suspend it with
# `hai suspend`, and check that it is requeued, resumes where it stopped and finishes once.
#
# The same script runs on the local cluster (tests/cluster/test_acceptance.py runs it) and
# on giovtorres/slurm-docker-cluster (contrib/slurm-docker/README.md). Needs: the Slurm
# client commands and slurm-hai's hai-submit/hai on PATH, a cluster with the HAI QOS ladder
# applied (hai-admin apply), and a directory every node sees.
#
# Environment (all optional):
#   SMOKE_DIR    shared directory for the job script and state  [/tmp/slurm-hai-smoke-$$]
#   HAI_HOME     where hai-submit keeps job directories (must be shared too)  [$SMOKE_DIR/hai]
#   SMOKE_LEVEL  priority level  [LOW]       SMOKE_NODES  nodes  [1]
#   SMOKE_GPUS   --gpus-per-node (0 on clusters without GPUs)  [0]
#   SMOKE_TIMEOUT seconds for each wait  [120]
# Exit status 0 and "SMOKE PASSED" on success; otherwise "SMOKE FAILED: why" and 1.
set -euo pipefail

SMOKE_DIR=${SMOKE_DIR:-/tmp/slurm-hai-smoke-$$}
export HAI_HOME=${HAI_HOME:-$SMOKE_DIR/hai}
LEVEL=${SMOKE_LEVEL:-LOW}
NODES=${SMOKE_NODES:-1}
GPUS=${SMOKE_GPUS:-0}
TIMEOUT=${SMOKE_TIMEOUT:-120}
UNITS=40

say() { printf 'smoke %(%H:%M:%S)T %s\n' -1 "$*"; }
die() { echo "SMOKE FAILED: $*" >&2; [ -n "${JOB:-}" ] && { hai logs "$JOB" 2>&1 | tail -20 >&2 || true; }; exit 1; }

for tool in sinfo squeue hai-submit hai python3; do
  command -v "$tool" >/dev/null || die "$tool is not on PATH"
done
sinfo -h >/dev/null 2>&1 || die "the cluster does not answer (sinfo); is SLURM_CONF set?"
mkdir -p "$SMOKE_DIR" "$HAI_HOME"

# The job: UNITS units of 0.2 s; progress is the whole-life state (kept across restarts);
# on the suspend notice (rank 0's node) it records its progress and calls go_suspend().
cat > "$SMOKE_DIR/smoke_job.py" <<'PY'
import os, sys, time
import slurm_hai as hai

units = int(sys.argv[1])
rank = int(os.environ["RANK"])
done = hai.get_whole_life_state()
print(f"run {hai.restart_count()} starts at unit {done} on {os.uname().nodename}", flush=True)
while done < units:
    if rank == 0 and hai.receive_suspend_command():
        print(f"notice at unit {done}: suspending", flush=True)
        hai.go_suspend()
    time.sleep(0.2)
    if rank == 0:
        done += 1
        hai.set_whole_life_state(done)
        print(f"unit {done}", flush=True)
    else:
        done = hai.get_whole_life_state()
print(f"finished {done} units", flush=True)
PY

field() {  # field JOB KEY: one value of `hai status --json JOB`
  hai status --json "$1" | python3 -c "import json,sys; print(json.load(sys.stdin)[sys.argv[1]])" "$2"
}

wait_until() {  # wait_until WHAT COMMAND...: poll until COMMAND succeeds
  local what=$1; shift
  local deadline=$((SECONDS + TIMEOUT))
  until "$@"; do
    [ $SECONDS -lt $deadline ] || die "timed out after ${TIMEOUT}s waiting for $what"
    sleep 0.5
  done
}

log_has() { hai logs "$JOB" 2>/dev/null | grep -q -- "$1"; }
state_is() { [ "$(field "$JOB" state)" = "$1" ]; }
finished() { case "$(field "$JOB" state)" in finished-*) return 0 ;; esac; return 1; }

say "submitting $SMOKE_DIR/smoke_job.py at $LEVEL on $NODES node(s)"
JOB=$(hai-submit --json -n "$NODES" -p "$LEVEL" --gpus-per-node "$GPUS" --grace 5 --name hai-smoke \
        "$SMOKE_DIR/smoke_job.py" -- "$UNITS" | python3 -c "import json,sys; print(json.load(sys.stdin)['job_id'])") \
  || die "hai-submit failed"
say "job $JOB submitted"
wait_until "job $JOB to run" state_is running
wait_until "job $JOB to make progress" log_has "^unit 8$"
say "job $JOB running; hai suspend $JOB"
hai suspend "$JOB" >/dev/null || die "hai suspend failed"
wait_until "the notice to reach job $JOB" log_has "suspending"
wait_until "job $JOB to resume" log_has "^run 1 starts at unit"
resumed=$(hai logs "$JOB" | sed -n 's/^run 1 starts at unit \([0-9]*\).*/\1/p')
noticed=$(hai logs "$JOB" | sed -n 's/^notice at unit \([0-9]*\).*/\1/p')
say "job $JOB requeued and resumed at unit $resumed (suspended at unit $noticed)"
[ "$resumed" = "$noticed" ] && [ "$resumed" -gt 0 ] || die "resumed at unit $resumed, suspended at $noticed"
wait_until "job $JOB to finish" finished
state=$(field "$JOB" state)
[ "$state" = finished-succeeded ] || die "job $JOB ended $state"
[ "$(field "$JOB" restarts)" = 1 ] || die "job $JOB restarted $(field "$JOB" restarts) times, expected 1"
log_has "^finished $UNITS units" || die "job $JOB did not do all $UNITS units"
[ "$(hai logs "$JOB" | grep -c '^==== slurm-hai run')" -ge 2 ] || die "hai logs does not show both runs"
say "job $JOB finished: $UNITS units in 2 runs, logs of both runs in hai logs $JOB"
echo "SMOKE PASSED"
