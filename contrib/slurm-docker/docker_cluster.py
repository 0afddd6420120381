"""Boot and remove a Slurm cluster of Docker containers on this Debian 12 host (as root).

A controller container (munged, MariaDB, slurmdbd, slurmctld) and N compute containers
(munged, slurmd, the persist agent), each with its own host name, network namespace, cgroup
namespace and file system; /etc/slurm and /data are host directories every container shares.
Debian's Slurm (22.05), slurm-hai installed from a wheel of this checkout, the policy
(policy.toml beside this file) rendered by `hai-admin render` and applied by `hai-admin apply
--adopt normal` on a fresh accounting database: the path a site takes.

The images are built here, offline from Debian's archive (no registry): a base image from an
mmdebstrap tarball (`docker import`), then the slurm-hai layer (`docker build`, debian/Dockerfile)
from wheels made of this checkout and of the very versions of torch & co. the project's venv
has (the tests compare weights with runs made there). Each image is tagged by a hash of its
inputs and built only when no image has that tag.

The network: containers run `--network none`; a network namespace of their own (NETNS) holds
a bridge, and each container gets a veth from it with an address on SUBNET. Nothing is done
in the host's network namespace (no bridge, no firewall rule; dockerd runs with iptables and
its bridge off). Every file of the cluster is under STATE_DIR. Used through `up` and `down`.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import shutil
import string
import subprocess
import sys
import time
import zipfile
from importlib.metadata import version
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "contrib" / "localcluster"))

from localcluster import ClusterError, install_packages, write_if_changed  # noqa: E402

STATE_DIR = Path(os.environ.get("HAI_DOCKER_DIR", "/var/lib/slurm-hai/docker"))
NAME = "hai-docker"  # prefix of the containers, the network namespace and the images
LABEL = "slurm-hai-docker"  # on every container `up` makes: what `down` removes
NETNS = NAME
SUBNET = "10.199.0"  # inside NETNS only
CLUSTER = "docker"  # ClusterName
CONTROLLER = "slurmctld"  # the controller's host name, as in giovtorres/slurm-docker-cluster
CONTROLLER_ADDR = f"{SUBNET}.2"
MAX_NODES = 8
DOCKER = "/usr/bin/docker"  # Debian's docker.io client, the daemon's own version
DAEMON_JSON = Path("/etc/docker/daemon.json")
# dockerd adds no firewall rule and no bridge: the host's network stays as it is.
DAEMON_CONFIG = '{"iptables": false, "ip6tables": false, "bridge": "none"}\n'
HOST_PACKAGES = ["docker.io", "mmdebstrap"]
# The base image: Debian 12 with Debian's Slurm and what the slurm-hai layer builds with.
BASE_PACKAGES = ["slurmd", "slurmctld", "slurmdbd", "slurm-client", "munge", "mariadb-server", "python3",
                 "python3-venv", "libslurm-dev", "gcc", "make", "libc6-dev", "iproute2", "procps", "mount", "lua5.3"]
SOURCES = ["deb http://deb.debian.org/debian bookworm main",
           "deb http://deb.debian.org/debian bookworm-updates main",
           "deb http://deb.debian.org/debian-security bookworm-security main"]
# The packages of the torch extra at the versions of the venv that runs this.
PINNED = ["torch", "numpy", "safetensors", "xxhash"]
# The configuration files every container reads in /etc/slurm (debian/, some filled in).
CONFIGS = ["slurm.conf", "cgroup.conf", "gres.conf", "slurmdbd.conf"]
# How every container runs. Not --privileged: it needs CAP_SYS_RESOURCE, which this VM's
# bounding set lacks; every other capability, no seccomp, /proc and /sys writable, any device
# (the fake GPUs) and cgroups of its own (slurmd's cgroup plugins) instead.
RUN_FLAGS = ["--network", "none", "--cgroupns", "private", "--init", "--cap-add", "ALL", "--cap-drop",
             "SYS_RESOURCE", "--security-opt", "seccomp=unconfined", "--security-opt", "systempaths=unconfined",
             "--device-cgroup-rule", "a *:* rwm", "--shm-size", "256m", "--label", LABEL]


def log(msg: str) -> None:
    print(f"slurm-docker {time.strftime('%H:%M:%S')} {msg}", flush=True)


def run(argv: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
    p = subprocess.run(argv, text=True, capture_output=True, **kw)
    if check and p.returncode != 0:
        raise ClusterError(f"{' '.join(argv[:6])} failed (exit {p.returncode}): {(p.stderr or p.stdout).strip()[-1500:]}")
    return p


def docker(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return run([DOCKER, *args], check=check)


def wait_for(what: str, check, timeout: float, why=lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise ClusterError(f"{what} did not happen within {timeout:.0f} s{why()}")


def container(host: str) -> str:
    return f"{NAME}-{host}"


def node_names(count: int) -> list[str]:
    return [f"c{i}" for i in range(1, count + 1)]


def node_addr(node: str) -> str:
    return f"{SUBNET}.{10 + int(node[1:])}"


def hosts(count: int) -> dict[str, str]:
    """Host name -> address of every container (each one's /etc/hosts)."""
    return {CONTROLLER: CONTROLLER_ADDR, **{n: node_addr(n) for n in node_names(count)}}


# ---------------------------------------------------------------- dockerd and the images


def ensure_dockerd() -> None:
    """A running dockerd; started here (no systemd) with DAEMON_CONFIG if none answers."""
    if docker("info", check=False).returncode == 0:
        return
    if DAEMON_JSON.exists() and DAEMON_JSON.read_text() != DAEMON_CONFIG:
        raise ClusterError(f"dockerd is not running and {DAEMON_JSON} is not ours; start dockerd yourself with "
                           f"iptables and its bridge off ({DAEMON_CONFIG.strip()})")
    DAEMON_JSON.parent.mkdir(parents=True, exist_ok=True)
    DAEMON_JSON.write_text(DAEMON_CONFIG)
    (STATE_DIR / "log").mkdir(parents=True, exist_ok=True)
    out = open(STATE_DIR / "log" / "dockerd.log", "ab")
    subprocess.Popen(["dockerd", "--config-file", str(DAEMON_JSON)], stdin=subprocess.DEVNULL, stdout=out,
                     stderr=out, start_new_session=True)
    wait_for("dockerd answering", lambda: docker("info", check=False).returncode == 0, 60,
             lambda: f"; see {STATE_DIR / 'log' / 'dockerd.log'}")
    log("dockerd started")


def image_exists(tag: str) -> bool:
    return docker("image", "inspect", tag, check=False).returncode == 0


def digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()[:16]


def base_image() -> str:
    """The base image: Debian 12 + BASE_PACKAGES, made by mmdebstrap and `docker import`."""
    tag = f"{NAME}-base:{digest(' '.join(BASE_PACKAGES).encode(), ' '.join(SOURCES).encode())}"
    if image_exists(tag):
        return tag
    build = STATE_DIR / "build"
    build.mkdir(parents=True, exist_ok=True)
    tarball = build / "base.tar"
    log(f"building {tag} from Debian's archive (mmdebstrap, about a minute)")
    t0 = time.monotonic()
    try:
        run(["mmdebstrap", "--variant=apt", f"--include={','.join(BASE_PACKAGES)}", "bookworm", str(tarball),
             *SOURCES])
        docker("import", str(tarball), tag)
    finally:
        tarball.unlink(missing_ok=True)
    log(f"{tag} built in {time.monotonic() - t0:.0f} s")
    return tag


def wheelhouse() -> Path:
    """The wheels the slurm-hai layer installs: this checkout's (pip wheel), and its
    dependencies with the torch extra at the venv's versions (pip download)."""
    wheels = STATE_DIR / "build" / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    for old in wheels.glob("slurm_hai-*.whl"):
        old.unlink()
    pip = [sys.executable, "-m", "pip", "-q"]
    run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(REPO)])
    (ours,) = wheels.glob("slurm_hai-*.whl")
    try:
        pins = [f"{name}=={version(name)}" for name in PINNED]
    except Exception as e:  # importlib.metadata.PackageNotFoundError
        raise ClusterError(f"the venv lacks {e}: run make venv first") from None
    run([*pip, "download", "--only-binary", ":all:", "-d", str(wheels), f"{ours}[torch]", *pins])
    return wheels


