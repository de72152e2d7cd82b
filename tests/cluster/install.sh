#!/usr/bin/env bash
# Debian's packages for tests/test_cluster.py (as root): SLURM 22.05 with job accounting
# (slurmdbd on MariaDB) and munge. Installs only what is missing; no daemon starts on install.
set -euo pipefail
PKGS="slurm-wlm munge slurmdbd mariadb-server"
missing=$(for p in $PKGS; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || echo "$p"; done)
[ -z "$missing" ] && { echo "SLURM test packages present: $PKGS"; exit 0; }
[ "$(id -u)" -eq 0 ] || { echo "error: tests/cluster/install.sh: installing $missing needs root -- fix: run make test-cluster as root" >&2; exit 1; }
echo "installing:" $missing
apt-get update -q
DEBIAN_FRONTEND=noninteractive apt-get install -y -q $missing
