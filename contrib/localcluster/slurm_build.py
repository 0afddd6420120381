"""Build Slurm from a source tarball into a cached prefix, once per tarball.

The prefix is named after the tarball's SHA-256, so a second `up` with the same tarball
finds it and builds nothing; a half-finished build (killed, out of disk) never counts,
because the prefix is only marked usable (`.hai-built`) after `make install` succeeded.
A lock file keeps two builds of the same tarball from racing.

Usable alone too:  python3 slurm_build.py TARBALL   (prints the prefix)
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

CACHE = Path(os.environ.get("HAI_SLURM_CACHE", "/var/cache/slurm-hai"))

# --enable-multiple-slurmd: the local cluster runs several slurmd on one host; without it
# Slurm keeps one node per host name and steps across nodes fail (seen on 25.11).
# CFLAGS=-O1, without Slurm's default -g -O2: a test cluster's build, which CI makes for every
# version on a fresh machine, beside Debian's suite; 26.05.3's make took 710 s of CPU with the
# default and 448 s with this (2 cores, stop 63).
CONFIGURE_FLAGS = ["--with-munge", "--disable-debug", "--enable-multiple-slurmd", "CFLAGS=-O1"]

# Debian packages a Slurm source build needs (measured on Debian 12 for 25.11 and 26.05).
BUILD_PACKAGES = ["build-essential", "libmunge-dev", "libjson-c-dev", "libhttp-parser-dev", "libyaml-dev",
                  "libjwt-dev", "libmariadb-dev", "liblua5.3-dev", "libhwloc-dev", "libpam0g-dev",
                  "libreadline-dev", "pkg-config", "libdbus-1-dev"]


class BuildError(Exception):
    """The build failed; the message names the step and the log to read."""


def tarball_digest(tarball: Path) -> str:
    h = hashlib.sha256()
    with open(tarball, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def top_dir(tarball: Path) -> str:
    with tarfile.open(tarball) as tf:
        first = tf.next()
        if first is None:
            raise BuildError(f"{tarball} is empty")
        return first.name.split("/", 1)[0]


def built_prefix(tarball: Path) -> Path:
    """Where `tarball` is (or will be) installed: CACHE/<top dir>-<12 hex digits of the
    tarball's SHA-256 and the configure flags>."""
    key = hashlib.sha256(f"{tarball_digest(tarball)} {' '.join(CONFIGURE_FLAGS)}".encode()).hexdigest()
    return CACHE / f"{top_dir(tarball)}-{key[:12]}"


def same_build(recorded: Path, wanted: Path) -> bool:
    """Whether `wanted`, a finished build, is the build `recorded` was: the same tarball and
    flags, installed under another cache (HAI_SLURM_CACHE moved, or a machine's second cache).
    The directory name holds the version and the key; `recorded` may be gone."""
    return recorded.name == wanted.name and is_built(wanted)


def is_built(prefix: Path) -> bool:
    return (prefix / ".hai-built").exists() and (prefix / "sbin" / "slurmctld").exists()


def _step(argv: list[str], cwd: Path, log: Path, what: str) -> None:
    with open(log, "ab") as out:
        out.write(f"\n$ {' '.join(argv)}\n".encode())
        out.flush()
        p = subprocess.run(argv, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if p.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        raise BuildError(f"{what} failed (exit {p.returncode}); full log: {log}\n{tail}")


def build(tarball: Path, jobs: int | None = None, progress=print) -> Path:
    """Configure, make and install `tarball` into its cached prefix; return the prefix."""
    tarball = tarball.resolve()
    if not tarball.is_file():
        raise BuildError(f"{tarball}: no such Slurm source tarball")
    prefix = built_prefix(tarball)
    if is_built(prefix):
        return prefix
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"{prefix.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_built(prefix):  # another build finished while we waited
            return prefix
        work = CACHE / f"{prefix.name}.build"
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(prefix, ignore_errors=True)
        work.mkdir(parents=True)
        log = CACHE / f"{prefix.name}.log"
        log.write_text(f"building {tarball} into {prefix}\n")
        t0 = time.monotonic()
        progress(f"building Slurm from {tarball.name} into {prefix} (about 5 min on 2 cores; log: {log})")
        _step(["tar", "-xzf", str(tarball), "-C", str(work)], work, log, "unpacking")
        src = work / top_dir(tarball)
        jobs = jobs or (os.cpu_count() or 1) + 1
        _step(["./configure", f"--prefix={prefix}", f"--sysconfdir={prefix}/etc", *CONFIGURE_FLAGS],
              src, log, "configure")
        _step(["make", f"-j{jobs}"], src, log, "make")
        _step(["make", "install"], src, log, "make install")
        (prefix / ".hai-built").write_text(f"{tarball.name} {tarball_digest(tarball)}\n")
        shutil.rmtree(work, ignore_errors=True)
        progress(f"built Slurm {tarball.name} in {time.monotonic() - t0:.0f} s")
    return prefix


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: slurm_build.py TARBALL", file=sys.stderr)
        sys.exit(2)
    try:
        print(build(Path(sys.argv[1]), progress=lambda m: print(m, file=sys.stderr)))
    except BuildError as e:
        print(f"slurm_build: {e}", file=sys.stderr)
        sys.exit(1)
