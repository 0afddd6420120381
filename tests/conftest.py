"""Shared fixtures: the live local Slurm cluster that the project boots itself.

Cluster tests are marked `cluster`. They never skip: if the cluster cannot be booted the
session fails, because a skipped cluster test would stand in for an unproven feature.
Set HAI_CLUSTER_DIR / HAI_CLUSTER_PORT_BASE to use a second, private cluster instance, and
HAI_SLURM_SOURCE (a tarball) or HAI_SLURM_PREFIX (an install) to run it on another Slurm
than Debian's (tests/each_slurm.py does that for every tarball of a directory).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

REPO = Path(__file__).resolve().parents[1]
LOCALCLUSTER = REPO / "contrib" / "localcluster" / "localcluster.py"
# tests/with_pyslurm needs pyslurm built against the cluster's Slurm (25.11): tests/each_slurm.py
# runs it in its own virtualenv; the main venv has no pyslurm and does not collect it. (The
# directory is not named pyslurm: on sys.path it would pass for the package.)
collect_ignore = [] if importlib.util.find_spec("pyslurm") else ["with_pyslurm"]
STATE = Path(os.environ.get("HAI_CLUSTER_DIR", "/var/lib/slurm-hai/localcluster"))
TEST_USERS = ("hai-alice", "hai-bob", "hai-carol", "hai-dave")  # contrib/localcluster creates them
TESTED_RELEASES: list[str] = []  # the Slurm release the session's cluster runs, once booted


def parse_scontrol(line: str) -> dict[str, str]:
    """`scontrol show job -o` prints KEY=VALUE pairs; values may hold spaces."""
    parts = re.split(r" (?=[A-Za-z/:]+=)", line.strip())
    return dict(p.split("=", 1) for p in parts if "=" in p)


class LiveCluster:
    def __init__(self, state: Path) -> None:
        self.state = state
        self.conf = state / "etc" / "slurm.conf"
        self.log_dir = state / "log"
        self.users = TEST_USERS
        bindir = str(Path(os.sys.executable).parent)
        prefix_file = state / "etc" / "slurm-prefix"  # written by `up`: empty for Debian's Slurm
        prefix = (prefix_file.read_text().strip() if prefix_file.exists() else "") or "/usr"
        slurm_bin = f"{prefix}/bin:{prefix}/sbin:"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf), "PATH": f"{bindir}:{slurm_bin}{os.environ['PATH']}"}
        self.release = subprocess.run(["sinfo", "--version"], env=self.env, text=True,
                                      capture_output=True).stdout.split()[-1]
        self.shown: list[Path] = []  # job directories a failed test shows (show_on_failure)

    def show_on_failure(self, *job_dirs: Path) -> None:
        """If this test fails, show these job directories beside its traceback: the events and
        what slurm-hai said in each rank log (CI keeps no job directory)."""
        self.shown.extend(job_dirs)

    def run(self, argv: list[str], *, user: str | None = None, check: bool = True, timeout: float = 60,
            input: str | None = None, cwd: str | Path | None = None) -> subprocess.CompletedProcess:
        if cwd is None:  # where sbatch writes slurm-%j.out by default: never the repository
            cwd = f"/home/{user}" if user in self.users else self.shared_root()
        if user:
            # --preserve-environment keeps SLURM_CONF and PATH; HOME etc. are reset below.
            argv = ["runuser", "-u", user, "--", "env", f"HOME=/home/{user}", f"USER={user}", f"LOGNAME={user}", *argv]
        p = subprocess.run([str(a) for a in argv], env=self.env, text=True, capture_output=True, timeout=timeout,
                           input=input, cwd=cwd)
        if check and p.returncode != 0:
            raise AssertionError(f"{' '.join(map(str, argv))} exited {p.returncode}:\n{p.stdout}\n{p.stderr}")
        return p

    def node_pid(self, node: str) -> int:
        """The process that holds `node`'s mount namespace (contrib/localcluster: each node
        has its own /dev/shm and /tmp)."""
        return int((self.state / "run" / f"node-{node}.pid").read_text().split()[0])

    @staticmethod
    def uid(user: str) -> int:
        return pwd.getpwnam(user).pw_uid

    def on_node(self, node: str, argv: list[str], *, user: str | None = None,
                check: bool = True) -> subprocess.CompletedProcess:
        """Run `argv` on `node`: in its mount namespace (as `user`), as a job there would."""
        inner = ["runuser", "-u", user, "--", *argv] if user else argv
        return self.run(["nsenter", f"--target={self.node_pid(node)}", "--mount", "--", *inner], check=check)

    @property
    def tracks_by_cgroup(self) -> bool:
        """Whether the nodes track jobs by cgroup (contrib/localcluster's default layout)."""
        f = self.state / "etc" / "proctrack"
        return f.exists() and f.read_text().strip() == "cgroup"

    @staticmethod
    def cgroup_of(pid: int, controller: str = "freezer") -> str | None:
        """Process `pid`'s cgroup in `controller`'s hierarchy, as the host sees it (None: gone)."""
        try:
            lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        except OSError:
            return None
        return next((line.split(":", 2)[2] for line in lines if line.split(":", 2)[1] == controller), None)

    def node_of(self, pid: int) -> str | None:
        """The node `pid` runs on (whose mount namespace it is in), or None."""
        try:
            ns = os.readlink(f"/proc/{pid}/ns/mnt")
        except OSError:
            return None
        for f in (self.state / "run").glob("node-n*.pid"):
            with contextlib.suppress(OSError, ValueError):
                if os.readlink(f"/proc/{int(f.read_text().split()[0])}/ns/mnt") == ns:
                    return f.stem.removeprefix("node-")
        return None

    def slurmd_pid(self, node: str) -> int | None:
        """The pid of `node`'s slurmd if it runs, else None."""
        try:
            pid = int((self.state / "run" / f"slurmd-{node}.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        return pid if Path(f"/proc/{pid}").exists() else None

    def stop_slurmd(self, node: str) -> None:
        """SIGTERM `node`'s slurmd and wait until it is gone (the node's job steps and its
        memory stay: a slurmd restart is not the node's loss)."""
        from waiting import wait_for

        pid = self.slurmd_pid(node)
        assert pid is not None, f"slurmd of {node} is not running"
        os.kill(pid, signal.SIGTERM)
        wait_for(lambda: not Path(f"/proc/{pid}").exists(), 20, f"slurmd {node} to stop", 0.1)

    def in_service(self, node: str) -> bool:
        """Whether `node` takes jobs (idle, allocated or mixed in sinfo)."""
        return self.run(["sinfo", "-h", "-n", node, "-o", "%t"]).stdout.strip() in ("idle", "alloc", "mix")

    def node_up(self, node: str) -> None:
        """Start `node` again: its slurmd, in a fresh namespace if the node was lost."""
        self.run([sys.executable, str(LOCALCLUSTER), "node-up", node])

    def lose_node(self, node: str) -> None:
        """Kill every process on `node` (its slurmd, job steps, the holder of its /dev/shm and
        /tmp): what losing the node does."""
        self.run([sys.executable, str(LOCALCLUSTER), "node-lose", node])

    def sbatch(self, *args: str, user: str | None = None, script: str | None = None) -> int:
        argv = ["sbatch", "--parsable", *args]
        p = self.run(argv, user=user, input=script)
        return int(p.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        p = self.run(["scontrol", "show", "job", "-o", str(job_id)], check=False)
        return parse_scontrol(p.stdout) if p.returncode == 0 and p.stdout.strip() else {}

    def wait_job(self, job_id: int, predicate: Callable[[dict[str, str]], bool], timeout: float, what: str,
                 interval: float = 0.5) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info and predicate(info):
                return info
            time.sleep(interval)
        raise AssertionError(f"job {job_id}: timed out after {timeout} s waiting for {what}; last state: "
                             f"{info.get('JobState')} reason={info.get('Reason')} restarts={info.get('Restarts')}")

    def cancel_all(self) -> None:
        """Cancel every job and wait until the nodes are free. The cancel is sent again every
        5 s: a policy daemon may requeue a job that its cancel ended (a yield in flight; seen
        on 26.05, the job then started again and held its node)."""
        deadline = time.monotonic() + 60
        cancel_at = 0.0
        while time.monotonic() < deadline:
            if time.monotonic() >= cancel_at:
                for user in ("root", *self.users):
                    self.run(["scancel", "--full", "--quiet", f"--user={user}"], check=False)
                cancel_at = time.monotonic() + 5
            q = self.run(["squeue", "-h", "-o", "%i"], check=False).stdout.split()
            busy = self.run(["sinfo", "-h", "-N", "-t", "alloc,mix,comp", "-o", "%N"], check=False).stdout.split()
            if not q and not busy:
                return
            time.sleep(0.5)
        raise AssertionError(f"cluster did not drain: jobs {q}, busy nodes {busy}")

    def settle(self) -> None:
        """Start each test on a cluster that starts a job on every node at once. Two ways seen
        for idle nodes to refuse jobs, each fixed by `scontrol reconfigure` (it rebuilds
        slurmctld's node bitmaps and the select plugin's state: read_config.c):
        - 22.05, some job ends (a job that gave a node back with a resize, and a job on that
          node, both cancelled): nodes IDLE in sinfo but out of the idle/share node bitmaps
          until the next ping of those nodes (every SlurmdTimeout/3 s, skipped for nodes heard
          from lately);
        - 25.11 and 26.05 with proctrack/cgroup, a job cancelled while its step launches (within
          0.2 s of its start here; up to seconds on a loaded host, as the teardown of a test
          cancels a job that was just requeued): its nodes IDLE, no GPU, CPU or memory
          allocated, yet the next job on them waits (reason Resources) 30-43 s, until a
          backfill pass starts it (tests/each_slurm.py's runs, stop 68).
        For 25-43 s every scheduling pass says the nodes are busy. A job on every node shows it
        here, and one reconfigure after 2 s ends it."""
        nodes = len(self.run(["sinfo", "-h", "-N", "-o", "%N"]).stdout.split())
        # whole nodes with their 8 GPUs: allowed under HAI's 8-GPU rule too (test_min_gpus.py)
        probe = self.sbatch("-N", str(nodes), "--gres=gpu:8", "-o", "/dev/null", "-J", "settle", "--wrap", "true")
        start = time.monotonic()
        reconfigured = False
        while time.monotonic() < start + 60:
            if not self.run(["squeue", "-h", "-j", str(probe), "-o", "%i"], check=False).stdout.strip():
                return
            if not reconfigured and time.monotonic() > start + 2:
                self.run(["scontrol", "reconfigure"])
                reconfigured = True
            time.sleep(0.2)
        raise AssertionError(f"a job on all {nodes} idle nodes did not run within 60 s: {self.job(probe)}")

    def shared_root(self) -> Path:
        """<state dir>/shared/tests: what every node sees (the local cluster's "shared file
        system"; /tmp is each node's own), apart for each cluster instance."""
        base = self.state / "shared" / "tests"
        base.mkdir(mode=0o755, parents=True, exist_ok=True)
        base.chmod(0o755)
        return base

    def shared_dir(self, name: str, owner: str | None = None) -> Path:
        """A fresh directory all nodes (this host) see, owned by `owner` (root if None)."""
        d = self.shared_root() / name
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(mode=0o700)
        if owner:
            shutil.chown(d, owner, owner)
        return d


@pytest.fixture(scope="session")
def cluster() -> LiveCluster:
    """Boot the local cluster (or reuse a healthy one). Fails, never skips.

    `up` is idempotent; HAI_CLUSTER_REUSE=1 only checks that the cluster runs (faster
    while developing: nothing is re-rendered)."""
    script = "status" if os.environ.get("HAI_CLUSTER_REUSE") == "1" else "up"
    p = subprocess.run([str(REPO / "contrib" / "localcluster" / script)], text=True, capture_output=True)
    if p.returncode != 0:
        pytest.fail(f"contrib/localcluster/{script} failed:\n{p.stdout}\n{p.stderr}", pytrace=False)
    print(p.stdout.strip())
    live = LiveCluster(STATE)
    TESTED_RELEASES.append(live.release)
    return live


@pytest.fixture
def live(cluster: LiveCluster, request: pytest.FixtureRequest) -> LiveCluster:
    """The cluster with no job left from an earlier test, and none left behind by this one."""
    cluster.cancel_all()
    cluster.settle()
    cluster.shown.clear()
    yield cluster
    cluster.cancel_all()


# Cluster tests of our own behaviour over whatever Slurm runs underneath: the wording and the
# files of the front door, and checkpoint crash safety. They run on Debian's 22.05 only; every
# other cluster test depends on how a Slurm version behaves (preemption, requeue, signals,
# records, config spellings, the SPANK and Lua plugins) and is marked `slurm_boundary`:
# tests/each_slurm.py runs those on every other version (README, "Tests").
ONE_VERSION = {
    # a site's cluster from the wheel: the install steps and their removal (the Slurm
    # boundary they cross, plan/apply and preemption, is every version's in test_site_policy.py)
    "test_site_install.py::test_added_from_the_wheel_to_a_sites_cluster_preempts_resumes_bitwise_and_comes_out_leaving_it_as_it_was",
    # a new admin's commands from the admin guide, on the same site cluster
    "test_site_install.py::test_a_new_admin_sets_it_up_from_the_wheel_with_the_admin_guides_commands_and_takes_it_out_again",
    "test_frontdoor.py::test_arguments_after_the_script_reach_it_unchanged",
    "test_newcomer.py::test_a_new_user_in_a_fresh_shell_is_told_what_to_ask_for_and_then_runs_the_readmes_first_job",
    "test_newcomer.py::test_a_job_submitted_from_an_interpreter_the_nodes_cannot_see_says_so_in_status_and_logs",
    "test_frontdoor.py::test_submit_refuses_what_could_only_fail_later_as_the_jobs_user",
    "test_frontdoor.py::test_every_command_shown_in_the_readme_the_guide_and_the_help_works",
    "test_frontdoor.py::test_ctrl_c_in_logs_follow_says_the_job_goes_on",
    "test_frontdoor.py::test_output_cut_short_by_head_ends_quietly",
    # the cause's words; the notices themselves cross the boundary in test_jobs.py
    "test_frontdoor.py::test_a_notice_from_the_time_limit_says_time_limit",
    "test_frontdoor.py::test_hai_suspend_is_by_you_and_a_forced_suspend_shows_in_status",
    # resuming from the last commit after a forced suspend; forcing itself: test_jobs.py, test_grace.py
    "test_acceptance.py::test_job_that_ignores_the_notice_is_forced_off_and_resumes_from_its_last_checkpoint",
    "test_acceptance.py::test_kill_9_in_the_middle_of_a_save_resumes_from_the_last_committed_checkpoint",
    "test_acceptance.py::test_slurm_docker_rendered_policy_is_up_to_date",
    "test_local_nodes.py::test_a_node_s_dev_shm_and_tmp_are_its_own_survive_a_slurmd_restart_and_die_with_the_node",
    "test_integrations.py::test_hf_trainer_preempted_twice_ends_with_the_weights_of_an_uninterrupted_run",
    "test_integrations.py::test_lightning_preempted_and_resumed_ends_with_the_weights_of_an_uninterrupted_run",
    "test_hostile_users.py::test_a_run_that_cannot_start_says_why_in_status_and_logs",
    "test_daemon_faults.py::test_one_daemon_leads_across_hosts_and_the_standby_takes_over_when_it_is_killed",
    "test_daemon_faults.py::test_daemon_killed_in_the_middle_of_a_yield_the_next_one_finishes_it_one_requeue_never_held",
    "test_load.py::test_200_jobs_from_4_users_keep_quotas_and_each_ends_exactly_once",
    "test_metrics_prometheus.py::test_a_preemption_shows_up_in_the_prometheus_series",
    "test_torchrun_live.py::test_torchrun_job_on_two_nodes_is_preempted_and_resumes_bit_for_bit",
    "test_timeline_browser.py::test_timeline_page_shows_a_preemption_in_a_real_browser",
    # CI's 90-minute limit (a rehearsal of .ci/run took 89 min, 2026-11-26): the slowest tests
    # whose Slurm side another slurm_boundary test crosses on every version.
    # Three suspends and resumes: one preemption resumed bitwise is test_site_policy.py's and
    # test_sigterm_notice.py's on every version; the other two repeat it.
    "test_acceptance.py::test_three_suspends_final_weights_bitwise_equal_to_uninterrupted_run",
    # Shrink and grow: a node-range job started, cut and preempted is test_elastic.py's and
    # test_base.py's on every version; the resize cycle is the daemon's and the job's.
    "test_elastic_resize.py::test_an_elastic_job_shrinks_beside_a_higher_job_grows_back_and_ends_as_an_uninterrupted_run",
    # A node lost before the durable commit: the peer copy and the agents are ours; the
    # suspend into node memory and the restart on the same nodes stay on every version.
    "test_suspend_memory.py::test_a_node_lost_after_go_suspend_before_the_durable_commit_resumes_through_its_peer_copy",
    # hai suspend/logs/stop: the requeues they cause are test_jobs.py's other tests on every version.
    "test_jobs.py::test_hai_suspend_logs_and_stop_across_two_restarts",
    # CI's time again (2026-11-27, the network fault tests grew by four): a retry is the batch
    # script's own requeue, which go_suspend's requeue crosses on every version; a full disk
    # is the checkpoint code's and the persist agent's, on a node's own mount.
    "test_jobs.py::test_failure_is_final_unless_retries_allow[1-1]",
    "test_full_disk.py::test_a_full_checkpoint_disk_fails_saves_in_one_line_keeps_the_good_checkpoints_and_the_job_goes_on",
    # CI's time once more (2026-11-27: an estimated 78 min with the network fault tests), each
    # one's Slurm side crossed on every version by another test: a higher QOS requeuing a lower
    # job by test_policy_rules.py's first test; a notice ignored and forced off by
    # test_grace.py's two and test_policy_rules.py's; a TERM notice on rank 0's node only, and
    # the resume after it, by test_site_policy.py's first test; the agents removing the node
    # memory of a job Slurm says is over, by test_suspend_memory.py's first test.
    "test_base.py::test_higher_qos_preempts_lower_which_is_requeued_and_runs_again",
    "test_jobs.py::test_ignored_notice_is_forced_after_grace_and_requeued",
    "test_sigterm_notice.py::test_sigterm_notice_reaches_rank0_only_and_the_job_resumes_with_nothing_lost",
    "test_suspend_memory.py::test_the_agents_remove_the_node_memory_of_a_job_that_is_over_and_keep_a_running_ones",
    # The lighthouse service asks Slurm whether a job ended as the persist agents do (above).
    "test_lighthouse.py::test_a_jobs_lighthouse_runs_while_slurm_holds_the_job_and_through_the_services_kill_9",
    # A lost lighthouse: the parts' resume is torchft's and ours; a task requeued from its own
    # script is test_parts.py's first test on Slurm before 24.05 (this one passed on 25.11.7
    # and 26.05.3 by hand, 2026-11-27).
    "test_parts.py::test_the_jobs_lighthouse_lost_every_part_is_requeued_and_the_job_resumes_from_its_last_commit",
    # Below MIN: the same requeue by the task's own script, and the resume (torchft's and ours)
    "test_parts.py::test_below_min_the_last_part_commits_and_leaves_and_the_job_resumes_from_that_commit",
    # A part's retry: the same requeue by the task's own script, and the heal (torchft's)
    "test_parts.py::test_a_part_that_fails_on_its_own_is_requeued_with_retries_and_rejoins_from_a_live_peer",
    # Hostile users against our own services (issue 57): what they bound is ours, not Slurm's
    # (the SPANK plugin's bounds stay on every version: it is loaded by each Slurm).
    "test_daemon_faults.py::test_what_a_user_plants_in_a_job_directory_never_stops_or_fools_the_daemon",
    "test_daemon_faults.py::test_a_lock_where_users_can_write_is_refused_in_one_line",
    "test_lighthouse.py::test_only_the_jobs_owner_gets_its_lighthouse_and_a_slow_client_holds_no_ask",
    "test_metrics_prometheus.py::test_a_slow_client_and_idle_connections_of_a_user_do_not_stall_prometheus_scrapes",
    "test_persist_agent_hostile.py::test_a_users_fifo_link_and_oversized_requests_are_refused_and_do_not_hold_another_users_save",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/cluster/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.cluster)
            # the netns tests run on a cluster of their own layout, 22.05's (make test-netns)
            if f"{Path(str(item.fspath)).name}::{item.name}" not in ONE_VERSION and not item.get_closest_marker("netns"):
                item.add_marker(pytest.mark.slurm_boundary)
        elif "tests/gpu/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.gpu)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A cluster test that failed shows slurmctld's last log lines beside its traceback: what
    Slurm did with the jobs is often the cause, and CI keeps no cluster directory."""
    report = yield
    c = getattr(item, "funcargs", {}).get("cluster")
    if report.failed and call.when == "call" and isinstance(c, LiveCluster):
        for name in ("slurmctld.log", "slurmctld-backup.log"):
            log = c.log_dir / name
            if log.exists():
                report.sections.append((f"{name}, last 60 lines",
                                        "\n".join(log.read_text(errors="replace").splitlines()[-60:])))
        for job_dir in c.shown:
            report.sections.append((f"job directory {job_dir}", _job_dir_digest(job_dir)))
    return report


def _job_dir_digest(job_dir: Path) -> str:
    """A job directory's events, and its rank logs' run headers and slurm-hai lines (torchft's
    own lines, one per step, are left out), with the last lines of each."""
    out = []
    for f in [job_dir / "events.jsonl", *sorted((job_dir / "logs").glob("*.log"))]:
        try:
            lines = f.read_text(errors="replace").splitlines()
        except OSError as e:
            out.append(f"{f.name}: {e}")
            continue
        said = [line for line in lines if line.startswith(("====", "slurm-hai", "Traceback"))]
        out += [f"--- {f.name}", *(lines if f.suffix == ".jsonl" else said + ["(last lines)", *lines[-8:]])]
    return "\n".join(out)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for outcome in counts:
        for rep in terminalreporter.stats.get(outcome, []):
            if "cluster" in getattr(rep, "keywords", {}) and rep.when in ("call", "setup"):
                if outcome == "passed" and rep.when != "call":
                    continue
                counts[outcome] += 1
    release = " ".join(TESTED_RELEASES)
    terminalreporter.write_line(
        f"cluster tests executed on the live Slurm{' ' + release if release else ''} cluster: "
        f"{counts['passed']} passed, "
        f"{counts['failed']} failed, {counts['skipped']} skipped")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # In CI a run that executed no cluster test proves nothing about Slurm: fail it.
    if os.environ.get("CI") and exitstatus == 0:
        ran = [i for i in session.items if i.get_closest_marker("cluster")]
        if not ran:
            session.exitstatus = 1
