"""MUNGE stood in for, for tests without munged: a credential shaped as MUNGE's (each one
new) that names a uid and carries a payload, and the lighthouse service's side of it, which
decodes each credential once (munged refuses a replayed one) through the service's own
parsing (controller/lighthouse.py: credential_of, uid_of_unmunged).

    python tests/unit/munge_fake.py   # a fake `munge`: a credential of this user carrying stdin
"""

from __future__ import annotations

import base64
import json
import os
import sys
import uuid
from pathlib import Path


def credential(uid: int, payload: str) -> str:
    return "MUNGE:" + base64.b64encode(json.dumps([uid, payload, uuid.uuid4().hex]).encode()).decode() + ":"


class Unmunge:
    """serve()'s `identify`: the uid of a fake credential made for the request's target."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def __call__(self, authorization: list[str], target: str) -> int:
        from slurm_hai.controller.lighthouse import credential_of, uid_of_unmunged

        given = credential_of(authorization)
        uid, payload, _ = json.loads(base64.b64decode(given[len("MUNGE:"):-1]))
        rc = 17 if given in self.seen else 0  # EMUNGE_CRED_REPLAYED
        self.seen.add(given)
        return uid_of_unmunged(rc, f"UID:             {uid}\n\n{payload}", "", target)


def fake_munge(bin_dir: Path) -> Path:
    """An executable `munge` in bin_dir (its --socket ignored)."""
    script = bin_dir / "munge"
    script.write_text(f"#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()}\n")
    script.chmod(0o755)
    return script


if __name__ == "__main__":
    print(credential(os.getuid(), sys.stdin.read()))
