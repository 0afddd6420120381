"""The Docker cluster's tests (contrib/slurm-docker): run by `make test-docker`, which boots the
cluster (contrib/slurm-docker/up), runs them and brings it down. A plain `pytest` leaves them
out: they need the containers, and only a run that names this directory (or a file of it)
collects them. They never skip: a cluster that is not up fails them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "contrib" / "slurm-docker"))  # docker_cluster
sys.path.insert(0, str(HERE.parent))  # tests/: waiting, uninterrupted


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    named = [Path(arg.split("::")[0]).resolve() for arg in config.args]
    return None if any(p == HERE or HERE in p.parents for p in named) else True


class DockerCluster:
    """The cluster that contrib/slurm-docker/up booted: commands run on its controller
    container; its /data is a directory of this host, where the tests read job directories."""

    def __init__(self) -> None:
        import docker_cluster as dc

        self.dc = dc
        self.controller = dc.container(dc.CONTROLLER)
        self.data = dc.STATE_DIR / "data"
        self.logs = dc.STATE_DIR / "log"

    def run(self, argv: list[str], env: dict[str, str] | None = None, check: bool = True,
            timeout: float = 240) -> subprocess.CompletedProcess:
        """`argv` on the controller (as root), with `env` added to its environment."""
        flags = [arg for k, v in (env or {}).items() for arg in ("-e", f"{k}={v}")]
        p = subprocess.run([self.dc.DOCKER, "exec", "-i", *flags, self.controller, *argv], text=True,
                           capture_output=True, timeout=timeout)
        assert not check or p.returncode == 0, f"{' '.join(argv)}: exit {p.returncode}\n{p.stdout}{p.stderr}"
        return p

    def shared_dir(self, name: str) -> tuple[Path, str]:
        """A new directory of /data: (its path here, its path in the containers)."""
        here = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.data))
        here.chmod(0o777)
        return here, f"/data/{here.name}"

    def submit(self, hai_home: str, script: str, *opts: str, args: list[str] = ()) -> tuple[int, Path]:
        """hai-submit on the controller; (job id, the job directory as this host sees it)."""
        p = self.run(["hai-submit", "--json", "--gpus-per-node", "0", *opts, script, "--", *args],
                     env={"HAI_HOME": hai_home})
        info = json.loads(p.stdout)
        return info["job_id"], self.data / Path(info["job_dir"]).relative_to("/data")

    def job(self, job_id: int) -> dict[str, str]:
        line = self.run(["scontrol", "show", "job", "-o", str(job_id)]).stdout
        return dict(p.split("=", 1) for p in line.split() if "=" in p)

    def node_state(self, node: str) -> str:
        return self.run(["sinfo", "-h", "-n", node, "-o", "%t"], check=False).stdout.strip()

    def kill_node(self, node: str) -> None:
        """What losing a machine does: every process of the container killed, its memory gone."""
        subprocess.run([self.dc.DOCKER, "kill", self.dc.container(node)], check=True, capture_output=True)

    def node_up(self, node: str) -> None:
        p = subprocess.run([sys.executable, str(REPO / "contrib" / "slurm-docker" / "docker_cluster.py"), "node-up",
                            node], text=True, capture_output=True, timeout=120)
        assert p.returncode == 0, p.stdout + p.stderr


@pytest.fixture(scope="session")
def docker_cluster() -> DockerCluster:
    c = DockerCluster()
    up = subprocess.run([c.dc.DOCKER, "exec", c.controller, "sinfo", "-h", "-o", "%t"], text=True, capture_output=True)
    if up.returncode != 0 or not up.stdout.split():
        pytest.fail(f"the Docker cluster is not up (run contrib/slurm-docker/up; make test-docker does): "
                    f"{(up.stderr or up.stdout).strip()}")
    return c


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A failed test shows the end of the controller's log: what Slurm did with the jobs."""
    report = yield
    c = getattr(item, "funcargs", {}).get("docker_cluster")
    if report.failed and call.when == "call" and isinstance(c, DockerCluster):
        log = c.logs / c.dc.CONTROLLER / "slurmctld.log"
        if log.exists():
            report.sections.append(("slurmctld.log of the Docker cluster, last 60 lines",
                                    "\n".join(log.read_text(errors="replace").splitlines()[-60:])))
    return report
