#!/usr/bin/env bash
# A single-node SLURM 22.05 (Debian's slurm-wlm, slurmdbd, munge, mariadb-server) for tests,
# started as root on loopback, with job accounting so that `sacct` shows every job:
#   munged (default socket) -> MariaDB (datadir in DIR, 127.0.0.1) -> slurmdbd -> slurmctld -> slurmd
# Usage: tests/cluster/start.sh DIR [NODES]      stop: tests/cluster/stop.sh DIR
# NODES > 1: that many slurmd "nodes" (n1..nNODES) on this one host (Debian's slurm-wlm is built with
# MULTIPLE_SLURMD), each with this host's CPUs and memory (oversubscribed: they share them).
# NODE_CPUS / NODE_MEM_MB (environment) offer each node that many CPUs / MB instead: e.g. two
# nodes of half the host's memory never run jobs whose requests add up to more than the host has;
# CPUs above the host's are accepted (SlurmdParameters=config_overrides) for jobs that ask more
# threads than this host has, at the cost of sharing its cores.
# Everything lives in DIR (state, spool, logs, pid files) except the two config files, which
# must be /etc/slurm/slurm.conf and slurmdbd.conf (the Snakemake jobstep plugin drops SLURM_CONF
# before its inner srun); any existing ones are saved in DIR and put back by stop.sh.
set -euo pipefail
MARK="# rwkv7-coreai test cluster"

