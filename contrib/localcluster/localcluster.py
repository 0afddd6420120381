"""Boot, stop and inspect a real Slurm cluster on this one Debian 12 host (as root).

munged, MariaDB, slurmdbd, slurmctld and one slurmd per node (n1..n4, 8 counted GPUs
each), every file under one state directory ($HAI_CLUSTER_DIR, default
/var/lib/slurm-hai/localcluster). Configs are rendered from the project's templates/
with the HAI policy applied. Daemons are stopped by their pid files only.

Any Slurm can run it (contrib/localcluster/README.md):
- Debian's packages (22.05.8 on Debian 12), the default;
- `up --slurm-source TARBALL`: built once into a prefix cached by the tarball's checksum
  (slurm_build.py), so a second `up` builds nothing;
- `up --slurm-prefix DIR`: an existing install (a site's own build).
HAI_SLURM_SOURCE / HAI_SLURM_PREFIX give the same choice through the environment. A state
directory belongs to one Slurm: `up` without a choice keeps it, `up` with another one
refuses and says so.

Two network layouts, chosen when a state directory is first set up and kept by it:
- the default: every daemon on this host's loopback (NodeAddr=127.0.0.1, a port per slurmd);
- `up --netns` (or HAI_CLUSTER_NETNS=1): slurmctld and each node in a network namespace of
  its own (ip netns), with its own address on a private subnet, its own host name (a UTS
  namespace) and a veth on a bridge that the cluster creates; the host holds the bridge's
  first address, so Slurm's commands and slurmdbd (which stays on the host with MariaDB) are
  reached there. No route leaves the subnet. A backup slurmctld stands by on a host of its
  own (ctl2), sharing StateSaveLocation.

How nodes track jobs, chosen when a state directory is first set up and kept by it:
- by cgroup, as a site's nodes do (the default where the host mounts cgroup v1 hierarchies):
  ProctrackType=proctrack/cgroup, TaskPlugin=task/cgroup, ConstrainCores/RAMSpace/Devices,
  each node's counted GPUs character devices that gres.conf names; each node in a cgroup of
  its own per controller (/sys/fs/cgroup/<controller>/hai-<port base>/<node>) and a cgroup
  namespace rooted there, so that the nodes of clusters side by side never share a cgroup;
- `up --linuxproc` (or HAI_CLUSTER_PROCTRACK=linuxproc): proctrack/linuxproc, no task
  plugin, no constraint (the layout before; also where the host has cgroup v2 alone: Slurm's
  cgroup/v2 on a node in a cgroup namespace of one host is not done yet).

Used through the `up`, `down` and `status` scripts beside this file.
"""

from __future__ import annotations

import contextlib
import json
import dataclasses
import os
import pwd
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from slurm_hai.controller.apply import apply_changes, apply_policy  # noqa: E402
from slurm_hai.policy.model import Policy, PolicyError, load_policy  # noqa: E402
from slurm_hai.policy.ladder import Change, template_context  # noqa: E402
from slurm_hai.render import render  # noqa: E402
from slurm_hai.slurm import SlurmError  # noqa: E402
from slurm_hai.slurm.cli import CliBackend  # noqa: E402
from slurm_hai.slurm.version import SlurmVersion  # noqa: E402

import slurm_build  # noqa: E402  (beside this file)

# The local cluster's policy; `up` renders the configs from it and applies it with the same
# code as `hai-admin apply`. A copy lands in $HAI_CLUSTER_DIR/etc/policy.toml for the daemon.
POLICY_FILE = Path(__file__).resolve().with_name("policy.toml")
# Site mode (`up --site`): the configuration a site has before slurm-hai is added to it.
SITE_DIR = Path(__file__).resolve().with_name("site")
SITE_ACCOUNT = "lab"
SITE_USERS = ["hai-alice", "hai-bob"]

PACKAGES = ["munge", "mariadb-server", "slurmdbd", "slurmctld", "slurmd", "slurm-client",
            "libslurm-dev", "slurm-wlm-basic-plugins", "lua5.3", "make", "gcc"]
TEST_USERS = ["hai-alice", "hai-bob", "hai-carol", "hai-dave"]
ACCOUNT = "hai"
NODES = ["n1", "n2", "n3", "n4"]
GPUS_PER_NODE = 8


# The namespaced layout (`up --netns`): one network namespace for slurmctld, one per node.
CONTROLLER_NS = "ctl"  # slurmctld's namespace and host name
# An admin host: nothing runs there by itself. A site runs the policy daemon beside
# slurmctld or on a host of its own; tests start one here to cut it off alone.
ADMIN_NS = "adm"
# The backup controller's host: the second SlurmctldHost, sharing StateSaveLocation.
BACKUP_NS = "ctl2"
# The cgroup v1 controllers Slurm's cgroup/v1 plugin uses: proctrack (freezer), ConstrainCores
# (cpuset), ConstrainRAMSpace (memory), ConstrainDevices (devices).
CGROUP_CONTROLLERS = ("freezer", "cpuset", "memory", "devices")
CGROUP_ROOT = Path("/sys/fs/cgroup")
GPU_MAJOR = 195  # NVIDIA's character device major: without the driver, an allowed open fails ENXIO
NETNS_SLURMD_TIMEOUT = 10  # s: a node cut off is DOWN (and its jobs requeued) within ~this
NETNS_SLURMCTLD_TIMEOUT = 10  # s: the backup takes over this long after the primary went silent


class ClusterError(Exception):
    """A failure of `up`/`down` that the user can act on (printed as one message)."""


@dataclasses.dataclass
class Node:
    name: str
    port: int
    hostname: str  # NodeHostname: this host, or the node's own name in the netns layout
    addr: str  # NodeAddr: 127.0.0.1, or the node's address on the cluster's bridge