def hai_image(base: str) -> str:
    """The slurm-hai layer (debian/Dockerfile) on `base`, built unless it exists."""
    wheels = wheelhouse()
    (ours,) = wheels.glob("slurm_hai-*.whl")
    with zipfile.ZipFile(ours) as z:  # its RECORD: a hash of every file in it
        record = next(z.read(n) for n in z.namelist() if n.endswith(".dist-info/RECORD"))
    others = " ".join(sorted(p.name for p in wheels.glob("*.whl") if p != ours)).encode()
    inputs = digest(base.encode(), (HERE / "debian" / "Dockerfile").read_bytes(),
                    (HERE / "debian" / "boot.sh").read_bytes(), record, others)
    tag = f"{NAME}:{inputs}"
    if image_exists(tag):
        return tag
    context = STATE_DIR / "build" / "context"
    shutil.rmtree(context, ignore_errors=True)
    (context / "wheels").mkdir(parents=True)
    for f in ("Dockerfile", "boot.sh"):
        shutil.copy2(HERE / "debian" / f, context / f)
    for w in wheels.glob("*.whl"):
        os.link(w, context / "wheels" / w.name)
    log(f"building {tag} (slurm-hai from {ours.name}, the SPANK plugin)")
    t0 = time.monotonic()
    try:
        docker("build", "--network", "host", "--build-arg", f"BASE={base}", "-t", tag, str(context))
    finally:
        shutil.rmtree(context, ignore_errors=True)
    log(f"{tag} built in {time.monotonic() - t0:.0f} s")
    return tag


