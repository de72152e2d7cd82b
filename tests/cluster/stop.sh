#!/usr/bin/env bash
# Stop what tests/cluster/start.sh DIR started (by the pids it recorded) and put back the
# /etc/slurm configs it replaced. Safe to run twice, or after a start that failed half-way.
set -uo pipefail
[ $# -eq 1 ] || { echo "error: tests/cluster/stop.sh: usage: stop.sh DIR -- fix: name the start.sh directory" >&2; exit 1; }
DIR=$(realpath -m "$1")
MARK="# rwkv7-coreai test cluster"

stop_pid() {  # pidfile: TERM, wait up to 10 s, then KILL
  local file=$1 pid
  [ -s "$file" ] || return 0
  pid=$(cat "$file")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "$pid" 2>/dev/null
  fi
  rm -f "$file"
}
if [ -s "$DIR/slurmctld.daemon.pid" ] && kill -0 "$(cat "$DIR/slurmctld.daemon.pid")" 2>/dev/null; then
  timeout 20 scancel --quiet --user=root 2>/dev/null  # jobs a test left behind
fi
for f in "$DIR"/slurmd*.daemon.pid; do stop_pid "$f"; done  # one per node (start.sh DIR NODES)
for d in slurmctld slurmdbd; do stop_pid "$DIR/$d.daemon.pid"; done
stop_pid "$DIR/mariadbd.pid"
if [ -e "$DIR/munge.ours" ]; then stop_pid /run/munge/munged.pid; rm -f "$DIR/munge.ours"; fi
for f in slurm.conf slurmdbd.conf; do
  if [ -e "$DIR/etc/$f.orig" ]; then mv "$DIR/etc/$f.orig" "/etc/slurm/$f"
  elif [ -e "/etc/slurm/$f" ] && grep -qxF "$MARK ($DIR)" "/etc/slurm/$f"; then rm -f "/etc/slurm/$f"; fi
done
exit 0
