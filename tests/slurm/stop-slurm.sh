#!/usr/bin/env bash
# Stop the daemons tests/slurm/start-slurm.sh started, by the PIDs it saved in
# $SLURM_DIR/run (its private munged included). Cancels the cluster's remaining
# jobs first, so no slurmstepd or job process is left behind.
set -uo pipefail
SLURM_DIR=${SLURM_DIR:-/tmp/gcwrap-slurm}
PIDDIR=$SLURM_DIR/run
export SLURM_CONF=${SLURM_CONF_FILE:-$SLURM_DIR/slurm.conf}

stop_pid() {   # name pidfile
  local name=$1 f=$2 pid
  [[ -f "$f" ]] || return 0
  pid=$(cat "$f")
  if kill -0 "$pid" 2>/dev/null && [[ "$(cat /proc/$pid/comm 2>/dev/null)" == "$name" ]]; then
    kill -TERM "$pid"
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid"; echo "[stop-slurm] $name ($pid) killed"; else echo "[stop-slurm] $name ($pid) stopped"; fi
  else
    echo "[stop-slurm] $name: pid $pid not running"
  fi
  rm -f "$f"
}

# cancel leftover jobs while the controller is still up
if [[ -f $PIDDIR/slurmctld.pid ]] && kill -0 "$(cat "$PIDDIR/slurmctld.pid")" 2>/dev/null; then
  jobs=$(squeue -h -o %i 2>/dev/null || true)
  if [[ -n "$jobs" ]]; then
    # shellcheck disable=SC2086
    scancel $jobs 2>/dev/null || true
    for _ in $(seq 100); do [[ -z "$(squeue -h -o %i 2>/dev/null)" ]] && break; sleep 0.1; done
  fi
fi
stop_pid slurmd    "$PIDDIR/slurmd.pid"
stop_pid slurmctld "$PIDDIR/slurmctld.pid"
stop_pid munged    "$PIDDIR/munged.pid"
exit 0
