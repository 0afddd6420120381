"""Run the cluster suite on every Slurm source tarball of a directory (`SLURM_SOURCES=DIR make test`).

    python tests/each_slurm.py DIR [PYTEST ARGS...]
    python tests/each_slurm.py --build-in-background DIR

`--build-in-background` (what `make test` runs before Debian's suite) starts the builds of
step 1 and 3 below, detached and at idle CPU priority (SCHED_IDLE: it only gets the cores
when the tests leave them idle, which cluster tests mostly do), and returns at once; its
output goes to /var/cache/slurm-hai/background-build.log. The test run after it waits for
a build still in flight (each build holds a lock) instead of starting its own, and builds
whatever the background build did not (e.g. after it failed: then it says why).

For each `slurm-*.tar.gz` in DIR, all at once (each version's clusters, ports, job ids and
node namespaces are its own, and cluster tests mostly wait on Slurm, so the versions share the
cores well; each version's output goes to /var/cache/slurm-hai/tests-<version>.log and is
printed whole when it is done):
1. its own local cluster: state dir /var/lib/slurm-hai/localcluster-<version>, its own
   ports and job ids (job directories never meet those of another version's run), Slurm
   built once from the tarball (contrib/localcluster/slurm_build.py caches
   the build by checksum, so a second run builds nothing);
2. the cluster tests marked `slurm_boundary` against it (every cluster test but those of
   tests/conftest.py's ONE_VERSION, which ran once with Debian's Slurm, as the unit tests did);
3. where PyPI has a pyslurm for that release (25.11), a virtualenv with pyslurm built
   against it (cached as a wheel), and the pyslurm backend's own tests in it;
4. that cluster is stopped again (`down`).
Prints one line per version, and exits non-zero if any version failed.
"""

from __future__ import annotations

import fcntl
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCALCLUSTER = REPO / "contrib" / "localcluster"
sys.path.insert(0, str(LOCALCLUSTER))

import localcluster  # noqa: E402
import slurm_build  # noqa: E402

from slurm_hai.policy.limits import MASTER_PORT_SPAN  # noqa: E402

# Slurm release series -> the pyslurm release built for it (PyPI has pyslurm for 25.11 only).
PYSLURM = {"25.11": "pyslurm==25.11.2"}
PYSLURM_TESTS = ["tests/with_pyslurm"]


def release_of(tarball: Path) -> str:
    m = re.match(r"slurm-(\d+\.\d+\.\d+)", slurm_build.top_dir(tarball))
    if not m:
        sys.exit(f"each_slurm: {tarball.name} is not a Slurm source tarball (slurm-X.Y.Z/ inside)")
    return m.group(1)


def run(argv: list[str], env: dict[str, str]) -> int:
    print(f"$ {' '.join(argv)}", flush=True)
    return subprocess.run(argv, env=env, cwd=REPO).returncode


def pyslurm_requirement(tarball: Path) -> str | None:
    """The pyslurm requirement for this tarball's release series, if PyPI has one."""
    return PYSLURM.get(".".join(release_of(tarball).split(".")[:2]))


def wheels_dir(prefix: Path) -> Path:
    return prefix.with_name(prefix.name + "-pyslurm-wheels")


def pyslurm_python(requirement: str, prefix: Path) -> Path:
    """A virtualenv with slurm-hai (no torch) and `requirement` built against `prefix`; the
    pyslurm wheel is cached beside the Slurm build, so only the first run compiles it."""
    venv = prefix.with_name(prefix.name + "-pyslurm-venv")
    wheels = wheels_dir(prefix)
    py = venv / "bin" / "python"
    # pyslurm records where it found libslurmfull.so (prefix/lib/slurm): no rpath needed.
    # CFLAGS, after Python's own -g -O2: as the Slurm build's (slurm_build.CONFIGURE_FLAGS), a
    # test build; 148 s of CPU for the wheel on 2 cores (stop 63).
    build_env = {**os.environ, "SLURM_INCLUDE_DIR": str(prefix / "include"), "SLURM_LIB_DIR": str(prefix / "lib"),
                 "PYSLURM_BUILD_JOBS": str(os.cpu_count() or 1), "CFLAGS": "-O1 -g0"}
    with open(prefix.with_name(prefix.name + "-pyslurm.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a background build of the same wheel finishes first
        if not py.exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        if not list(wheels.glob("pyslurm-*.whl")):
            print(f"building {requirement} against {prefix} (a few minutes, once)", flush=True)
            localcluster.install_packages(["python3-dev"])  # Python.h, for pyslurm's C extension
            subprocess.run([str(py), "-m", "pip", "install", "-q", "cython>=3", "wheel"], check=True)
            subprocess.run([str(py), "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                            str(wheels), requirement], check=True, env=build_env)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "--find-links", str(wheels), requirement,
                        "-e", f"{REPO}[dev]"], check=True)
    return py


def build_all(tarballs: list[Path]) -> int:
    """Every Slurm build and pyslurm wheel the test run will need, Slurm builds first."""
    localcluster.install_packages(slurm_build.BUILD_PACKAGES)
    prefixes = [slurm_build.build(t, progress=lambda m: print(m, flush=True)) for t in tarballs]
    for tarball, prefix in zip(tarballs, prefixes):
        if pyslurm_requirement(tarball):
            pyslurm_python(pyslurm_requirement(tarball), prefix)
    return 0


def build_in_background(tarballs: list[Path]) -> int:
    """Start build_all detached, at idle CPU priority, and return."""
    slurm_build.CACHE.mkdir(parents=True, exist_ok=True)
    log = slurm_build.CACHE / "background-build.log"
    missing = [t for t in tarballs if not slurm_build.is_built(slurm_build.built_prefix(t))
               or (pyslurm_requirement(t) and not list(wheels_dir(slurm_build.built_prefix(t)).glob("pyslurm-*.whl")))]
    if not missing:
        return 0
    print(f"building Slurm {', '.join(release_of(t) for t in missing)} (and pyslurm) in the background at idle CPU priority "
          f"while the tests run (log: {log})", flush=True)
    with open(log, "ab") as out:
        subprocess.Popen([sys.executable, __file__, "--build", *map(str, tarballs)], cwd=REPO, stdin=subprocess.DEVNULL,
                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                         preexec_fn=lambda: os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0)))
    return 0