# ---------------------------------------------------------------- configuration and network


def write_configs(count: int) -> None:
    """/etc/slurm of every container: debian/'s files (slurm.conf with the nodes), the
    policy, a munge key. `hai-admin render` adds slurm-hai's files in the controller."""
    etc = STATE_DIR / "slurm"
    etc.mkdir(parents=True, exist_ok=True)
    nodes = "\n".join(f"NodeName={n} NodeAddr={node_addr(n)} CPUs={os.cpu_count()} RealMemory=3000 "
                      f"Gres=gpu:2 Feature=cpu State=UNKNOWN" for n in node_names(count))
    values = {"cluster": CLUSTER, "controller": CONTROLLER, "controller_addr": CONTROLLER_ADDR, "nodes": nodes}
    for name in CONFIGS:
        text = string.Template((HERE / "debian" / name).read_text()).substitute(values)
        write_if_changed(etc / name, text)
    write_if_changed(etc / "policy.toml", (HERE / "policy.toml").read_text())
    key = etc / "munge.key"
    if not key.exists():
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
    data = STATE_DIR / "data"
    data.mkdir(exist_ok=True)
    data.chmod(0o1777)


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return run(["ip", *args], check=check)


def ensure_bridge() -> None:
    if NETNS not in ip("netns", "list").stdout.split():
        ip("netns", "add", NETNS)
    if ip("-n", NETNS, "link", "show", "br0", check=False).returncode != 0:
        ip("-n", NETNS, "link", "add", "br0", "type", "bridge")
    ip("-n", NETNS, "link", "set", "br0", "up")


def wire(host: str, addr: str) -> None:
    """The container's eth0: a veth from the bridge in NETNS, with the container's address."""
    pid = docker("inspect", "-f", "{{.State.Pid}}", container(host)).stdout.strip()
    veth = f"v-{host}"[:15]
    if ip("-n", NETNS, "link", "show", veth, check=False).returncode == 0:
        ip("-n", NETNS, "link", "del", veth)  # left by a container that is gone
    ip("-n", NETNS, "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", pid)
    ip("-n", NETNS, "link", "set", veth, "master", "br0", "up")
    inside = ["nsenter", f"--target={pid}", "--net", "--", "ip"]
    run([*inside, "addr", "add", f"{addr}/24", "dev", "eth0"])
    run([*inside, "link", "set", "eth0", "up"])
    run([*inside, "link", "set", "lo", "up"])