@dataclasses.dataclass
class Cluster:
    state: Path
    port_base: int
    name: str = "hai"
    host: str = socket.gethostname()
    addr: str = "127.0.0.1"
    slurm_user: str = "slurm"
    cred_expire: int = 5
    first_job_id: int = 1  # clusters side by side give their jobs distinct ids (and job dirs)
    gpus_per_node: int = GPUS_PER_NODE
    cpus: int = 1
    memory_mb: int = 1000
    db_password: str = ""
    prefix: Path | None = None  # where Slurm is installed; None: Debian's packages (/usr)
    site: bool = False  # site mode: the site's own configuration (site/), slurm-hai not installed
    version: SlurmVersion | None = None  # set by `up` once the binaries are known
    netns: bool = False  # the namespaced layout: controller and nodes each in a network namespace
    slurmd_timeout: int = 60
    slurmctld_timeout: int = 30
    backup: str = ""  # the backup controller's host name (the netns layout's BACKUP_NS), or none
    cgroup: bool = False  # nodes track jobs by cgroup (proctrack/cgroup, task/cgroup), each node its own

    def node_cgroups(self, node: str) -> list[Path]:
        """Node `node`'s cgroup in each controller's hierarchy (the cgroup layout)."""
        return [CGROUP_ROOT / ctrl / f"hai-{self.port_base}" / node for ctrl in CGROUP_CONTROLLERS]

    @property
    def net_prefix(self) -> str:
        """Names of this cluster's namespaces, veths and bridge (at most 15 characters each):
        apart for each port base, so that two clusters' never meet."""
        return f"hai{self.port_base}"

    @property
    def subnet(self) -> str:
        """The bridge's private /24: 10.<port base / 100 mod 256>.0.0/24 (16700: 10.167.0.0/24)."""
        return f"10.{self.port_base // 100 % 256}.0"

    @property
    def bridge(self) -> str:
        return f"{self.net_prefix}-br"

    @property
    def bridge_addr(self) -> str:
        """The host's address on the bridge: where slurmdbd listens for slurmctld."""
        return f"{self.subnet}.1"

    @property
    def dbd_addr(self) -> str:
        """Where slurmctld reaches slurmdbd (slurmdbd runs on the host in both layouts)."""
        return self.bridge_addr if self.netns else self.addr

    @property
    def db_addr(self) -> str:
        """Where slurmdbd reaches MariaDB: always this host's loopback."""
        return "127.0.0.1"

    def namespace(self, name: str) -> str:
        """The network namespace of the controller (CONTROLLER_NS), the admin host (ADMIN_NS)
        or a node."""
        return f"{self.net_prefix}-{name}"

    @property
    def hosts(self) -> dict[str, str]:
        """Host name -> address inside the cluster's network (each namespace's /etc/hosts)."""
        admin = {ADMIN_NS: self.admin_addr, BACKUP_NS: self.backup_addr} if self.netns else {}
        return {self.host: self.addr, **admin, **{n.hostname: n.addr for n in self.nodes}}

    @property
    def admin_addr(self) -> str:
        """The admin host's address in the netns layout (ADMIN_NS)."""
        return f"{self.subnet}.3"

    @property
    def backup_addr(self) -> str:
        """The backup controller's address in the netns layout (BACKUP_NS)."""
        return f"{self.subnet}.4"

    @property
    def slurm_root(self) -> Path:
        return self.prefix or Path("/usr")  # Debian's packages install into /usr

    def tool(self, name: str) -> str:
        """The Slurm command or daemon `name` of this cluster's Slurm (never another Slurm
        that happens to come first on PATH)."""
        for sub in ("sbin", "bin"):
            if (self.slurm_root / sub / name).exists():
                return str(self.slurm_root / sub / name)
        raise ClusterError(f"{self.slurm_root} has no {name}: is it a Slurm install prefix (bin/, sbin/)?")

    @property
    def path(self) -> str:
        """PATH with this cluster's Slurm commands first."""
        return f"{self.slurm_root}/bin:{self.slurm_root}/sbin:" + os.environ.get("PATH", "/usr/bin:/bin")

    @property
    def ports(self) -> dict[str, int]:
        b = self.port_base
        return {"mysql": b, "slurmdbd": b + 1, "slurmctld": b + 2, "lighthouse": b + 3}

    @property
    def runs_lighthouse(self) -> bool:
        """Whether `up` runs the lighthouse service of elastic jobs in place (docs/elastic-in-place.md)
        and the cluster's policy names it: on the loopback layout once slurm-hai is installed
        (`make setup`). Not in site mode (slurm-hai not installed) or the netns layout."""
        return HAI_ADMIN.exists() and not self.site and not self.netns

    @property
    def lighthouse_url(self) -> str:
        return f"http://{self.addr}:{self.ports['lighthouse']}"

    @property
    def nodes(self) -> list[Node]:
        if self.netns:
            return [Node(n, self.port_base + 11 + i, n, f"{self.subnet}.{11 + i}") for i, n in enumerate(NODES)]
        return [Node(n, self.port_base + 11 + i, self.host, self.addr) for i, n in enumerate(NODES)]

    @property
    def nodelist(self) -> str:
        return f"n[1-{len(NODES)}]"

    @property
    def munge_socket(self) -> str:
        return str(self.state / "munge" / "munged.sock")

    @property
    def slurm_conf(self) -> Path:
        return self.state / "etc" / "slurm.conf"

    @property
    def site_file(self) -> Path:
        """Present: this state directory is a cluster in site mode (`up --site`)."""
        return self.state / "etc" / "site-mode"

    @property
    def netns_file(self) -> Path:
        """Present: this state directory runs the namespaced layout (`up --netns`)."""
        return self.state / "etc" / "netns-layout"

    @property
    def proctrack_file(self) -> Path:
        """How this state directory's nodes track jobs: `cgroup` or `linuxproc`."""
        return self.state / "etc" / "proctrack"

    @property
    def hosts_path(self) -> Path:
        """The netns layout's /etc/hosts (the host's own /etc/hosts is left alone)."""
        return self.state / "etc" / "hosts"

    @property
    def made_file(self) -> Path:
        """What `up --netns` created (namespaces, links): what `down` removes."""
        return self.state / "run" / "netns-made"

    @property
    def prefix_file(self) -> Path:
        """Names the Slurm this state directory was set up with (empty: Debian's)."""
        return self.state / "etc" / "slurm-prefix"

    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.slurm_conf), "PATH": self.path}


def cluster_from_env() -> Cluster:
    state = Path(os.environ.get("HAI_CLUSTER_DIR", "/var/lib/slurm-hai/localcluster"))
    c = Cluster(state=state, port_base=int(os.environ.get("HAI_CLUSTER_PORT_BASE", "16800")),
                first_job_id=int(os.environ.get("HAI_CLUSTER_FIRST_JOB_ID", "1")))
    c.cpus = os.cpu_count() or 1
    pw = state / "etc" / "db_password"
    c.db_password = pw.read_text().strip() if pw.exists() else ""
    recorded = c.prefix_file.read_text().strip() if c.prefix_file.exists() else ""
    c.prefix = Path(recorded) if recorded else None
    c.site = c.site_file.exists()
    if c.netns_file.exists():
        use_netns(c)
    c.cgroup = c.proctrack_file.exists() and c.proctrack_file.read_text().strip() == "cgroup"
    c.memory_mb = node_memory_mb()
    return c


