"""The warm-start service as the unit tests start it (test_warm.py, test_front.py): the real
`hai-admin warm-start`, as root, on a socket in a directory every user may read."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

HAI_ADMIN = Path(sys.executable).with_name("hai-admin")


@pytest.fixture
def shared():
    """A directory every user may read (pytest's tmp_path is root's alone)."""
    d = Path(tempfile.mkdtemp(prefix="hai-warm-"))
    d.chmod(0o755)
    yield d
    subprocess.run(["rm", "-rf", str(d)], check=False)


def start_service(sock: Path, preload: str, env: dict[str, str] | None = None, *args: str) -> subprocess.Popen:
    with open(sock.with_suffix(".log"), "w") as log:  # the service's own now: closed here, not whenever GC runs
        service = subprocess.Popen([str(HAI_ADMIN), "warm-start", "--socket", str(sock), "--preload", preload, *args],
                                   stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    deadline = time.monotonic() + 60
    while "warm-start service on" not in sock.with_suffix(".log").read_text():
        assert service.poll() is None and time.monotonic() < deadline, sock.with_suffix(".log").read_text()
        time.sleep(0.05)
    return service
