"""Network faults on the namespaced local cluster (`contrib/localcluster/up --netns`), injected
with the kernel's own tools: every node and slurmctld have a network namespace of their own.

Marked `netns` (and `cluster`): deselected by the default suite (pyproject's addopts), run with

    export HAI_CLUSTER_DIR=/var/lib/slurm-hai/netns-22.05 HAI_CLUSTER_PORT_BASE=16700 \\
           HAI_CLUSTER_FIRST_JOB_ID=5000000
    contrib/localcluster/up --netns
    .venv/bin/pytest -m netns tests/cluster/test_network_faults.py

On a cluster of the default layout they fail (never skip): there is no network to cut.

The fault: the nodes of a running 2-node job are cut off from slurmctld (a blackhole route
each way: `ip route add blackhole`), while they still reach each other and the shared file
system. slurmctld marks them DOWN after SlurmdTimeout (10 s in this layout) and requeues the
job onto the other nodes. The old run's processes, alive and training, reach their next
checkpoint save after the new run has started: the run fence (slurm_hai/checkpoint/commit.py)
refuses the commit and they stop. Reconnected, the nodes come back to service. The job ends
with the weights of an uninterrupted run: nothing lost, nothing run twice, no checkpoint torn.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import uninterrupted
import waiting
from uninterrupted import TRAIN
from test_acceptance import (committed_steps, events, job_pids, named, running_daemon, same_weights,
                             start_nows, wait_final)

from slurm_hai.checkpoint import verify_checkpoint
from slurm_hai.controller.daemon import MAX_BACKOFF
from slurm_hai.checkpoint.manifest import step_dir_name

pytestmark = [pytest.mark.cluster, pytest.mark.netns]

REPO = Path(__file__).resolve().parents[2]
NETDELAY = REPO / "tests" / "netdelay.py"
STEPS = 400
LATENCY = 0.2  # seconds, between any two of slurmctld and the nodes
# 2 nodes x 1 process; slow enough that the old run is still training when the new run starts
TRAIN_ARGS = ["--nprocs", "1", "--steps", str(STEPS), "--save-every", "10", "--step-sleep", "0.25"]
SHORT_ARGS = ["--nprocs", "1", "--steps", "150", "--save-every", "10", "--step-sleep", "0.25"]


class Network:
    """The netns layout's namespaces and addresses (contrib/localcluster: run/netns-made)."""

    def __init__(self, live) -> None:  # live: the LiveCluster (conftest)
        made = live.state / "run" / "netns-made"
        if not made.exists():
            pytest.fail(f"{live.state} is not a cluster of the netns layout (no {made}): bring one up with "
                        "contrib/localcluster/up --netns and point HAI_CLUSTER_DIR at it", pytrace=False)
        self.live = live
        names = [line.split()[1] for line in made.read_text().splitlines() if line.startswith("netns ")]
        self.ns = {name.rsplit("-", 1)[1]: name for name in names}  # "n1" -> "hai16700-n1"
        conf = (live.state / "etc" / "slurm.conf").read_text()
        self.ctl_addr = re.search(r"^SlurmctldHost=\S+\((\S+)\)", conf, re.M).group(1)
        self.addr = dict(re.findall(r"^NodeName=(\S+) .*NodeAddr=(\S+)", conf, re.M))
        self._delayers: list[tuple[subprocess.Popen, Path]] = []  # delay()'s programs and their logs

    def ip(self, *args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True)

    def cut_from_controller(self, node: str) -> None:
        """Packets between `node` and slurmctld are dropped, both ways; the rest still flows."""
        self.ip("-n", self.ns[node], "route", "add", "blackhole", f"{self.ctl_addr}/32")
        self.ip("-n", self.ns["ctl"], "route", "add", "blackhole", f"{self.addr[node]}/32")

    def reconnect(self, node: str) -> None:
        for ns, addr in ((self.ns[node], self.ctl_addr), (self.ns["ctl"], self.addr[node])):
            subprocess.run(["ip", "-n", ns, "route", "del", "blackhole", f"{addr}/32"], capture_output=True)

    LOSS_TABLE = "hai_fault"

    def _nft_everywhere(self, *args: str, rules: str | None = None, check: bool = False) -> list[str]:
        """`nft ARGS` in slurmctld's and each node's namespace; what each printed."""
        return [subprocess.run(["ip", "netns", "exec", self.ns[name], "nft", *args], input=rules, check=check,
                               capture_output=True, text=True).stdout for name in ("ctl", *self.addr)]

    def lose(self, percent: int) -> None:
        """Every packet that slurmctld or a node sends is dropped with `percent` % chance
        (nftables' random number, in each namespace's output hook)."""
        self._nft_everywhere("-f", "-", check=True, rules=(
            f"table inet {self.LOSS_TABLE} {{\n chain out {{\n  type filter hook output priority 0; "
            f"policy accept;\n  numgen random mod 100 < {percent} counter drop\n }}\n}}\n"))

    def dropped(self) -> int:
        """Packets dropped so far by `lose`'s rules."""
        return sum(int(n) for out in self._nft_everywhere("list", "table", "inet", self.LOSS_TABLE)
                   for n in re.findall(r"counter packets (\d+)", out))

    def stop_losing(self) -> None:
        self._nft_everywhere("delete", "table", "inet", self.LOSS_TABLE)

    DELAY_QUEUE = 7

    def delay(self, seconds: float) -> None:
        """Every packet that reaches slurmctld or a node waits `seconds` first: one delay
        between any two of them, as `tc netem delay` on each sender's link would give
        (tests/netdelay.py, behind an iptables NFQUEUE rule in each namespace)."""
        for name in ("ctl", *self.addr):
            log = self.live.state / "run" / f"netdelay-{name}.log"
            with log.open("w") as out:
                proc = subprocess.Popen(["ip", "netns", "exec", self.ns[name], sys.executable, str(NETDELAY),
                                         "--queue", str(self.DELAY_QUEUE), "--delay", str(seconds)],
                                        stdout=out, stderr=subprocess.STDOUT, text=True)
            self._delayers.append((proc, log))
            waiting.wait_for(lambda: "netdelay: queue" in log.read_text() or proc.poll() is not None, 30,
                             f"the delay in {name}")
            assert proc.poll() is None, log.read_text()
            self.ip("netns", "exec", self.ns[name], "iptables", "-t", "mangle", *self.DELAY_RULE.replace(
                "ACTION", "-A").split())

    DELAY_RULE = f"ACTION PREROUTING ! -i lo -j NFQUEUE --queue-num {DELAY_QUEUE} --queue-bypass"

    def stop_delaying(self) -> int:
        """The rules out, every packet still held let go; how many packets were delayed."""
        for name in ("ctl", *self.addr):
            subprocess.run(["ip", "netns", "exec", self.ns[name], "iptables", "-t", "mangle",
                            *self.DELAY_RULE.replace("ACTION", "-D").split()], capture_output=True)
        held = 0
        for proc, log in self._delayers:
            proc.terminate()
            proc.wait(10)
            held += sum(int(n) for n in re.findall(r"netdelay: (\d+) packets held", log.read_text()))
        self._delayers = []
        return held

    def unplug(self, node: str) -> None:
        """`node` loses its link: nothing reaches it or leaves it (its veth's host end down)."""
        self.ip("link", "set", self.ns[node], "down")

    def plug(self, node: str) -> None:
        self.ip("link", "set", self.ns[node], "up")

    def enter(self, name: str) -> list[str]:
        """The command prefix that runs a command in namespace `name` ("adm", "n1", ...)."""
        return ["nsenter", f"--net=/run/netns/{self.ns[name]}", "--"]

    def cut_admin_host(self) -> None:
        """The admin host (where the daemon runs) loses its way to slurmctld; slurmdbd, the
        nodes and the shared file system stay in reach."""
        self.ip("-n", self.ns["adm"], "route", "add", "blackhole", f"{self.ctl_addr}/32")

    def reconnect_admin_host(self) -> None:
        subprocess.run(["ip", "-n", self.ns["adm"], "route", "del", "blackhole", f"{self.ctl_addr}/32"],
                       capture_output=True)