def node_memory_mb() -> int:
    """Each node's RealMemory: three quarters of this host's memory shared by the nodes (the
    jobs' memory limit in the cgroup layout; at least 1000 MB)."""
    total_kb = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                    if line.startswith("MemTotal:"))
    return max(1000, total_kb // 1024 * 3 // 4 // len(NODES))


def host_has_cgroup_v1() -> bool:
    """Whether this host mounts a cgroup v1 hierarchy of each controller Slurm's cgroup/v1 uses."""
    mounts = Path("/proc/self/mounts").read_text().splitlines()
    v1 = {line.split()[1] for line in mounts if line.split()[2] == "cgroup"}
    return all(str(CGROUP_ROOT / ctrl) in v1 for ctrl in CGROUP_CONTROLLERS)


def choose_proctrack(c: Cluster, linuxproc: bool) -> None:
    """The layout of a new state directory: by cgroup unless asked otherwise or the host has
    no cgroup v1 hierarchies; a directory set up before keeps its own."""
    if c.proctrack_file.exists():
        wanted = "linuxproc" if linuxproc else c.proctrack_file.read_text().strip()
        if wanted != c.proctrack_file.read_text().strip():
            raise ClusterError(f"{c.state} tracks jobs by {c.proctrack_file.read_text().strip()}; for "
                               f"{wanted} use another HAI_CLUSTER_DIR (or run down and remove {c.state})")
    elif c.prefix_file.exists():
        c.proctrack_file.write_text("linuxproc\n")  # set up before the cgroup layout existed
    else:
        if not linuxproc and not host_has_cgroup_v1():
            print("this host has no cgroup v1 hierarchies (cgroup v2 alone): the nodes track jobs by "
                  "proctrack/linuxproc", flush=True)
        c.proctrack_file.parent.mkdir(parents=True, exist_ok=True)
        c.proctrack_file.write_text("linuxproc\n" if linuxproc or not host_has_cgroup_v1() else "cgroup\n")
    c.cgroup = c.proctrack_file.read_text().strip() == "cgroup"


def use_netns(c: Cluster) -> None:
    """The namespaced layout: slurmctld is host CONTROLLER_NS at the subnet's .2, the admin
    host ADMIN_NS at .3, the backup slurmctld host BACKUP_NS at .4, node i at .1i; a short
    SlurmdTimeout and SlurmctldTimeout, so that a node cut off, or the primary controller
    lost, is noticed in seconds."""
    c.netns = True
    c.host = CONTROLLER_NS
    c.addr = f"{c.subnet}.2"
    c.backup = BACKUP_NS
    c.slurmd_timeout = NETNS_SLURMD_TIMEOUT
    c.slurmctld_timeout = NETNS_SLURMCTLD_TIMEOUT


def choose_slurm(c: Cluster, source: str | None, prefix: str | None) -> None:
    """Set the cluster's Slurm from `up`'s options (building a tarball if needed); refuse
    one that differs from the Slurm this state directory already runs. Without options, a
    state directory keeps its Slurm, and a new one gets Debian's."""
    if source and prefix:
        raise ClusterError("give --slurm-source or --slurm-prefix, not both")
    wanted: Path | None = None
    if not source and not prefix and c.prefix_file.exists():
        wanted = c.prefix  # no choice given: the Slurm this state directory runs
    elif source:
        install_packages(slurm_build.BUILD_PACKAGES)
        try:
            wanted = slurm_build.build(Path(source), progress=lambda m: print(m, flush=True))
        except slurm_build.BuildError as e:
            raise ClusterError(str(e)) from None
    elif prefix:
        wanted = Path(prefix).resolve()
        if not (wanted / "sbin" / "slurmctld").exists():
            raise ClusterError(f"--slurm-prefix {prefix}: no sbin/slurmctld there; give the directory "
                               "Slurm was installed into (configure --prefix)")
    if c.prefix_file.exists() and c.prefix != wanted:
        if c.prefix and wanted and not c.site and slurm_build.same_build(c.prefix, wanted):
            print(f"{c.state}: the same Slurm build as before ({wanted.name}), now from {wanted.parent}",
                  flush=True)
        else:
            raise ClusterError(f"{c.state} was set up with Slurm from {c.prefix or 'the Debian packages'}; "
                               f"for Slurm from {wanted or 'the Debian packages'} use another HAI_CLUSTER_DIR "
                               f"(or run down and remove {c.state})")
    c.prefix = wanted
    p = run([c.tool("slurmctld"), "-V"], check=False)
    try:
        c.version = SlurmVersion.parse(p.stdout)
    except ValueError:
        raise ClusterError(f"{c.tool('slurmctld')} -V printed {p.stdout.strip()!r}, not a Slurm version") from None


# ---------------------------------------------------------------- daemons


@dataclasses.dataclass
class Daemon:
    name: str
    pidfile: Path
    logfile: Path
    binary: str  # what /proc/PID/exe must point at, so a reused pid is never signalled
    port: int


def daemons(c: Cluster) -> list[Daemon]:
    s = c.state
    out = [
        Daemon("munged", s / "munge" / "munged.pid", s / "munge" / "munged.log", "munged", 0),
        Daemon("mariadbd", s / "mysql" / "mariadbd.pid", s / "log" / "mariadbd.log", "mariadbd", c.ports["mysql"]),
        Daemon("slurmdbd", s / "run" / "slurmdbd.pid", s / "log" / "slurmdbd.log", "slurmdbd", c.ports["slurmdbd"]),
        Daemon("slurmctld", s / "run" / "slurmctld.pid", s / "log" / "slurmctld.log", "slurmctld", c.ports["slurmctld"]),
    ]
    if c.backup:
        out.append(backup_controller(c))
    out += [node_holder(c, n) for n in c.nodes]
    out += [slurmd(c, n) for n in c.nodes]
    out += [persist_agent(c, n) for n in c.nodes]
    if c.runs_lighthouse:
        out.append(lighthouse_service(c))
    return out


def lighthouse_service(c: Cluster) -> Daemon:
    """`hai-admin lighthouse` as a site runs it (hai-lighthouse.service of `hai-admin units`): the
    torchft lighthouse of each elastic job in place, outliving the job's parts. Its log is its
    console; each job's lighthouse is recorded in `lighthouse/<job>.json`."""
    return Daemon("lighthouse", c.state / "run" / "lighthouse.pid", c.state / "log" / "lighthouse.console",
                  "python3", c.ports["lighthouse"])


def start_lighthouse(c: Cluster) -> None:
    d = lighthouse_service(c)
    start(d, writing_pidfile(d, [str(HAI_ADMIN), "lighthouse", "--listen", c.addr, "--port", str(d.port),
                                 "--state-dir", str(c.state / "lighthouse"), "--sweep-every", "5"]), c, foreground=True)


def writing_pidfile(d: Daemon, argv: list[str]) -> list[str]:
    """`argv` for a daemon that writes no pid file of its own: a shell writes its pid to d's
    pid file and execs it (the pid stays)."""
    return ["sh", "-c", 'echo $$ > "$1" && shift && exec "$@"', "sh", str(d.pidfile), *argv]


def stop_lighthouses(c: Cluster) -> list[str]:
    """The jobs' lighthouses the service left running (each in a session of its own, they
    outlive it by design): what `down` stops after the service."""
    stopped = []
    for record in (c.state / "lighthouse").glob("*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError, ProcessLookupError):
            pid = int(json.loads(record.read_text())["pid"])
            if b"slurm_hai.controller.lighthouse" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
                stopped.append(f"lighthouse of job {record.stem}")
            record.unlink()
    return stopped


def backup_controller(c: Cluster) -> Daemon:
    """The backup slurmctld (netns layout): the same slurm.conf, its own pid and log file
    (bind-mounted over SlurmctldPidFile and SlurmctldLogFile in its mount namespace)."""
    return Daemon("slurmctld-backup", c.state / "run" / "slurmctld-backup.pid",
                  c.state / "log" / "slurmctld-backup.log", "slurmctld", 0)


def node_holder(c: Cluster, n: Node) -> Daemon:
    """The process that keeps node `n`'s mount namespace (its own /dev/shm and /tmp) alive:
    a slurmd restart keeps the node's memory, as on a real node; killing every process of
    the namespace (losing the node) loses it."""
    return Daemon(f"node-{n.name}", c.state / "run" / f"node-{n.name}.pid", c.state / "log" / f"node-{n.name}.log",
                  "sleep", 0)


def slurmd(c: Cluster, n: Node) -> Daemon:
    return Daemon(f"slurmd-{n.name}", c.state / "run" / f"slurmd-{n.name}.pid",
                  c.state / "log" / f"slurmd-{n.name}.log", "slurmd", n.port)


def persist_agent(c: Cluster, n: Node) -> Daemon:
    """Node `n`'s persist agent (`hai-admin persist-agent`): finishes the durable copy of
    suspend checkpoints that jobs left in the node's memory. Runs inside the node's namespace."""
    return Daemon(f"persist-{n.name}", c.state / "run" / f"persist-{n.name}.pid",
                  c.state / "log" / f"persist-{n.name}.log", "python3", 0)


HAI_ADMIN = Path(sys.executable).with_name("hai-admin")  # the project's venv (make setup)


# Inside a new mount namespace (private propagation: nothing leaks to the host): fresh
# tmpfs on /dev/shm and /tmp, a small one for the persist agent's spool (/run/slurm-hai/persist: each
# node its own, under a root 0755 parent), the pid file ($1), then sleep forever as the namespace's holder.
HOLDER_SCRIPT = ("mkdir -p /run/slurm-hai/persist && "
                 "mount -t tmpfs -o mode=0755,size=16m,nosuid,nodev,noexec tmpfs /run/slurm-hai/persist && "
                 "mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /dev/shm && "
                 "mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /tmp && "
                 'echo $$ > "$1" && exec sleep infinity')


# The netns layout, before HOLDER_SCRIPT or the controller: the host name ($2), and the
# cluster's /etc/hosts ($3) over the host's, in the new mount namespace only.
NETNS_SCRIPT = 'hostname "$2" && mount --bind "$3" /etc/hosts && '


def in_netns(c: Cluster, name: str, script: str, *args: str) -> list[str]:
    """`sh -c script sh ARGS...` in the network namespace of `name` (nsenter, not `ip netns
    exec`, which remounts /sys without /sys/fs/cgroup, and slurmd needs it), in a mount and
    a UTS namespace of its own: host name `name`, the cluster's /etc/hosts."""
    return ["nsenter", f"--net=/run/netns/{c.namespace(name)}", "--", "unshare", "--mount", "--uts",
            "--propagation", "private", *(["--cgroup"] if c.cgroup and name in NODES else []), "--",
            "sh", "-c", NETNS_SCRIPT + script, "sh", args[0], name,
            str(c.hosts_path), *args[1:]]


# The cgroup layout, first in the holder's new mount and cgroup namespaces: each controller's
# hierarchy mounted again, rooted at the node's cgroup (the namespace's root), over the host's.
# (The host's mount goes first: the kernel refuses a hierarchy mounted over its own root.)
MOUNT_CGROUPS = "".join(f"umount {CGROUP_ROOT / ctrl} && mount -t cgroup -o {ctrl} cgroup {CGROUP_ROOT / ctrl} && "
                        for ctrl in CGROUP_CONTROLLERS)
# A process entering a node of the cgroup layout joins the node's cgroups (its namespace's roots).
JOIN_CGROUPS = ("for c in " + " ".join(CGROUP_CONTROLLERS) + f'; do echo $$ > {CGROUP_ROOT}/$c/cgroup.procs || exit 1; '
                'done; exec "$@"')


def holder_argv(c: Cluster, n: Node, pidfile: Path) -> list[str]:
    """How node `n`'s holder starts: in a new mount namespace; in the cgroup layout also in a
    cgroup namespace rooted at the node's cgroups (start_node puts it there); in the netns
    layout also in the node's network namespace and a UTS namespace of its own, named after
    the node."""
    script = (MOUNT_CGROUPS if c.cgroup else "") + HOLDER_SCRIPT
    if not c.netns:
        return ["unshare", "--mount", "--propagation", "private", *(["--cgroup"] if c.cgroup else []), "--",
                "sh", "-c", script, "sh", str(pidfile)]
    return in_netns(c, n.name, script, str(pidfile))


def node_enter(c: Cluster, holder_pid: int | None) -> list[str]:
    """The command prefix that runs a command on a node: in its holder's namespaces (and, in
    the cgroup layout, in the node's cgroups)."""
    spaces = ["--mount", "--uts", "--net"] if c.netns else ["--mount"]
    if c.cgroup:
        return ["nsenter", f"--target={holder_pid}", *spaces, "--cgroup", "--", "sh", "-c", JOIN_CGROUPS, "sh"]
    return ["nsenter", f"--target={holder_pid}", *spaces, "--"]


def make_node_cgroups(c: Cluster, n: Node) -> list[Path]:
    """Node `n`'s cgroups (the cgroup layout); a cpuset one gets its parent's CPUs and memory
    nodes, without which no process may join it."""
    for path in c.node_cgroups(n.name):
        for d in (path.parent, path):
            d.mkdir(exist_ok=True)
            if d.parent.name and (d.parent / "cpuset.cpus").exists():
                for f in ("cpuset.cpus", "cpuset.mems"):
                    if not (d / f).read_text().strip():
                        (d / f).write_text((d.parent / f).read_text())
    return c.node_cgroups(n.name)


def kill_cgroups(c: Cluster) -> int:
    """SIGKILL every process in the cluster's node cgroups (freezer's: proctrack/cgroup's);
    how many there were."""
    top, pids = CGROUP_ROOT / CGROUP_CONTROLLERS[0] / f"hai-{c.port_base}", set()
    for procs in top.rglob("cgroup.procs") if top.is_dir() else ():
        with contextlib.suppress(OSError):
            pids |= {int(p) for p in procs.read_text().split()}
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return len(pids)


def remove_cgroups(c: Cluster) -> list[str]:
    """The cluster's node cgroups and what Slurm made under them, deepest first, once no
    process is left in them; returns what could not be removed."""
    left = []
    for ctrl in CGROUP_CONTROLLERS:
        top = CGROUP_ROOT / ctrl / f"hai-{c.port_base}"
        if top.is_dir():
            for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) + [top]:
                try:
                    d.rmdir()
                except OSError as e:
                    left.append(f"{d} ({e.strerror})")
    return left


def controller_argv(c: Cluster) -> list[str]:
    """slurmctld; in the netns layout inside the controller's network namespace, with the
    host name SlurmctldHost names (slurmctld refuses to run on a host of another name)."""
    argv = [c.tool("slurmctld"), "-f", str(c.slurm_conf)]
    if not c.netns:
        return argv
    return in_netns(c, CONTROLLER_NS, 'shift 3 && exec "$@"', "-", *argv)


def backup_controller_argv(c: Cluster) -> list[str]:
    """The backup slurmctld in BACKUP_NS; its pid and log files over the primary's paths in
    its own mount namespace (slurm.conf names one of each, and both controllers read it)."""
    own = backup_controller(c)
    primary = (c.state / "run" / "slurmctld.pid", c.state / "log" / "slurmctld.log")
    script = ('touch "$4" "$5" && : > "$6" && mount --bind "$6" "$4" && mount --bind "$7" "$5" && '
              'shift 7 && exec "$@"')
    return in_netns(c, BACKUP_NS, script, "-", str(primary[0]), str(primary[1]), str(own.pidfile),
                    str(own.logfile), c.tool("slurmctld"), "-f", str(c.slurm_conf))


def start_node(c: Cluster, n: Node) -> None:
    """Start node `n`: its namespace holder, then its slurmd inside that namespace. A slurmd
    left running in a namespace that is gone is restarted in the new one."""
    holder, daemon = node_holder(c, n), slurmd(c, n)
    (c.state / "spool" / f"d-{n.name}").mkdir(exist_ok=True)
    fresh = running_pid(holder) is None
    cgroups = tuple(make_node_cgroups(c, n)) if c.cgroup else ()
    start(holder, holder_argv(c, n, holder.pidfile), c, foreground=True, cgroups=cgroups)
    if fresh and running_pid(daemon):
        stop(daemon)
    enter = node_enter(c, running_pid(holder))
    start(daemon, [*enter, c.tool("slurmd"), "-f", str(c.slurm_conf), "-N", n.name], c)
    # the node's own persist agent, in its namespace
    agent = persist_agent(c, n)
    if fresh and running_pid(agent):
        stop(agent)
    if HAI_ADMIN.exists() and not c.site:  # not before `make setup` has installed the project
        start(agent, writing_pidfile(agent, [*enter, str(HAI_ADMIN), "persist-agent", "--sweep-every", "5"]), c,
              foreground=True)


def running_pid(d: Daemon) -> int | None:
    """The daemon's pid from its pid file, if that process is alive and is that daemon."""
    try:
        pid = int(d.pidfile.read_text().split()[0])
        exe = os.readlink(f"/proc/{pid}/exe")
    except (OSError, ValueError, IndexError):
        return None
    return pid if os.path.basename(exe).startswith(d.binary) else None


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no log at {path})"