die() { echo "error: tests/cluster/start.sh: $1 -- fix: $2" >&2; exit 1; }
[ $# -eq 1 ] || [ $# -eq 2 ] || die "usage: start.sh DIR [NODES]" "name a scratch directory"
NODES=${2:-1}
[[ "$NODES" =~ ^[1-9][0-9]?$ ]] || die "NODES is '$NODES'" "give a node count from 1 to 99"
[ "$(id -u)" -eq 0 ] || die "must run as root (slurmd runs the jobs as root here)" "run it as root"
for cmd in munged munge slurmctld slurmd slurmdbd sacct mariadbd mariadb-install-db mariadb; do
  command -v "$cmd" >/dev/null || die "$cmd not found" "apt-get install -y slurm-wlm munge slurmdbd mariadb-server (tests/cluster/install.sh)"
done
if pid=$(pgrep -x slurmctld); then
  die "a slurmctld is already running (pid $pid)" "stop it first (tests/cluster/stop.sh DIR of that cluster)"
fi

HOST_MEM=$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')
HOST_CPUS=$(slurmd -C | sed -n 's/.*CPUs=\([0-9]*\).*/\1/p')
MEM=${NODE_MEM_MB:-$HOST_MEM}; CPUS=${NODE_CPUS:-$HOST_CPUS}
[[ "$MEM" =~ ^[1-9][0-9]*$ ]] && [ "$MEM" -le "$HOST_MEM" ] || die "NODE_MEM_MB is '$MEM'" "give MB from 1 to this host's $HOST_MEM"
[[ "$CPUS" =~ ^[1-9][0-9]*$ ]] || die "NODE_CPUS is '$CPUS'" "give a CPU count of 1 or more"
OVERRIDES=""
[ "$CPUS" -le "$HOST_CPUS" ] || OVERRIDES="SlurmdParameters=config_overrides"
DIR=$(realpath -m "$1")
mkdir -p "$DIR"/{state,spool,log,db,etc}
chmod 755 "$DIR"
HOST=$(hostname -s)
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
wait_for() {  # seconds, description, command...
  local limit=$1 what=$2; shift 2
  for _ in $(seq $((limit * 5))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done
  die "$what did not come up within ${limit} s" "see the logs in $DIR/log"
}

# --- munge: reuse a running munged, else start one on the default socket ---------------------
if ! munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
  install -d -o munge -g munge -m 0755 /run/munge
  install -d -o munge -g munge -m 0700 /var/log/munge /var/lib/munge
  runuser -u munge -- munged
  echo started >"$DIR/munge.ours"
  wait_for 10 munged sh -c 'munge -n </dev/null | unmunge'
fi

# --- MariaDB for slurmdbd: its own datadir, TCP on 127.0.0.1 only, a passwordless local user ---
DB_PORT=$(free_port)
mariadb-install-db --no-defaults --user=root --datadir="$DIR/db" --auth-root-authentication-method=socket \
  --skip-test-db >"$DIR/log/mariadb-install.log" 2>&1
mariadbd --no-defaults --user=root --datadir="$DIR/db" --socket="$DIR/db/mysqld.sock" --port="$DB_PORT" \
  --bind-address=127.0.0.1 --pid-file="$DIR/db/mysqld.pid" --log-error="$DIR/log/mariadb.log" \
  --innodb-buffer-pool-size=32M --skip-log-bin >/dev/null 2>&1 &
echo $! >"$DIR/mariadbd.pid"
wait_for 30 MariaDB mariadb --no-defaults -S "$DIR/db/mysqld.sock" -u root -e 'SELECT 1'
mariadb --no-defaults -S "$DIR/db/mysqld.sock" -u root -e "
  CREATE USER 'slurm'@'127.0.0.1'; CREATE USER 'slurm'@'localhost';
  GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1'; GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"

# --- configs: /etc/slurm (saved originals go to DIR/etc) ---------------------------------------
CTLD_PORT=$(free_port); SLURMD_PORT=$(free_port); DBD_PORT=$(free_port)
for f in slurm.conf slurmdbd.conf; do
  if [ -e "/etc/slurm/$f" ] && ! grep -q "^$MARK" "/etc/slurm/$f"; then cp -p "/etc/slurm/$f" "$DIR/etc/$f.orig"; fi
done
if [ "$NODES" -eq 1 ]; then
  NAMES=("$HOST"); NODE_LIST=$HOST
  NODE_LINES="NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM State=UNKNOWN"
else
  NAMES=(); NODE_LINES=""
  for i in $(seq "$NODES"); do
    NAMES+=("n$i")
    NODE_LINES+="NodeName=n$i NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$(free_port) CPUs=$CPUS RealMemory=$MEM State=UNKNOWN"$'\n'
  done
  NODE_LIST="n[1-$NODES]"
fi
for n in "${NAMES[@]}"; do mkdir -p "$DIR/spool/$n"; done
mkdir -p /etc/slurm
cat >/etc/slurm/slurm.conf <<CONF
$MARK ($DIR)
ClusterName=rwkv7test
SlurmctldHost=localhost
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=500
MailProg=/bin/true
ReturnToService=2
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
AccountingStoreFlags=job_comment
JobAcctGatherType=jobacct_gather/linux
$OVERRIDES
$NODE_LINES
PartitionName=main Nodes=$NODE_LIST Default=YES MaxTime=INFINITE State=UP
CONF
cat >/etc/slurm/slurmdbd.conf <<CONF
$MARK ($DIR)
AuthType=auth/munge
DbdHost=localhost
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$DIR/slurmdbd.pid
LogFile=$DIR/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StorageLoc=slurm_acct_db
CONF
chmod 600 /etc/slurm/slurmdbd.conf

# --- daemons, in the foreground of background shells (so their pids are ours) -----------------
slurmdbd -D >"$DIR/log/slurmdbd.out" 2>&1 &
echo $! >"$DIR/slurmdbd.daemon.pid"
wait_for 30 slurmdbd sacctmgr -n list cluster
slurmctld -D -i >"$DIR/log/slurmctld.out" 2>&1 &
echo $! >"$DIR/slurmctld.daemon.pid"
wait_for 30 slurmctld scontrol ping
for n in "${NAMES[@]}"; do
  slurmd -D -N "$n" >"$DIR/log/slurmd-$n.out" 2>&1 &
  echo $! >"$DIR/slurmd-$n.daemon.pid"
done
for n in "${NAMES[@]}"; do wait_for 30 "node $n" sh -c "sinfo -h -N -n '$n' -o %T | grep -qx idle"; done
wait_for 30 "cluster registration in slurmdbd" sh -c "sacctmgr -n -P list cluster format=cluster | grep -qx rwkv7test"
echo "cluster up: partition main, node(s) $NODE_LIST ($CPUS CPUs, $MEM MB each), slurmctld :$CTLD_PORT, slurmdbd :$DBD_PORT, MariaDB 127.0.0.1:$DB_PORT; state in $DIR"