@pytest.fixture(scope="module")
def daemon(cluster, tmp_path_factory):
    """The policy daemon on the admin host: a network namespace of its own, so that a test
    can cut it off from slurmctld alone."""
    with running_daemon(cluster, tmp_path_factory.mktemp("daemon"), Network(cluster).enter("adm")) as log:
        yield log


def node_state(live, node: str) -> str:
    return live.run(["sinfo", "-h", "-N", "-n", node, "-o", "%t"], check=False).stdout.strip()


def hostnames(live, start: dict) -> list[str]:
    """The nodes of a run, from its start event's Slurm node list (n[1-2] -> n1, n2)."""
    return live.run(["scontrol", "show", "hostnames", start["nodes"]]).stdout.split()


def reference_of(train_args: list[str]) -> Path:
    """The weights of `train_args`' job run uninterrupted, world size 2 (1 node x 2
    processes: the same ranks and collectives as 2 nodes x 1), without its step sleep."""
    args = [a for a in train_args if a not in ("--step-sleep", "0.25")]
    args[args.index("--nprocs") + 1] = "2"
    return uninterrupted.weights(args)


@pytest.fixture(scope="module")
def reference(cluster) -> Path:
    return reference_of(TRAIN_ARGS)


@pytest.fixture(scope="module")
def short_reference(cluster) -> Path:
    """For the tests whose faults come in a job's first steps: less training after them."""
    return reference_of(SHORT_ARGS)