def release_slot(release: str) -> int:
    """A number of its own for each Slurm release series (two a year since 22.05: 23.11 -> 3,
    25.11 -> 7), so that the clusters of every directory's run (`make test`'s and
    `make test-sites`') have their own ports and job ids (hence job directories). Port bases
    17000 and up are theirs: Debian's cluster has 16800, the netns layout's 16700 (Makefile)."""
    year, month = (int(x) for x in release.split(".")[:2])
    return max(0, (year - 22) * 2 + (month > 6))


def first_job_id(slot: int) -> int:
    """The first job id of the cluster of release slot `slot`: ids of their own (hence job
    directories), and ids apart modulo MASTER_PORT_SPAN too. The clusters of two versions run
    at once on the host's network, and a job's rendezvous port is MASTER_PORT_BASE + its id
    modulo that span: two clusters' first ids alike there gave the same test's jobs in both
    one port, and one job's rank 0 could not listen (CI, stop 50: 800011 and 900011)."""
    return 100_000 * (slot + 1) + MASTER_PORT_SPAN // 10 * (slot % 10)


def tarballs_in(directory: str) -> list[Path]:
    tarballs = sorted(Path(directory).glob("slurm-*.tar.gz"),
                      key=lambda t: [int(x) for x in release_of(t).split(".")])
    if not tarballs:
        sys.exit(f"each_slurm: no slurm-*.tar.gz in {directory}")
    return tarballs


def run_one(tarball: Path, pytest_args: list[str]) -> int:
    """Steps 1-4 for one tarball; its exit status."""
    release = release_of(tarball)
    k = release_slot(release)
    env = {**os.environ, "HAI_CLUSTER_DIR": f"/var/lib/slurm-hai/localcluster-{release}",
           "HAI_CLUSTER_PORT_BASE": str(17000 + 100 * k), "HAI_CLUSTER_FIRST_JOB_ID": str(first_job_id(k)),
           "HAI_SLURM_SOURCE": str(tarball.resolve())}
    env.pop("HAI_SLURM_PREFIX", None)
    rc = run([str(LOCALCLUSTER / "up")], env)
    if rc == 0:
        rc = run([sys.executable, "-m", "pytest", "tests/cluster", "-m", "slurm_boundary", *pytest_args], env)
    if rc == 0 and pyslurm_requirement(tarball):
        py = pyslurm_python(pyslurm_requirement(tarball), slurm_build.built_prefix(tarball))
        rc = run([str(py), "-m", "pytest", *PYSLURM_TESTS, *pytest_args], env)
    run([str(LOCALCLUSTER / "down")], env)
    return rc


def main(argv: list[str]) -> int:
    if argv[1:2] == ["--one"]:  # one version's run, a child of the run of all
        return run_one(Path(argv[2]), argv[3:])
    if argv[1:2] == ["--build"]:  # the detached child of --build-in-background
        try:
            return build_all([Path(t) for t in argv[2:]])
        except (slurm_build.BuildError, localcluster.ClusterError, subprocess.CalledProcessError) as e:
            print(f"each_slurm: background build failed: {e}", flush=True)
            return 1
    background = argv[1:2] == ["--build-in-background"]
    if background:
        argv = argv[1:]
    if len(argv) < 2 or not Path(argv[1]).is_dir():
        print("usage: each_slurm.py [--build-in-background] DIR [PYTEST ARGS...]  "
              "(DIR holds slurm-X.Y.Z.tar.gz files)", file=sys.stderr)
        return 2
    tarballs = tarballs_in(argv[1])
    if background:
        return build_in_background(tarballs)
    running = []
    for tarball in tarballs:
        log = slurm_build.CACHE / f"tests-{release_of(tarball)}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("wb") as out:
            running.append((release_of(tarball), log, time.monotonic(),
                            subprocess.Popen([sys.executable, __file__, "--one", str(tarball), *argv[2:]], cwd=REPO,
                                             stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)))
    print(f"testing Slurm {', '.join(r for r, *_ in running)} at once; each one's output follows when it is done",
          flush=True)
    results = []
    while running:
        for entry in [e for e in running if e[3].poll() is not None]:
            running.remove(entry)
            release, log, t0, proc = entry
            results.append((release, proc.returncode, time.monotonic() - t0))
            print(f"\n===== Slurm {release} ({log}) =====", flush=True)
            sys.stdout.buffer.write(log.read_bytes())
            sys.stdout.flush()
        time.sleep(1)
    print("\nSlurm versions tested:")
    for release, rc, seconds in results:
        print(f"  Slurm {release}: {'passed' if rc == 0 else f'FAILED (exit {rc})'} in {seconds:.0f} s")
    return 0 if all(rc == 0 for _, rc, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