def console_path(d: Daemon) -> Path:
    """Where a daemon's stdout/stderr go (its own log file belongs to the daemon's user)."""
    return d.logfile.parent.parent / "log" / f"{d.name}.console"


def failure_logs(d: Daemon) -> str:
    return "".join(f"\n--- tail of {p} ---\n{log_tail(p)}" for p in (d.logfile, console_path(d)) if p.exists())


def port_busy(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def wait_for(what: str, check, timeout: float, d: Daemon | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        if d is not None and d.pidfile.exists() and running_pid(d) is None and time.monotonic() > deadline - timeout + 3:
            break
        time.sleep(0.2)
    where = failure_logs(d) if d else ""
    raise ClusterError(f"{what} did not come up within {timeout:.0f} s{where}")


def run(argv: list[str], c: Cluster | None = None, check: bool = True, **kw) -> subprocess.CompletedProcess:
    p = subprocess.run(argv, env=c.env() if c else None, text=True, capture_output=True, **kw)
    if check and p.returncode != 0:
        raise ClusterError(f"{' '.join(argv)} failed (exit {p.returncode}): {(p.stderr or p.stdout).strip()}")
    return p


def start(d: Daemon, argv: list[str], c: Cluster, user: str | None = None, foreground: bool = False,
          cgroups: tuple[Path, ...] = ()) -> None:
    """Start one daemon unless it already runs, in `cgroups` if given; fail with its log tail
    if it dies."""
    if running_pid(d):
        return
    if d.port and port_busy(d.port):
        raise ClusterError(f"port {d.port} needed by {d.name} is busy; stop what uses it "
                           f"(ss -ltnp 'sport = :{d.port}') or set HAI_CLUSTER_PORT_BASE")
    d.pidfile.unlink(missing_ok=True)
    if user:
        argv = ["runuser", "-u", user, "--", *argv]
    log = open(console_path(d), "ab")
    if foreground:  # daemons that do not fork: detach them ourselves
        subprocess.Popen(argv, env=c.env(), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                         start_new_session=True, preexec_fn=(lambda: join(cgroups)) if cgroups else None)
    else:
        p = subprocess.run(argv, env=c.env(), stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        if p.returncode != 0:
            raise ClusterError(f"{d.name} failed to start (exit {p.returncode})\n--- tail of {d.logfile} ---\n"
                               f"{log_tail(d.logfile)}")
    wait_for(f"{d.name} (pid file {d.pidfile})", lambda: running_pid(d) is not None, 20, d)


def join(cgroups: tuple[Path, ...]) -> None:
    """In a child before exec: move into `cgroups` (one per controller)."""
    for path in cgroups:
        (path / "cgroup.procs").write_text(str(os.getpid()))


def stop(d: Daemon, timeout: float = 15) -> bool:
    """SIGTERM the daemon of the pid file and wait for that process (not its pid file,
    which daemons remove early) to be gone; SIGKILL after `timeout`."""
    pid = running_pid(d)
    if pid is None:
        return False

    def alive() -> bool:
        try:
            return os.path.basename(os.readlink(f"/proc/{pid}/exe")).startswith(d.binary)
        except OSError:
            return False

    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and alive():
        time.sleep(0.1)
    if alive():
        os.kill(pid, signal.SIGKILL)
        while alive():
            time.sleep(0.05)
    return True


# ---------------------------------------------------------------- setup steps


def preflight() -> None:
    if os.geteuid() != 0:
        raise ClusterError("contrib/localcluster/up must run as root (it installs packages and starts daemons)")
    if not Path("/etc/debian_version").exists():
        raise ClusterError("contrib/localcluster/up supports Debian 12 only (/etc/debian_version not found)")


def install_packages(packages: list[str] = PACKAGES) -> None:
    missing = [p for p in packages
               if run(["dpkg-query", "-W", "-f=${Status}", p], check=False).stdout != "install ok installed"]
    if not missing:
        return
    print(f"installing Debian packages: {' '.join(missing)}", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # Packages must not start their own daemons (ports, pid files): deny service starts.
    policy_rc = Path("/usr/sbin/policy-rc.d")
    had_policy = policy_rc.exists()
    if not had_policy:
        policy_rc.write_text("#!/bin/sh\nexit 101\n")
        policy_rc.chmod(0o755)
    try:
        for argv in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *missing]):
            p = subprocess.run(argv, env=env, text=True, capture_output=True)
            if p.returncode != 0:
                raise ClusterError(f"{' '.join(argv)} failed: {p.stderr.strip()[-800:]}")
    finally:
        if not had_policy:
            policy_rc.unlink()


def ensure_users(c: Cluster) -> None:
    for user in TEST_USERS:
        try:
            pwd.getpwnam(user)
        except KeyError:
            run(["useradd", "--create-home", "--shell", "/bin/bash", user])


def make_dirs(c: Cluster) -> None:
    s = c.state
    slurm = pwd.getpwnam(c.slurm_user)
    munge = pwd.getpwnam("munge")
    mysql = pwd.getpwnam("mysql")
    for sub, owner, mode in [
        ("", None, 0o755), ("etc", None, 0o755), ("log", slurm, 0o755), ("run", slurm, 0o755),
        ("spool", None, 0o755), ("spool/ctld", slurm, 0o700), ("gpu", None, 0o755),
        ("munge", munge, 0o755), ("mysql", mysql, 0o750), ("lib", None, 0o755),
        ("shared", None, 0o1777),  # the cluster's shared file system (each node's /tmp is its own)
    ]:
        p = s / sub
        p.mkdir(parents=True, exist_ok=True)
        p.chmod(mode)
        if owner:
            os.chown(p, owner.pw_uid, owner.pw_gid)
    for i in range(c.gpus_per_node):  # what gres.conf names; devices where Slurm constrains them
        gpu = s / "gpu" / f"nvidia{i}"
        if c.cgroup and not gpu.is_char_device():
            gpu.unlink(missing_ok=True)
            os.mknod(gpu, 0o666 | stat.S_IFCHR, os.makedev(GPU_MAJOR, i))
        elif not c.cgroup:
            gpu.touch()
    key = s / "munge" / "munge.key"
    if not key.exists():
        key.write_bytes(secrets.token_bytes(1024))
    os.chown(key, munge.pw_uid, munge.pw_gid)
    key.chmod(0o400)
    pw = s / "etc" / "db_password"
    if not pw.exists():
        pw.write_text(secrets.token_hex(16) + "\n")
        pw.chmod(0o600)
    c.db_password = pw.read_text().strip()


# ---------------------------------------------------------------- the netns layout's network


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return run(["ip", *args], check=check)


def link_exists(name: str, netns: str | None = None) -> bool:
    where = ["-n", netns] if netns else []
    return ip(*where, "link", "show", "dev", name, check=False).returncode == 0


def netns_exists(name: str) -> bool:
    return name in ip("netns", "list").stdout.split()


def made(c: Cluster) -> list[tuple[str, str]]:
    """(kind, name) of every namespace and link that `up` created, in creation order."""
    try:
        lines = c.made_file.read_text().splitlines()
    except FileNotFoundError:
        return []
    return [(kind, name) for kind, _, name in (line.partition(" ") for line in lines) if name]


def remember(c: Cluster, kind: str, name: str) -> None:
    with open(c.made_file, "a") as f:
        f.write(f"{kind} {name}\n")


def hosts_file(c: Cluster) -> str:
    names = "".join(f"{addr}\t{host}\n" for host, addr in c.hosts.items())
    return f"# written by contrib/localcluster/up --netns for {c.state}\n127.0.0.1\tlocalhost\n{names}"


def ensure_network(c: Cluster) -> None:
    """The netns layout's network, made idempotently: a bridge with the host's address, and
    for the controller and each node a network namespace with a veth on the bridge, its
    address. The cluster's host names are in etc/hosts, which every namespace's processes see
    as /etc/hosts. No default route, no NAT: the namespaces reach the subnet and nothing else."""
    write_if_changed(c.hosts_path, hosts_file(c))
    if not link_exists(c.bridge):
        ip("link", "add", c.bridge, "type", "bridge")
        remember(c, "link", c.bridge)
    ip("addr", "replace", f"{c.bridge_addr}/24", "dev", c.bridge)
    ip("link", "set", c.bridge, "up")
    for name, addr in [(CONTROLLER_NS, c.addr), (ADMIN_NS, c.admin_addr), (BACKUP_NS, c.backup_addr),
                       *((n.name, n.addr) for n in c.nodes)]:
        ns = c.namespace(name)
        if not netns_exists(ns):
            ip("netns", "add", ns)
            remember(c, "netns", ns)
        if not link_exists(ns):  # the host's end of the veth is named after the namespace
            ip("link", "add", ns, "type", "veth", "peer", "name", "eth0", "netns", ns)
            remember(c, "link", ns)
        ip("link", "set", ns, "master", c.bridge, "up")
        ip("-n", ns, "addr", "replace", f"{addr}/24", "dev", "eth0")
        ip("-n", ns, "link", "set", "eth0", "up")
        ip("-n", ns, "link", "set", "lo", "up")


def remove_network(c: Cluster) -> list[str]:
    """Remove what ensure_network made (the names in run/netns-made, newest first), nothing
    else. Run after every process in the namespaces has stopped."""
    removed = []
    for kind, name in reversed(made(c)):
        if kind == "link" and link_exists(name):
            ip("link", "del", name)
        elif kind == "netns" and netns_exists(name):
            ip("netns", "del", name)
        else:
            continue
        removed.append(f"{kind} {name}")
    c.made_file.unlink(missing_ok=True)
    return removed


def network_status(c: Cluster) -> list[str]:
    lines = [f"network: bridge {c.bridge} {c.bridge_addr}/24 "
             f"({'up' if link_exists(c.bridge) else 'missing'}), no route out of {c.subnet}.0/24"]
    for name in [CONTROLLER_NS, ADMIN_NS, BACKUP_NS, *NODES]:
        ns = c.namespace(name)
        if not netns_exists(ns):
            lines.append(f"  netns {ns:<14} missing")
            continue
        addrs = ip("-n", ns, "-br", "-4", "addr", "show", "dev", "eth0", check=False).stdout.split()
        lines.append(f"  netns {ns:<14} {' '.join(addrs)}")
    return lines


def build_spank(c: Cluster) -> Path | None:
    """Build the SPANK plugin into the state dir; None (plugin left out) if it cannot build."""
    if not (REPO / "spank" / "Makefile").exists():
        return None
    out = c.state / "lib"
    include = [f"CPPFLAGS=-I{c.prefix / 'include'}"] if c.prefix else []
    p = run(["make", "-s", "-C", str(REPO / "spank"), "install", f"LIBDIR={out}", f"BUILD={out / 'build'}",
             *include], check=False)
    if p.returncode != 0:
        raise ClusterError(f"building the SPANK plugin failed:\n{(p.stderr or p.stdout).strip()[-1500:]}")
    return out / "hai_spank.so"


def write_if_changed(path: Path, text: str, mode: int = 0o644, owner: pwd.struct_passwd | None = None) -> bool:
    changed = not path.exists() or path.read_text() != text
    if changed:
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(text)
        tmp.chmod(mode)
        if owner:
            os.chown(tmp, owner.pw_uid, owner.pw_gid)
        tmp.replace(path)
    return changed


def local_policy() -> Policy:
    try:
        return load_policy(POLICY_FILE)
    except PolicyError as e:
        raise ClusterError(str(e)) from None


def render_configs(c: Cluster) -> bool:
    """The configs of the cluster; in site mode the site's own (SITE_DIR), which `up` writes
    only once: from then on they are the admin's (slurm-hai's install and removal edit them)."""
    policy = local_policy()
    etc = c.state / "etc"
    slurm = pwd.getpwnam(c.slurm_user)
    spank_so = None if c.site else build_spank(c)
    site_config = (SITE_DIR / "slurm.conf").read_text() if c.site else ""
    ctx = {"cluster": c, **template_context(policy), "slurm": c.version, "site_config": site_config}
    write = write_once if c.site else write_if_changed
    changed = False
    changed |= write(etc / "slurm.conf", render("slurm/slurm.conf.j2", **ctx))
    changed |= write_if_changed(etc / "gres.conf", render("slurm/gres.conf.j2", **ctx))
    changed |= write_if_changed(etc / "cgroup.conf", render("slurm/cgroup.conf.j2", **ctx))
    # slurmctld reloads job_submit.lua by itself when the file changes
    write(etc / "job_submit.lua", (SITE_DIR / "job_submit.lua").read_text() if c.site
          else render("slurm/job_submit.lua.j2", **ctx))
    plug = render("slurm/plugstack.conf.j2", spank_so=spank_so, **ctx) if spank_so else ""
    changed |= write(etc / "plugstack.conf", plug)
    write_if_changed(etc / "slurmdbd.conf", render("slurm/slurmdbd.conf.j2", **ctx), 0o600, slurm)
    # Slurm's commands first; slurm-hai's (hai, hai-submit, hai-admin: beside the interpreter
    # that runs this) last, so that a job's `python3` is still the system's, not the venv's
    tail = f":{HAI_ADMIN.parent}" if HAI_ADMIN.exists() else ""
    path = f"export PATH={c.slurm_root}/bin:{c.slurm_root}/sbin:$PATH{tail}\n"
    if c.site:
        write_if_changed(etc / "env", f"export SLURM_CONF={c.slurm_conf}\n{path}")
    else:
        write_if_changed(etc / "policy.toml", cluster_policy(c))
        write_if_changed(etc / "env", f"export SLURM_CONF={c.slurm_conf}\nexport HAI_POLICY={etc / 'policy.toml'}\n{path}")
    write_if_changed(c.prefix_file, f"{c.prefix or ''}\n")
    return changed


def cluster_policy(c: Cluster) -> str:
    """The cluster's policy file: POLICY_FILE, naming the cluster's lighthouse service when
    it runs one (its address depends on the cluster's ports)."""
    text = POLICY_FILE.read_text()
    if not c.runs_lighthouse:
        return text
    line = f'lighthouse_service = "{c.lighthouse_url}"\n'
    if "\n[elastic]\n" not in text:
        return f"{text}\n[elastic]\n{line}"
    return text.replace("\n[elastic]\n", f"\n[elastic]\n{line}", 1)


def write_once(path: Path, text: str) -> bool:
    if path.exists():
        return False
    return write_if_changed(path, text)


def start_munge(c: Cluster) -> None:
    d = daemons(c)[0]
    s = c.state / "munge"
    start(d, ["munged", f"--key-file={s / 'munge.key'}", f"--socket={c.munge_socket}",
              f"--pid-file={d.pidfile}", f"--log-file={d.logfile}", f"--seed-file={s / 'munged.seed'}"],
          c, user="munge")


def mysql(c: Cluster, sql: str) -> None:
    run(["mariadb", f"--socket={c.state / 'mysql' / 'mariadbd.sock'}", "-u", "root", "-e", sql])


def start_mariadb(c: Cluster) -> None:
    d = daemons(c)[1]
    data = c.state / "mysql" / "data"
    # A temporary directory of this cluster's own: a MariaDB server that starts removes every
    # `#sql*` file of its tmpdir as a crash's leftovers, and with /tmp that is another cluster's
    # server's tables too (CI, stop 63: two versions' clusters starting at once, one's
    # mariadb-install-db failed with "Could not remove temporary table '/tmp/#sql-temptable-...'").
    tmp = c.state / "mysql" / "tmp"
    tmp.mkdir(mode=0o700, exist_ok=True)
    os.chown(tmp, pwd.getpwnam("mysql").pw_uid, pwd.getpwnam("mysql").pw_gid)
    if not data.exists():  # made whole, then renamed: a failed install leaves no half a database
        new = data.with_name("data.new")
        shutil.rmtree(new, ignore_errors=True)
        run(["mariadb-install-db", "--user=mysql", f"--datadir={new}", "--auth-root-authentication-method=socket",
             "--skip-test-db", f"--tmpdir={tmp}"])
        new.rename(data)
    sock = c.state / "mysql" / "mariadbd.sock"
    log = c.state / "log"
    start(d, ["mariadbd", "--no-defaults", "--user=mysql", f"--datadir={data}", f"--socket={sock}",
              f"--port={c.ports['mysql']}", "--bind-address=127.0.0.1", f"--pid-file={d.pidfile}", f"--tmpdir={tmp}",
              f"--log-error={d.logfile}", "--innodb-buffer-pool-size=128M", "--innodb-lock-wait-timeout=900",
              "--innodb-log-file-size=64M"], c, foreground=True)
    os.chown(log / "mariadbd.log", pwd.getpwnam("mysql").pw_uid, -1) if (log / "mariadbd.log").exists() else None
    wait_for("MariaDB socket", sock.exists, 30, d)
    pw = c.db_password
    mysql(c, "CREATE DATABASE IF NOT EXISTS slurm_acct_db;"
             f"CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '{pw}';"
             f"CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '{pw}';"
             "GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"
             "GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';")


def use_cluster(c: Cluster) -> CliBackend:
    """slurm_hai's Slurm backend, pointed at this cluster's Slurm (its commands, SLURM_CONF)."""
    os.environ["SLURM_CONF"] = str(c.slurm_conf)
    if not os.environ.get("PATH", "").startswith(f"{c.slurm_root}/bin:"):
        os.environ["PATH"] = c.path
    return CliBackend()


def accounting_answers(c: Cluster) -> bool:
    try:
        use_cluster(c).associations()
    except SlurmError:
        return False
    return True


def membership_changes(c: Cluster, assocs: list[dict[str, str]], users: list[dict[str, str]]) -> list[Change]:
    """What only a test cluster needs in accounting: the cluster, the account, and root and
    the test users in it as their default account. [] when all is there."""
    ours = [a for a in assocs if a["Cluster"] == c.name]
    changes = []
    if not ours:
        changes.append(Change("add", "cluster", name=c.name, why="the local cluster"))
    if not any(a["Account"] == ACCOUNT and not a["User"] for a in ours):
        changes.append(Change("add", "account", name=ACCOUNT, why="the test account",
                              settings={"cluster": c.name, "description": "slurm-hai", "organization": "hai"}))
    members = {a["User"] for a in ours if a["Account"] == ACCOUNT}
    defaults = {u["User"]: u["DefaultAccount"] for u in users}
    for user in ["root", *TEST_USERS]:
        if user not in members:
            new = {"defaultaccount": ACCOUNT} if user not in defaults else {}
            changes.append(Change("add", "user", name=user, settings={"account": ACCOUNT, "cluster": c.name, **new},
                                  why=f"{user} in account {ACCOUNT}"))
        if user in defaults and defaults[user] != ACCOUNT:
            changes.append(Change("modify", "user", where={"name": user}, settings={"defaultaccount": ACCOUNT},
                                  why=f"{user} submits to {ACCOUNT} by default"))
    return changes


def site_changes(c: Cluster, qos: list[dict[str, str]], assocs: list[dict[str, str]]) -> list[Change]:
    """What a site's accounting has before slurm-hai comes (site mode, first `up` only): QOS
    `normal` and `high` of its own settings, an account `lab` with two of the test users."""
    if any(a["Account"] == SITE_ACCOUNT for a in assocs if a["Cluster"] == c.name):
        return []
    changes = [Change("modify", "qos", where={"name": "normal"}, settings={"Priority": "10", "MaxWall": "2-00:00:00"},
                      why="the site's normal QOS")]
    if not any(q["Name"] == "high" for q in qos):
        changes.append(Change("add", "qos", name="high", why="the site's high QOS"))
    changes.append(Change("modify", "qos", where={"name": "high"},
                          settings={"Priority": "100", "Preempt": "normal", "GraceTime": "60"}, why="the site's high QOS"))
    changes.append(Change("add", "account", name=SITE_ACCOUNT, why="the site's account",
                          settings={"cluster": c.name, "description": "the-lab", "organization": "site"}))
    for user in SITE_USERS:
        changes.append(Change("add", "user", name=user, settings={"account": SITE_ACCOUNT, "cluster": c.name},
                              why=f"{user} in account {SITE_ACCOUNT}"))
    changes.append(Change("modify", "account", where={"name": SITE_ACCOUNT}, settings={"qos": "normal,high"},
                          why="the site's account may use its QOS"))
    return changes


def setup_accounting(c: Cluster) -> None:
    """Cluster, account and users (what only a test cluster needs), then the policy's QOS
    ladder and QOS access through `slurm_hai.controller.apply.apply_policy`, as `hai-admin apply` does
    (the local cluster is slurm-hai's own: it adopts Slurm's `normal` QOS). In site mode the
    site's QOS and account instead, and nothing of slurm-hai.
    Idempotent and quick on a cluster that is already set up (reads, no changes)."""
    backend = use_cluster(c)
    try:
        apply_changes(backend, membership_changes(c, backend.associations(), backend.users()))
        if c.site:
            apply_changes(backend, site_changes(c, backend.qos(), backend.associations()))
            return
        # slurmctld may not run yet: partitions come from the rendered slurm.conf, not scontrol.
        done = apply_policy(local_policy(), backend, partitions=False, adopt=["*"])
    except SlurmError as e:
        raise ClusterError(f"setting up accounting (the test users, then {POLICY_FILE}): {e}") from None
    if done:
        print(f"policy {POLICY_FILE.name}: {len(done)} accounting change(s) applied", flush=True)


def nodes_idle(c: Cluster) -> bool:
    p = run(["sinfo", "-h", "-N", "-o", "%N %t"], c, check=False)
    states = dict(line.split() for line in p.stdout.splitlines() if line.strip())
    return p.returncode == 0 and all(states.get(n) in ("idle", "alloc", "mix", "comp") for n in NODES)


def up(source: str | None = None, prefix: str | None = None, site: bool = False, netns: bool = False,
       linuxproc: bool = False) -> None:
    t0 = time.monotonic()
    preflight()
    install_packages()
    c = cluster_from_env()
    if site and not c.site and c.prefix_file.exists():
        raise ClusterError(f"{c.state} is a cluster of slurm-hai's own; for site mode use another HAI_CLUSTER_DIR")
    if netns and not c.netns:
        if c.prefix_file.exists():
            raise ClusterError(f"{c.state} runs every node on this host's loopback; for the netns layout use "
                               "another HAI_CLUSTER_DIR (and HAI_CLUSTER_PORT_BASE)")
        c.netns_file.parent.mkdir(parents=True, exist_ok=True)
        c.netns_file.touch()
        use_netns(c)
    choose_slurm(c, source, prefix)
    choose_proctrack(c, linuxproc)
    if site:
        c.site = True
        c.site_file.parent.mkdir(parents=True, exist_ok=True)
        c.site_file.touch()
    ensure_users(c)
    make_dirs(c)
    changed = render_configs(c)
    ds = daemons(c)
    start_munge(c)
    start_mariadb(c)
    slurm = pwd.getpwnam(c.slurm_user)
    if c.backup:
        backup_controller(c).logfile.touch()
    for f in (c.state / "log").glob("*.log"):
        os.chown(f, slurm.pw_uid, slurm.pw_gid) if f.name.startswith("slurm") else None
    if c.netns:
        ensure_network(c)
    start(ds[2], [c.tool("slurmdbd")], c)
    wait_for("slurmdbd answering sacctmgr", lambda: accounting_answers(c), 30, ds[2])
    setup_accounting(c)
    was_running = running_pid(ds[3]) is not None
    start(ds[3], controller_argv(c), c)
    if c.backup:
        start(backup_controller(c), backup_controller_argv(c), c)
    for node in c.nodes:
        start_node(c, node)
    if c.runs_lighthouse:
        start_lighthouse(c)
    if was_running and changed:
        run(["scontrol", "reconfigure"], c)
    wait_for("slurmctld answering", lambda: run(["scontrol", "ping"], c, check=False).returncode == 0, 30, ds[3])
    if not (c.state / "spool" / "ctld" / "assoc_usage").exists():
        # A new state directory. slurmctld saves its association usage every 5 minutes or
        # when it stops, and from 25.11 it refuses to start from a state that lacks it
        # (fatal: No Assoc usage file): a controller killed in its first minutes (a test
        # does that) could not come back. One clean restart writes it.
        stop(ds[3])
        start(ds[3], controller_argv(c), c)
        wait_for("slurmctld answering", lambda: run(["scontrol", "ping"], c, check=False).returncode == 0, 30,
                 ds[3])
    down_nodes = run(["sinfo", "-h", "-N", "-t", "down,drain,inval", "-o", "%N"], c, check=False).stdout.split()
    if down_nodes:
        run(["scontrol", "update", f"nodename={','.join(down_nodes)}", "state=resume"], c, check=False)
    wait_for("all nodes idle in sinfo", lambda: nodes_idle(c), 60, ds[-1])
    layout = ", jobs tracked by cgroup" if c.cgroup else ", jobs tracked by proctrack/linuxproc"
    layout += f", each node in its own network namespace on {c.bridge} {c.subnet}.0/24" if c.netns else ""
    print(f"local Slurm {c.version} cluster '{c.name}'{' in site mode' if c.site else ''} is up "
          f"({len(NODES)} nodes x {c.gpus_per_node} GPUs{layout}) "
          f"in {time.monotonic() - t0:.1f} s")
    print(f"use it with: source {c.state / 'etc' / 'env'}")


def find_node(c: Cluster, name: str) -> Node:
    for n in c.nodes:
        if n.name == name:
            return n
    raise ClusterError(f"no node {name!r} here: the nodes are {', '.join(NODES)}")


def node_up(name: str) -> None:
    """Start one node again (after `node-lose`, or its slurmd stopped): its namespace holder
    if it is gone (a fresh, empty /dev/shm and /tmp), then its slurmd."""
    c = cluster_from_env()
    choose_slurm(c, None, None)
    start_node(c, find_node(c, name))
    print(f"node {name} is up")


def namespace_processes(holder_pid: int) -> list[int]:
    """Every process in the mount namespace of `holder_pid`: what runs on that node."""
    ns = os.readlink(f"/proc/{holder_pid}/ns/mnt")
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/ns/mnt") == ns:
                    out.append(int(entry))
            except OSError:
                pass
    return out


def node_lose(name: str) -> None:
    """What losing a node does: every process on it (its slurmd, the job steps, the holder of
    its namespace) gets SIGKILL, and its /dev/shm and /tmp are gone with them. Slurm learns
    of it as it would (SlurmdTimeout), or at once with `scontrol update State=DOWN`."""
    c = cluster_from_env()
    holder = node_holder(c, find_node(c, name))
    pid = running_pid(holder)
    if pid is None:
        raise ClusterError(f"node {name} is not running (no {holder.pidfile})")
    doomed = namespace_processes(pid)
    for victim in doomed:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wait_for(f"every process of node {name} to die",
             lambda: not any(Path(f"/proc/{v}").exists() for v in doomed), 20)
    print(f"node {name} lost: {len(doomed)} processes killed")


def strays(c: Cluster) -> list[tuple[int, str]]:
    """Slurm daemons of this cluster that no pid file names (a controller whose pid file was
    lost): every process whose command line reads this cluster's slurm.conf, other than
    the commands of a job step."""
    conf, out = str(c.slurm_conf).encode(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
                exe = os.path.basename(os.readlink(f"/proc/{entry}/exe"))
            except OSError:
                continue
            if exe.startswith(("slurmctld", "slurmd")) and conf in argv:  # Debian: slurmctld-wlm
                out.append((int(entry), exe))
    return out


def down() -> None:
    c = cluster_from_env()
    stopped = [d.name for d in reversed(daemons(c)) if stop(d)] + stop_lighthouses(c)
    for pid, exe in strays(c):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            stopped.append(f"a stray {exe} (pid {pid}, no pid file)")
    print(f"stopped: {', '.join(stopped) if stopped else 'nothing was running'}")
    if c.cgroup:
        # what the stopped slurmds leave (their job steps: slurmstepd outlives slurmd) is
        # in the nodes' cgroups: nothing of a job outlives the cluster
        killed = kill_cgroups(c)
        if killed:
            print(f"killed: {killed} processes of jobs still in the nodes' cgroups")
        deadline = time.monotonic() + 10
        while (left := remove_cgroups(c)) and time.monotonic() < deadline:
            kill_cgroups(c)
            time.sleep(0.2)
        if left:
            print(f"cgroups left (a process still in them): {', '.join(left)}")
    if c.netns:
        removed = remove_network(c)
        print(f"removed: {', '.join(removed) if removed else 'no namespace or link was left'}")


def status() -> int:
    c = cluster_from_env()
    all_up = True
    print(f"state dir: {c.state}")
    print(f"Slurm: {c.prefix or 'Debian packages'}")
    if c.netns:
        print("\n".join(network_status(c)))
    for d in daemons(c):
        pid = running_pid(d)
        all_up &= pid is not None
        print(f"  {d.name:<12} {'running pid ' + str(pid) if pid else 'not running'}")
    if all_up:
        print(run([c.tool("scontrol"), "--version"], c, check=False).stdout.strip() or "slurm version unknown")
        print(f"SLURM_CONF={c.slurm_conf}")
        print(run(["sinfo", "-N", "-o", "%N %t %G"], c, check=False).stdout.rstrip())
    print("cluster is up" if all_up else "cluster is down (run contrib/localcluster/up)")
    return 0 if all_up else 1


USAGE = """usage: up [--slurm-source TARBALL | --slurm-prefix DIR] [--site] [--netns] [--linuxproc] | down | status | node-up NODE | node-lose NODE
  up                        boot (or check) the cluster on Debian's Slurm packages
  up --netns                controller and each node in a network namespace of its own, on a bridge
                            (a new HAI_CLUSTER_DIR; the directory keeps the layout; HAI_CLUSTER_NETNS=1)
  up --site                 a cluster as a site has it before slurm-hai comes (site/: its own QOS,
                            partitions, PreemptMode=CANCEL, job_submit.lua); a new HAI_CLUSTER_DIR
  up --linuxproc            nodes track jobs by proctrack/linuxproc, not by cgroup (a new HAI_CLUSTER_DIR;
                            HAI_CLUSTER_PROCTRACK=linuxproc)
  up --slurm-source TARBALL build that Slurm once (cached by checksum), boot on it
  up --slurm-prefix DIR     boot on the Slurm installed in DIR
  node-lose NODE            kill every process on NODE: its memory (/dev/shm, /tmp) is lost
  node-up NODE              start NODE again (its slurmd; a fresh /dev/shm and /tmp if it was lost)
  (HAI_SLURM_SOURCE / HAI_SLURM_PREFIX: the same; HAI_CLUSTER_DIR: the state directory)"""


def up_options(args: list[str]) -> dict[str, str | bool | None]:
    opts: dict[str, str | bool | None] = {"source": os.environ.get("HAI_SLURM_SOURCE") or None,
                                          "prefix": os.environ.get("HAI_SLURM_PREFIX") or None}
    site = "--site" in args
    netns = "--netns" in args or os.environ.get("HAI_CLUSTER_NETNS") == "1"
    linuxproc = "--linuxproc" in args or os.environ.get("HAI_CLUSTER_PROCTRACK") == "linuxproc"
    it = iter(a for a in args if a not in ("--site", "--netns", "--linuxproc"))
    for arg in it:
        key, _, value = arg.partition("=")
        if key not in ("--slurm-source", "--slurm-prefix"):
            raise ClusterError(f"unknown option {arg!r}\n{USAGE}")
        value = value or next(it, "")
        if not value:
            raise ClusterError(f"{key} needs a value\n{USAGE}")
        opts = {"source": None, "prefix": None, key.removeprefix("--slurm-"): value}
    return {**opts, "site": site, "netns": netns, "linuxproc": linuxproc}


def main(argv: list[str]) -> int:
    command = argv[1] if len(argv) > 1 else "status"
    try:
        if command == "up":
            up(**up_options(argv[2:]))
        elif command == "down":
            down()
        elif command == "status":
            return status()
        elif command in ("node-up", "node-lose") and len(argv) == 3:
            (node_up if command == "node-up" else node_lose)(argv[2])
        else:
            print(USAGE, file=sys.stderr)
            return 2
    except ClusterError as e:
        print(f"localcluster {command}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