def test_nodes_cut_off_from_the_controller_mid_run_are_fenced_and_the_job_ends_exact(live, daemon, reference):
    net = Network(live)
    # No GPUs: on 22.05 a job with gres requeued after its nodes were cut off fails its first
    # step ("Invalid generic resource (gres) specification"; docs/reliability.md).
    p = live.run(["hai-submit", "--json", "--gpus-per-node", "0", "-n", "2", "-p", "LOW", str(TRAIN), "--",
                  *TRAIN_ARGS], user="hai-alice")
    job_id, job_dir = json.loads(p.stdout)["job_id"], Path(json.loads(p.stdout)["job_dir"])
    ckpt = job_dir / "checkpoints"
    start = waiting.wait_for(lambda: named(job_dir, "start"), 120, f"job {job_id} to start")[0]
    old_nodes = hostnames(live, start)
    assert len(old_nodes) == 2
    waiting.wait_for(lambda: len(committed_steps(ckpt)) >= 2, 180, "two checkpoints of run 0", 0.3)
    assert job_pids(job_dir, 0), "run 0's training processes are not to be seen"

    try:
        for node in old_nodes:
            net.cut_from_controller(node)
        # SlurmdTimeout (10 s here): the nodes go DOWN and Slurm requeues the job elsewhere.
        waiting.wait_for(lambda: all(node_state(live, n).startswith("down") for n in old_nodes), 90,
                         f"{old_nodes} to be DOWN", 0.5)
        new_start = waiting.wait_for(lambda: [e for e in named(job_dir, "start") if e["run"] >= 1], 120,
                                     "run 1 to start on other nodes", 0.5)[0]
        new_nodes = hostnames(live, new_start)
        assert not set(new_nodes) & set(old_nodes), (old_nodes, new_nodes)
        # The old run is still alive and training: its next save is refused and it stops.
        logs = job_dir / "logs"
        fenced = f"run 0 of job {job_id} was superseded by run 1: not committing"
        waiting.wait_for(lambda: any(fenced in p.read_text(errors="replace") for p in logs.glob("rank-*.log")),
                         120, "the old run's commit to be refused", 0.5)
        waiting.wait_for(lambda: not job_pids(job_dir, 0), 60, "the old run's processes to stop", 0.5)
    finally:
        for node in old_nodes:
            net.reconnect(node)
    waiting.wait_for(lambda: all(live.in_service(n) for n in old_nodes), 120, f"{old_nodes} back in service", 0.5)

    final = wait_final(job_dir, 600)
    assert final["state"] == "succeeded", final
    # Exact: the weights of an uninterrupted run; each run after the first resumed from a
    # committed step, every checkpoint left verifies, and nothing of run 0 was committed
    # after run 1 started (run 1 resumed from run 0's newest commit, and no step of run 0
    # is newer than that).
    assert same_weights(job_dir / "final-weights.safetensors", reference)
    resumed = [int(m.group(1)) for p in sorted(logs.glob("rank-0.log"))
               for m in re.finditer(r"resumed from step (\d+)", p.read_text(errors="replace"))]
    assert len(resumed) == 1, resumed
    for step in committed_steps(ckpt):
        step_dir = ckpt / step_dir_name(step)
        assert verify_checkpoint(step_dir).ok, step_dir
        made_by = json.loads((step_dir / "manifest.json").read_text()).get("created_by", {})
        if step > resumed[0]:
            assert made_by.get("host") in new_nodes, (step, made_by, new_nodes)
    runs = [e["run"] for e in events(job_dir) if e["event"] == "start"]
    assert runs == [0, 1], runs