def start_container(image: str, host: str, count: int, role: str) -> None:
    """Run `host`'s container (replacing one that is there) and wire it."""
    docker("rm", "-f", container(host), check=False)
    logs = STATE_DIR / "log" / host
    logs.mkdir(parents=True, exist_ok=True)
    mounts = ["-v", f"{STATE_DIR / 'slurm'}:/etc/slurm", "-v", f"{STATE_DIR / 'data'}:/data",
              "-v", f"{logs}:/var/log/slurm"]
    add_hosts = [arg for h, a in hosts(count).items() for arg in ("--add-host", f"{h}:{a}")]
    docker("run", "-d", "--name", container(host), "--hostname", host, *RUN_FLAGS, *add_hosts, *mounts, image,
           "hai-docker-boot", role)
    wire(host, hosts(count)[host])


def on_controller(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return docker("exec", container(CONTROLLER), *argv, check=check)


def boot_log(host: str) -> str:
    return f"\n--- docker logs {container(host)} ---\n" + docker("logs", "--tail", "15", container(host),
                                                                check=False).stdout


def node_states() -> dict[str, str]:
    p = on_controller("sinfo", "-h", "-N", "-o", "%N %t", check=False)
    return dict(line.split() for line in p.stdout.splitlines() if line.strip()) if p.returncode == 0 else {}


def nodes_idle(count: int) -> bool:
    states = node_states()
    return all(states.get(n) == "idle" for n in node_names(count))


# ---------------------------------------------------------------- up, node-up, down


def running(host: str, image: str) -> bool:
    p = docker("inspect", "-f", "{{.State.Running}} {{.Config.Image}}", container(host), check=False)
    return p.returncode == 0 and p.stdout.split() == ["true", image]


def ours() -> list[str]:
    return docker("ps", "-a", "--filter", f"label={LABEL}", "--format", "{{.Names}}").stdout.split()


def up(count: int) -> None:
    t0 = time.monotonic()
    if os.geteuid() != 0:
        raise ClusterError("contrib/slurm-docker/up must run as root (it installs packages, runs dockerd, "
                           "makes a network namespace)")
    install_packages(HOST_PACKAGES)
    ensure_dockerd()
    base = base_image()
    image = hai_image(base)
    built = time.monotonic()
    wanted = [CONTROLLER, *node_names(count)]
    if sorted(ours()) == sorted(map(container, wanted)) and all(running(h, image) for h in wanted) \
            and nodes_idle(count):
        log(f"already up: {len(wanted)} containers of {image}, nodes idle")
        return
    remove_containers()
    # a fresh cluster: a fresh accounting database (job ids from 1 again), so an empty /data
    shutil.rmtree(STATE_DIR / "data", ignore_errors=True)
    write_configs(count)
    write_if_changed(STATE_DIR / "images", f"{image}\n{base}\n")  # what `down` keeps
    ensure_bridge()
    start_container(image, CONTROLLER, count, "controller")
    # slurm-hai's part of slurm.conf (its Includes), before any Slurm command reads it
    on_controller("hai-admin", "render", "--out", "/etc/slurm")
    wait_for("slurmdbd answering in the controller",
             lambda: on_controller("sacctmgr", "-n", "show", "cluster", check=False).returncode == 0, 90,
             lambda: boot_log(CONTROLLER))
    on_controller("sacctmgr", "-i", "add", "cluster", CLUSTER)
    on_controller("sacctmgr", "-i", "add", "account", "hai", f"cluster={CLUSTER}")
    on_controller("sacctmgr", "-i", "add", "user", "root,hai-alice,hai-bob", "account=hai", f"cluster={CLUSTER}")
    on_controller("sacctmgr", "-i", "modify", "user", "root", "set", "defaultaccount=hai")  # it was root's
    on_controller("slurmctld")
    wait_for("slurmctld answering", lambda: on_controller("scontrol", "ping", check=False).returncode == 0, 60,
             lambda: "\n" + (STATE_DIR / "log" / CONTROLLER / "slurmctld.log").read_text()[-1500:])
    applied = on_controller("hai-admin", "apply", "--adopt", "normal", "--quiet").stdout.strip()
    log(f"policy applied on a fresh accounting database: {applied}")
    for n in node_names(count):
        start_container(image, n, count, "node")
    wait_for("every node idle in sinfo", lambda: nodes_idle(count), 90,
             lambda: f"; sinfo: {node_states()}" + boot_log(node_names(count)[-1]))
    write_env(count)
    log(f"up: a controller and {count} compute containers of {image}, Slurm idle; "
        f"images ready in {built - t0:.0f} s, cluster booted in {time.monotonic() - built:.0f} s")
    log(f"use it with: source {STATE_DIR / 'etc' / 'env'}; $HAI_DOCKER_EXEC sinfo")


def write_env(count: int) -> None:
    env = STATE_DIR / "etc" / "env"
    env.parent.mkdir(exist_ok=True)
    write_if_changed(env, f"# written by contrib/slurm-docker/up: the Docker cluster of {STATE_DIR}\n"
                          f"export HAI_DOCKER_DIR={STATE_DIR}\n"
                          f"export HAI_DOCKER_CONTROLLER={container(CONTROLLER)}\n"
                          f"export HAI_DOCKER_NODES=\"{' '.join(node_names(count))}\"\n"
                          f"# a command on the controller (Slurm's and slurm-hai's commands are there):\n"
                          f"export HAI_DOCKER_EXEC=\"{DOCKER} exec -i {container(CONTROLLER)}\"\n")


def node_up(node: str) -> None:
    """A compute container made again (after `docker kill`): fresh memory, same configuration."""
    count = len(re.findall(r"^NodeName=", (STATE_DIR / "slurm" / "slurm.conf").read_text(), re.M))
    if node not in node_names(count):
        raise ClusterError(f"no node {node!r}: the nodes are {', '.join(node_names(count))}")
    image = docker("inspect", "-f", "{{.Config.Image}}", container(CONTROLLER)).stdout.strip()
    start_container(image, node, count, "node")
    log(f"node {node} is up again (container {container(node)})")


def remove_containers() -> list[str]:
    names = ours()
    if names:
        docker("rm", "-f", *names)
    return names


def down(images: bool) -> None:
    removed = remove_containers()
    if NETNS in ip("netns", "list").stdout.split():
        ip("netns", "del", NETNS)
        removed.append(f"netns {NETNS}")
    keep = set() if images else set((STATE_DIR / "images").read_text().split()) if (STATE_DIR / "images").exists() else set()
    for repo in (f"{NAME}", f"{NAME}-base"):
        for tag in docker("images", "--format", "{{.Repository}}:{{.Tag}}", repo).stdout.split():
            if tag not in keep:
                docker("rmi", tag)
                removed.append(f"image {tag}")
    for sub in ("slurm", "data", "etc", *(("build", "images") if images else ())):
        path = STATE_DIR / sub
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    log(f"removed: {', '.join(removed) if removed else 'nothing was there'}")


USAGE = """usage: docker_cluster.py up [--nodes N] | down [--images] | node-up NODE
  up [--nodes N]   build the images if needed, boot a controller and N compute containers (default 2)
  down             remove the containers, the network namespace, images no longer used, the configuration
  down --images    also every image of this cluster and the build directory (the next up builds again)
  node-up NODE     make NODE's container again (after docker kill)"""


def main(argv: list[str]) -> int:
    command, args = (argv[1], argv[2:]) if len(argv) > 1 else ("", [])
    try:
        if command == "up" and (not args or args[0] == "--nodes" and len(args) == 2):
            count = args[1] if args else "2"
            if not count.isdigit() or not 1 <= int(count) <= MAX_NODES:
                raise ClusterError(f"--nodes takes a number from 1 to {MAX_NODES}, not {count!r}")
            up(int(count))
        elif command == "down" and args in ([], ["--images"]):
            down(images=bool(args))
        elif command == "node-up" and len(args) == 1:
            node_up(args[0])
        else:
            print(USAGE, file=sys.stderr)
            return 2
    except ClusterError as e:
        print(f"slurm-docker {command}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
