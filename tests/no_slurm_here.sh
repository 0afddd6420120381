#!/bin/sh
# Run COMMAND... as in a container without Slurm (pyxis/enroot, Apptainer): in a user and a
# mount namespace of its own, as the same user, where every Slurm command in every directory
# of PATH is covered by /dev/null (it cannot be run). The job's directory, /dev/shm and the
# rest are as outside. The first namespace maps the user to root, which may mount; the
# second maps it back.
set -eu
exec unshare --user --map-root-user --mount -- sh -c '
  set -eu
  for dir in $(echo "$PATH" | tr ":" " "); do
    for c in scontrol scancel squeue sbatch srun sinfo sacct sacctmgr; do
      if [ -f "$dir/$c" ]; then mount --bind /dev/null "$dir/$c"; fi
    done
  done
  if command -v scontrol >/dev/null; then echo "no_slurm_here: scontrol still runs" >&2; exit 1; fi
  echo "no_slurm_here: no Slurm command here" >&2
  uid=$0 gid=$1
  shift
  exec unshare --user --map-user="$uid" --map-group="$gid" -- "$@"' "$(id -u)" "$(id -g)" "$@"