def test_under_latency_and_loss_a_save_a_preemption_and_the_daemon_cut_off_for_60_s_lose_nothing(
        live, daemon, reference):
    """The faults together, to keep CI's time. From the job's first checkpoint, 1% of the
    packets that slurmctld and each node send are lost, to the job's end (its gloo
    collectives, its saves and peer copies, Slurm's RPCs). For a while, every packet between
    any two of them also takes 200 ms (tests/netdelay.py: this kernel has no sch_netem): a
    save of both nodes commits, and a HIGH job preempts the job on its two nodes; the job
    commits its suspend within its grace, is requeued and resumes (a step takes about 1.8 s
    under the latency here, the policy's 5 s of grace are too short for the suspend's
    collectives: the job asks for 30, as a job on such a network would). Then the latency
    goes, and the admin host loses its route to slurmctld for 60 s: the daemon says Slurm does
    not answer and does nothing; a job suspended meanwhile is started again by Slurm alone,
    after its requeue delay. Back, the daemon answers within its back-off and gives the next
    requeue its start at once. The job ends with the weights of an uninterrupted run, each
    run resumed from a commit, no run twice."""
    net = Network(live)
    # 0.35 s a step (the reference runs without sleep): the job outlasts the faults and three suspends
    args = [*TRAIN_ARGS[:-1], "0.35"]
    p = live.run(["hai-submit", "--json", "-n", "2", "-p", "LOW", "--grace", "30", str(TRAIN), "--", *args],
                 user="hai-alice")
    job_id, job_dir = json.loads(p.stdout)["job_id"], Path(json.loads(p.stdout)["job_dir"])
    ckpt = job_dir / "checkpoints"
    waiting.wait_for(lambda: len(committed_steps(ckpt)) >= 1, 180, "a checkpoint of run 0", 0.3)
    nodes = named(job_dir, "start")[0]["nodes"]
    net.lose(1)
    try:
        net.delay(LATENCY)
        try:
            before = committed_steps(ckpt)[-1]
            waiting.wait_for(lambda: committed_steps(ckpt)[-1] > before, 120, "a save under latency", 0.3)
            live.sbatch("-N2", "-w", nodes, "--qos=high", "-o", "/dev/null", "--wrap", "sleep 5", user="root")
            waiting.wait_for(lambda: [e for e in named(job_dir, "start") if e["run"] >= 1], 180, "run 1 to start", 0.3)
            assert [e["how"] for e in named(job_dir, "suspended")] != ["forced"], events(job_dir)
        finally:
            delayed = net.stop_delaying()
        run_under_faults(live, net, daemon, job_id, job_dir, first_run=2)
        final = wait_final(job_dir, 600)
        dropped = net.dropped()
    finally:
        net.stop_delaying()
        net.stop_losing()
    assert delayed > 0 and dropped > 0, (delayed, dropped)
    assert final["state"] == "succeeded", final
    assert same_weights(job_dir / "final-weights.safetensors", reference)
    runs = [e["run"] for e in events(job_dir) if e["event"] == "start"]
    assert runs == [0, 1, 2, 3], runs
    log = (job_dir / "logs" / "rank-0.log").read_text(errors="replace")
    commits = [int(m.group(1)) for m in re.finditer(r"checkpoint step (\d+) committed", log)]
    resumed = [int(m.group(1)) for m in re.finditer(r"resumed from step (\d+)", log)]
    assert len(resumed) == 3 and all(r in commits for r in resumed), (resumed, commits)


def peer_copies_in_flight(live, job_id: int) -> list[Path]:
    """The peer copies being received in the job's node memory, on any node (seen through each
    node's holder: /dev/shm is the node's own)."""
    found = []
    for pidfile in (live.state / "run").glob("node-n*.pid"):
        shm = Path(f"/proc/{pidfile.read_text().split()[0]}/root/dev/shm")
        found += list(shm.glob(f"slurm-hai-{job_id}-memory-*/**/.staging-peer-*"))
    return found


