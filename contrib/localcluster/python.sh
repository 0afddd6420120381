# Finds a Python with jinja2 for the cluster scripts: the project's .venv if there is one,
# else a small bootstrap venv under the state dir (the scripts must work before `make`).
repo=$(cd "$here/../.." && pwd)
if [ -x "$repo/.venv/bin/python" ] && "$repo/.venv/bin/python" -c 'import jinja2' 2>/dev/null; then
  HAI_PY="$repo/.venv/bin/python"
else
  boot="${HAI_CLUSTER_DIR:-/var/lib/slurm-hai/localcluster}/bootstrap-venv"
  if ! "$boot/bin/python" -c 'import jinja2' 2>/dev/null; then
    command -v python3 >/dev/null || { echo "localcluster: python3 is required (apt-get install python3 python3-venv)" >&2; exit 1; }
    python3 -m venv "$boot" && "$boot/bin/pip" install -q jinja2 >/dev/null
  fi
  HAI_PY="$boot/bin/python"
fi
