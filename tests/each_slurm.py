"""Run the cluster suite on every Slurm source tarball of a directory (`SLURM_SOURCES=DIR make test`).

    python tests/each_slurm.py DIR [PYTEST ARGS...]

For each `slurm-*.tar.gz` in DIR, oldest first:
1. its own local cluster: state dir /var/lib/slurm-hai/localcluster-<version>, its own
   ports and job ids (job directories never meet those of another version's run), Slurm
   built once from the tarball (contrib/localcluster/slurm_build.py caches
   the build by checksum, so a second run builds nothing);
2. the cluster tests marked `slurm_boundary` against it (every cluster test but those of
   tests/conftest.py's ONE_VERSION, which ran once with Debian's Slurm, as the unit tests did);
3. where PyPI has a pyslurm for that release (25.11), a virtualenv with pyslurm built
   against it (cached as a wheel), and the pyslurm backend's own tests in it;
4. that cluster is stopped again (`down`), so one version runs at a time.
Prints one line per version, and exits non-zero if any version failed.
"""

from __future__ import annotations

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


def pyslurm_python(requirement: str, prefix: Path) -> Path:
    """A virtualenv with slurm-hai (no torch) and `requirement` built against `prefix`; the
    pyslurm wheel is cached beside the Slurm build, so only the first run compiles it."""
    venv = prefix.with_name(prefix.name + "-pyslurm-venv")
    wheels = prefix.with_name(prefix.name + "-pyslurm-wheels")
    py = venv / "bin" / "python"
    # pyslurm records where it found libslurmfull.so (prefix/lib/slurm): no rpath needed
    build_env = {**os.environ, "SLURM_INCLUDE_DIR": str(prefix / "include"), "SLURM_LIB_DIR": str(prefix / "lib"),
                 "PYSLURM_BUILD_JOBS": str(os.cpu_count() or 1)}
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    if not list(wheels.glob("pyslurm-*.whl")):
        print(f"building {requirement} against {prefix} (a few minutes, once)", flush=True)
        localcluster.install_packages(["python3-dev"])  # Python.h, for pyslurm's C extension
        subprocess.run([str(py), "-m", "pip", "install", "-q", "cython>=3", "wheel"], check=True)
        subprocess.run([str(py), "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels),
                        requirement], check=True, env=build_env)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--find-links", str(wheels), requirement,
                    "-e", f"{REPO}[dev]"], check=True)
    return py


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not Path(argv[1]).is_dir():
        print("usage: each_slurm.py DIR [PYTEST ARGS...]  (DIR holds slurm-X.Y.Z.tar.gz files)", file=sys.stderr)
        return 2
    tarballs = sorted(Path(argv[1]).glob("slurm-*.tar.gz"), key=lambda t: [int(x) for x in release_of(t).split(".")])
    if not tarballs:
        print(f"each_slurm: no slurm-*.tar.gz in {argv[1]}", file=sys.stderr)
        return 2
    results = []
    for i, tarball in enumerate(tarballs):
        release = release_of(tarball)
        env = {**os.environ, "HAI_CLUSTER_DIR": f"/var/lib/slurm-hai/localcluster-{release}",
               "HAI_CLUSTER_PORT_BASE": str(17000 + 100 * i), "HAI_CLUSTER_FIRST_JOB_ID": str(100_000 * (i + 1)),
               "HAI_SLURM_SOURCE": str(tarball.resolve())}
        env.pop("HAI_SLURM_PREFIX", None)
        t0 = time.monotonic()
        rc = run([str(LOCALCLUSTER / "up")], env)
        if rc == 0:
            rc = run([sys.executable, "-m", "pytest", "tests/cluster", "-m", "slurm_boundary", *argv[2:]], env)
        series = ".".join(release.split(".")[:2])
        if rc == 0 and series in PYSLURM:
            py = pyslurm_python(PYSLURM[series], slurm_build.built_prefix(tarball))
            rc = run([str(py), "-m", "pytest", *PYSLURM_TESTS, *argv[2:]], env)
        run([str(LOCALCLUSTER / "down")], env)
        results.append((release, rc, time.monotonic() - t0))
    print("\nSlurm versions tested:")
    for release, rc, seconds in results:
        print(f"  Slurm {release}: {'passed' if rc == 0 else f'FAILED (exit {rc})'} in {seconds:.0f} s")
    return 0 if all(rc == 0 for _, rc, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