def test_a_node_unplugged_during_the_peer_copy_the_job_resumes_from_its_last_commit(live, daemon, short_reference):
    """A first suspend commits a step (node memory, then the agents). Then 200 ms between the
    nodes and 32 MiB of ballast in each rank's state make the peer copy of a second suspend
    take seconds; the moment one arrives in a node's memory, the job's second node loses its
    link. The first node's copy waits on gloo; Slurm marks the unplugged node DOWN and
    requeues the job (NODE_FAIL: the daemon leaves it Slurm's delay); the next run starts on
    other nodes and resumes from the first suspend's step, since the second's never reached
    its persist agents. Plugged in again, the node's old processes are killed, nothing of
    theirs is committed, and the job ends with the weights of an uninterrupted run."""
    net = Network(live)
    job_id, job_dir = submit_without_periodic_saves(live, ballast_mb=32)
    ckpt = job_dir / "checkpoints"
    waiting.wait_for(lambda: len(named(job_dir, "start")) == 1 and train_started(job_dir, 0), 180, "run 0 to train",
                     0.3)
    live.run(["hai", "suspend", str(job_id)], user="hai-alice")
    waiting.wait_for(lambda: train_started(job_dir, 1), 180, "run 1 to train", 0.3)
    waiting.wait_for(lambda: committed_steps(ckpt), 120, "the agents' commit of the first suspend", 0.3)
    nodes = hostnames(live, named(job_dir, "start")[-1])
    unplugged = nodes[1]
    net.delay(LATENCY)
    try:
        live.run(["hai", "suspend", str(job_id)], user="hai-alice")
        waiting.wait_for(lambda: peer_copies_in_flight(live, job_id), 120, "a peer copy in flight", 0.05)
        net.unplug(unplugged)
        committed_at_cut = committed_steps(ckpt)
        net.stop_delaying()
        waiting.wait_for(lambda: node_state(live, unplugged).startswith("down"), 90, f"{unplugged} to be DOWN", 0.5)
        new_start = waiting.wait_for(lambda: [e for e in named(job_dir, "start") if e["run"] >= 2], 180,
                                     "run 2 to start on other nodes", 0.5)[0]
        assert unplugged not in hostnames(live, new_start)
    finally:
        net.stop_delaying()
        net.plug(unplugged)
    waiting.wait_for(lambda: not job_pids(job_dir, 1), 120, "run 1's processes to stop", 0.5)
    resumed = back_and_exact(live, job_dir, unplugged, short_reference)
    assert len(resumed) == 2 and resumed[1] == resumed[0] == max(committed_at_cut), (resumed, committed_at_cut)
    # a requeue after NODE_FAIL keeps Slurm's delay (rules.CLEAN_RUN_ENDS)
    assert not [line for line in start_nows(daemon, job_id) if "NODE_FAIL" in line], daemon.read_text()[-2000:]
    for step in committed_steps(ckpt):
        assert verify_checkpoint(ckpt / step_dir_name(step)).ok, step


def test_a_node_unplugged_during_the_agents_durable_commit_the_step_commits_and_the_job_resumes_from_it(
        live, daemon, short_reference):
    """A 2-node job with 256 MiB of ballast a rank suspends into node memory; the moment the
    second node's persist agent starts copying its share to the durable directory, that node
    loses its link. Its agent still reaches the checkpoint directory (this layout's file
    system is the host's, not a network one: no NFS in this kernel) and the step commits;
    Slurm marks the node DOWN, and whatever run had started on it is requeued. The run that
    trains resumes from the suspend's step, on nodes that are up; the job ends with the
    weights of an uninterrupted run."""
    net = Network(live)
    job_id, job_dir = submit_without_periodic_saves(live, ballast_mb=256)
    ckpt = job_dir / "checkpoints"
    waiting.wait_for(lambda: train_started(job_dir, 0), 180, "run 0 to train", 0.3)
    nodes = hostnames(live, named(job_dir, "start")[0])
    unplugged = nodes[1]
    live.run(["hai", "suspend", str(job_id)], user="hai-alice")
    try:
        waiting.wait_for(lambda: list(ckpt.glob(".persist-*/.part-1.copying")), 120,
                         f"{unplugged}'s agent to copy its share", 0.02)
        net.unplug(unplugged)
        step = waiting.wait_for(lambda: committed_steps(ckpt), 120, "the suspend's step to commit", 0.3)[-1]
        waiting.wait_for(lambda: node_state(live, unplugged).startswith("down"), 90, f"{unplugged} to be DOWN", 0.5)
        waiting.wait_for(lambda: [e for e in named(job_dir, "start")
                                  if e["run"] >= 1 and unplugged not in hostnames(live, e)],
                         180, "a run on nodes that are up", 0.5)
    finally:
        net.plug(unplugged)
    resumed = back_and_exact(live, job_dir, unplugged, short_reference)
    assert resumed and all(r == step for r in resumed), (resumed, step)
    assert verify_checkpoint(ckpt / step_dir_name(step)).ok


