#!/usr/bin/env bash
# Put the slurm-hai policy on a running giovtorres/slurm-docker-cluster (started with the
# compose override in this directory), on a fresh accounting database or an existing one,
# then run the shared smoke test (contrib/smoke.sh) on it. Run on the Docker host, from the
# slurm-docker-cluster checkout:
#   SLURM_HAI_DIR=/path/to/slurm-hai $SLURM_HAI_DIR/contrib/slurm-docker/setup.sh
set -euo pipefail
HAI=${SLURM_HAI_DIR:?set SLURM_HAI_DIR to the slurm-hai checkout}
HERE=$HAI/contrib/slurm-docker
COMPOSE=(docker compose -f docker-compose.yml -f "$HERE/docker-compose.hai.yml")

echo "1. the rendered policy into /etc/slurm (a volume every container shares)"
for f in hai-policy.conf partitions.conf plugstack.conf job_submit.lua; do
  docker cp "$HERE/rendered/$f" "slurmctld:/etc/slurm/$f"
done
# where hai and hai-admin look (HAI_POLICY=/etc/slurm/policy.toml in the image)
docker cp "$HERE/policy.toml" slurmctld:/etc/slurm/policy.toml

echo "2. slurm.conf: include the fragments; drop the lines they replace (partition cpu among them)"
docker exec slurmctld bash -c '
  set -e
  c=/etc/slurm/slurm.conf
  if ! grep -q "^Include /etc/slurm/hai-policy.conf" "$c"; then
    cp "$c" "$c.before-hai"
    sed -i -e "/^KillWait=/d" -e "/^SchedulerType=/d" -e "/^PartitionName=cpu /d" \
           -e "/^#*AccountingStorageEnforce=/d" -e "/^#*JobSubmitPlugins=/d" -e "/^#*PlugStackConfig=/d" \
           -e "/^#*PriorityType=/d" "$c"
    cat >> "$c" <<CONF
# ---- slurm-hai (contrib/slurm-docker/setup.sh) ----
AccountingStorageEnforce=associations,limits,qos,safe
JobSubmitPlugins=lua
PlugStackConfig=/etc/slurm/plugstack.conf
Include /etc/slurm/hai-policy.conf
Include /etc/slurm/partitions.conf
CONF
  fi'

echo "3. restart the controller and the workers (PreemptType changes need a restart)"
"${COMPOSE[@]}" restart slurmctld cpu-worker
deadline=$((SECONDS + 120))
until docker exec slurmctld scontrol ping >/dev/null 2>&1; do
  [ $SECONDS -lt $deadline ] || { echo "slurmctld did not answer within 120 s" >&2; exit 1; }
  sleep 1
done

echo "4. accounting: the cluster, account hai holding root, then the QOS ladder (hai-admin apply)"
docker exec slurmctld bash -c '
  set -e
  cluster=$(scontrol show config | sed -n "s/^ClusterName *= *//p")
  sacctmgr -n -P show cluster format=cluster | grep -qx "$cluster" || sacctmgr -i add cluster "$cluster"
  sacctmgr -n -P show account format=account | grep -qx hai || sacctmgr -i add account hai cluster="$cluster"
  sacctmgr -n -P show assoc account=hai format=user | grep -qx root || sacctmgr -i add user root account=hai cluster="$cluster"
  sacctmgr -i modify user where name=root set defaultaccount=hai
  hai-admin apply --adopt normal'

echo "5. the smoke test (the same script the local cluster and the Debian containers run)"
docker exec slurmctld bash -c "SMOKE_DIR=/data/hai-smoke-\$\$ SMOKE_GPUS=0 SMOKE_NODES=2 bash /opt/slurm-hai/contrib/smoke.sh"
