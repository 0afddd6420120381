#!/bin/bash
# What every container of contrib/slurm-docker/up runs under tini: its daemons, then it waits.
#   hai-docker-boot controller   munged, MariaDB (a fresh accounting database), slurmdbd
#                                (`up` then renders the policy, starts slurmctld and applies it)
#   hai-docker-boot node         munged, slurmd, the persist agent (hai-admin persist-agent)
# /etc/slurm is the cluster's configuration (shared), /data its shared file system,
# /var/log/slurm this container's log directory on the host.
set -euo pipefail
role=${1:?usage: hai-docker-boot controller|node}

say() { echo "hai-docker-boot $(date +%T) $*"; }
wait_until() {  # wait_until WHAT SECONDS COMMAND...
  local what=$1 deadline=$((SECONDS + $2)); shift 2
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $deadline ] || { say "gave up waiting for $what"; exit 1; }
    sleep 0.1
  done
}

# The container starts with no network (--network none); `up` gives it eth0 on the cluster's
# bridge right after, and Slurm's daemons must not start before it is there.
wait_until "eth0 (wired by contrib/slurm-docker/up)" 60 ip -4 -o addr show dev eth0 scope global
chown slurm:slurm /var/log/slurm
install -o munge -g munge -m 0400 /etc/slurm/munge.key /etc/munge/munge.key
install -d -o munge -g munge /run/munge
runuser -u munge -- munged
say "munged started"

case $role in
controller)
  install -d -o mysql -g mysql /run/mysqld
  mariadbd --user=mysql --skip-networking &  # its log: docker logs
  wait_until "MariaDB" 60 mariadb -e "SELECT 1"
  # slurmdbd (user slurm) logs in over the socket as its own Unix user: no password anywhere
  mariadb -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
              CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED VIA unix_socket;
              GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"
  chown slurm:slurm /etc/slurm/slurmdbd.conf
  chmod 600 /etc/slurm/slurmdbd.conf
  slurmdbd
  say "MariaDB and slurmdbd started"
  ;;
node)
  # --cgroupns private shows this container's cgroups as each v1 hierarchy's root, mounted
  # read-only; slurmd's proctrack/task cgroup plugins create slurm_<node>/... there.
  for hierarchy in /sys/fs/cgroup/*/; do
    [ "$hierarchy" = /sys/fs/cgroup/unified/ ] || mount -o remount,bind,rw "$hierarchy"
  done
  # Fake GPUs (gres.conf names them): ConstrainDevices lets a job open only those it was given.
  for i in 0 1; do [ -e /dev/nvidia$i ] || mknod -m 666 /dev/nvidia$i c 195 $i; done
  slurmd
  hai-admin persist-agent --sweep-every 5 >>/var/log/slurm/persist-agent.log 2>&1 &
  say "slurmd and the persist agent started"
  ;;
*)
  say "unknown role $role"; exit 2 ;;
esac
exec sleep infinity