def submit_without_periodic_saves(live, ballast_mb: int) -> tuple[int, Path]:
    """A 2-node job of SHORT_ARGS with `ballast_mb` MiB of extra state a rank and no periodic
    saves (a suspend at a step already saved durably goes to no node memory): (id, dir).
    Each rank's own ballast (--ballast-per-rank): a ballast that every rank holds alike is
    saved by one rank only, and the other node's share was 23 KB, copied and committed in
    milliseconds when its agent came last (CI, 2026-11-29).
    Without GPUs, as in the cut-off test: on 22.05 a gres job whose node failed while the job
    was requeued fails the first step of its next run (docs/reliability.md)."""
    args = [*SHORT_ARGS, "--ballast-mb", str(ballast_mb), "--ballast-per-rank"]
    args[args.index("--save-every") + 1] = "1000"
    p = live.run(["hai-submit", "--json", "--gpus-per-node", "0", "-n", "2", "-p", "LOW", "--grace", "60",
                  str(TRAIN), "--", *args], user="hai-alice")
    return json.loads(p.stdout)["job_id"], Path(json.loads(p.stdout)["job_dir"])


def back_and_exact(live, job_dir: Path, unplugged: str, reference: Path) -> list[int]:
    """The unplugged node back in service, the job succeeded with the weights of an
    uninterrupted run: the steps its runs resumed from."""
    waiting.wait_for(lambda: live.in_service(unplugged), 120, f"{unplugged} back in service", 0.5)
    final = wait_final(job_dir, 600)
    assert final["state"] == "succeeded", final
    assert same_weights(job_dir / "final-weights.safetensors", reference)
    log = (job_dir / "logs" / "rank-0.log").read_text(errors="replace")
    return [int(m.group(1)) for m in re.finditer(r"resumed from step (\d+)", log)]


def train_started(job_dir: Path, run: int) -> bool:
    """Run `run` of the job is training (its rank 0 said how it began)."""
    try:
        log = (job_dir / "logs" / "rank-0.log").read_text(errors="replace")
    except FileNotFoundError:
        return False
    return bool(re.search(rf"\[train\] \S+ run {run}: ", log))


def run_under_faults(live, net: Network, daemon: Path, job_id: int, job_dir: Path, first_run: int) -> None:
    """The daemon cut off for 60 s, a suspend meanwhile (run `first_run`) and one after (the test above)."""

    def suspend_and_wait_for_run(run: int) -> None:
        live.run(["hai", "suspend", str(job_id)], user="hai-alice")
        waiting.wait_for(lambda: [e for e in named(job_dir, "start") if e["run"] >= run], 120,
                         f"run {run} to start", 0.3)

    def logged(text: str) -> int:
        return daemon.read_text().count(text)

    answers_before, gone_before = logged("Slurm answers again"), logged("Slurm did not answer")
    starts_before = len(start_nows(daemon, job_id))
    cut_at = time.monotonic()
    try:
        net.cut_admin_host()
        waiting.wait_for(lambda: logged("Slurm did not answer") > gone_before, 60, "the daemon to find slurmctld gone",
                         0.3)
        suspend_and_wait_for_run(first_run)  # Slurm alone starts it, after cred_expire + 1 s
        assert len(start_nows(daemon, job_id)) == starts_before, "the daemon acted while cut off"
        assert not named(job_dir, "finished"), "the job ended before the cut did: make it longer"
        time.sleep(max(0.0, 60 - (time.monotonic() - cut_at)))
    finally:
        net.reconnect_admin_host()
    back_at = time.monotonic()
    waiting.wait_for(lambda: logged("Slurm answers again") > answers_before, 90, "the daemon to answer again", 0.2)
    answered_after = time.monotonic() - back_at
    assert answered_after <= MAX_BACKOFF + 5, f"the daemon looked again {answered_after:.0f} s after the network was back"
    suspend_and_wait_for_run(first_run + 1)  # the daemon's start-now again
    assert [line for line in start_nows(daemon, job_id)[starts_before:] if "ended REQUEUED" in line], \
        daemon.read_text()[-2000:]
