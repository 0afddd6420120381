"""squeue's text as the commands backend asks for it, for tests without a cluster.

The backend asks `squeue --Format=Field:0SEP,...` with a separator made at random per call
(slurm_hai.slurm.squeue.queue_argv): a fake squeue answers in the fields and with the
separator of the argv it was given. Rows are dicts of squeue field name -> the text squeue
prints; the recorded ones (tests/fixtures/slurm/<release>/squeue.txt) are what a live Slurm
printed.

    python tests/unit/squeue_text.py ROWS.json ARGV...   # a fake squeue: print ROWS for ARGV
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Sequence

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "slurm"


def asked(argv: Sequence[str]) -> tuple[list[str], str]:
    """The fields an squeue argv asks for, and the separator after each."""
    (spec,) = [a.split("=", 1)[1] for a in argv if a.startswith("--Format=")]
    fields = [item.split(":0", 1) for item in spec.split(",")]
    (sep,) = {s for _, s in fields}
    return [name for name, _ in fields], sep


def render(argv: Sequence[str], rows: Sequence[dict[str, str]]) -> str:
    """What squeue prints for `argv` (--Format, --jobs, --user) when the queue holds `rows`."""
    fields, sep = asked(argv)
    wanted = [a.split("=", 1)[1].split(",") for a in argv if a.startswith("--jobs=")]
    users = [a.split("=", 1)[1] for a in argv if a.startswith("--user=")]
    # --jobs=ID: that job, or every task of the array of that id
    rows = [r for r in rows if (not wanted or r["JobId"] in wanted[0] or r.get("ArrayJobID") in wanted[0])
            and (not users or r["UserName"] in users)]
    # a job of no array: squeue prints its own id as ArrayJobID (rows recorded before
    # slurm-hai asked for that field have none)
    return "".join("".join(row.get(f, row.get("JobId", "") if f == "ArrayJobID" else "") + sep for f in fields) + "\n"
                   for row in rows)


def recorded_rows(release: str) -> list[dict[str, str]]:
    """The rows of a recorded squeue.txt."""
    argv = json.loads((FIXTURES / release / "expected.json").read_text())["commands"]["squeue.txt"]
    fields, sep = asked(argv)
    cells = (FIXTURES / release / "squeue.txt").read_text().split(sep)[:-1]
    rows = []
    for start in range(0, len(cells), len(fields)):
        row = dict(zip(fields, cells[start:start + len(fields)]))
        row[fields[0]] = row[fields[0]].removeprefix("\n")
        rows.append(row)
    return rows


def recorded_releases() -> list[str]:
    return sorted(d.name for d in FIXTURES.iterdir() if (d / "squeue.txt").exists())


def fake_squeue(bin_dir: Path, rows: Sequence[dict[str, str]]) -> Path:
    """An executable `squeue` in bin_dir that prints `rows` in the format it is asked for, and
    writes each argv it was given as a line of JSON to bin_dir/squeue-calls."""
    data = bin_dir / "squeue-rows.json"
    data.write_text(json.dumps(list(rows)))
    script = bin_dir / "squeue"
    script.write_text(f"#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} {data} \"$@\"\n")
    script.chmod(0o755)
    return script


if __name__ == "__main__":
    rows_file, argv = Path(sys.argv[1]), ["squeue", *sys.argv[2:]]
    with open(rows_file.parent / "squeue-calls", "a") as calls:
        calls.write(json.dumps(argv) + "\n")
    sys.stdout.write(render(argv, json.loads(rows_file.read_text())))
