"""`hai ckpt`: list and verify checkpoint directories written by slurm_hai.checkpoint.

Reads manifests and files only (stdlib + xxhash): it never imports torch, so it starts
fast and runs on login nodes without the training stack.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import click

EXIT_BAD_CHECKPOINT = 1


def _human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _checkpoint_root(directory: str) -> Path:
    root = Path(directory)
    if not root.exists():
        raise click.ClickException(f"{root}: no such directory")
    if not root.is_dir():
        raise click.ClickException(f"{root}: not a directory")
    return root


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """A checkpoint root lists its step-* dirs; a single step dir is accepted as well."""
    from slurm_hai.checkpoint.manifest import MANIFEST_NAME, list_step_dirs, parse_step_dir_name  # lazy: +3 ms to every hai command

    step = parse_step_dir_name(root.name)
    if step is not None and (root / MANIFEST_NAME).exists():
        return [(step, root)]
    try:
        return list_step_dirs(root)
    except PermissionError:
        raise click.ClickException(f"{root}: permission denied (checkpoint dirs are 0700: run as their owner)") from None


def _hidden_dirs(root: Path, prefix: str) -> list[str]:
    try:
        return sorted(p.name for p in root.iterdir() if p.name.startswith(prefix) and p.is_dir())
    except OSError:
        return []


@click.group(name="ckpt")
def ckpt() -> None:
    """Inspect checkpoints written by slurm_hai.checkpoint.

    A checkpoint directory holds step-<N>/ subdirectories, each committed atomically
    with a manifest.json that records every file's size and xxh3_128 checksum.
    """


@ckpt.command(name="ls")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def ls_command(directory: str, as_json: bool) -> None:
    """List committed checkpoints in DIRECTORY, newest first.

    Checks each manifest and file sizes (fast); `hai ckpt verify` also checks the data.
    Saves in progress (.staging-*) and quarantined checkpoints are listed too.
    """
    from slurm_hai.checkpoint.manifest import QUARANTINE_DIR, STAGING_PREFIX, verify_checkpoint  # lazy: +3 ms to every hai command

    root = _checkpoint_root(directory)
    rows: list[dict[str, Any]] = []
    for step, path in _step_dirs(root):
        result = verify_checkpoint(path, check_data=False)
        manifest = result.manifest
        rows.append(
            {
                "step": step,
                "path": str(path),
                "status": "sizes_ok" if result.ok else "bad",  # the data is verify's to check
                "problems": [str(p) for p in result.problems],
                "files": len(manifest.files) if manifest else None,
                "bytes": manifest.total_bytes if manifest else None,
                "layout": manifest.layout if manifest else None,
                "world_size": manifest.world_size if manifest else None,
                "created_unix": manifest.created_unix if manifest else None,
            }
        )
    staging = _hidden_dirs(root, STAGING_PREFIX)
    quarantine_dir = root / QUARANTINE_DIR
    quarantined = _hidden_dirs(quarantine_dir, "step-") if quarantine_dir.is_dir() else []
    if as_json:
        click.echo(json.dumps({"directory": str(root), "checkpoints": rows, "in_progress": staging,
                               "quarantined": quarantined}, indent=2))
        return
    if not rows:
        click.echo(f"{root}: no committed checkpoints")
    else:
        click.echo(f"{'STEP':>12}  {'SIZE':>10}  {'FILES':>5}  {'LAYOUT':<6}  {'WORLD':>5}  {'CREATED (UTC)':<19}  "
                   "STATUS (`verify` checks the data)")
        for row in rows:
            created = (
                time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(row["created_unix"])) if row["created_unix"] else "-"
            )
            size = _human_bytes(row["bytes"]) if row["bytes"] is not None else "-"
            status = "sizes ok" if row["status"] == "sizes_ok" else "BAD: " + "; ".join(row["problems"])
            click.echo(
                f"{row['step']:>12}  {size:>10}  {row['files'] or '-':>5}  {row['layout'] or '-':<6}  "
                f"{row['world_size'] or '-':>5}  {created:<19}  {status}"
            )
    for name in staging:
        click.echo(f"in progress: {name}")
    for name in quarantined:
        click.echo(f"quarantined: {QUARANTINE_DIR}/{name}")


@ckpt.command(name="verify")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--step", type=int, default=None, help="Verify only this step (default: every checkpoint).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def verify_command(directory: str, step: int | None, as_json: bool) -> None:
    """Verify checkpoints in DIRECTORY: manifest, file sizes and xxh3_128 checksums.

    Exits 1 if any verified checkpoint is bad, naming the file and the reason. Read only:
    nothing is moved (the training job quarantines bad checkpoints itself).
    """
    from slurm_hai.checkpoint.errors import CheckpointError  # lazy: +3 ms to every hai command
    from slurm_hai.checkpoint.manifest import verify_checkpoint  # lazy: +3 ms to every hai command

    root = _checkpoint_root(directory)
    targets = _step_dirs(root)
    if step is not None:
        targets = [(s, p) for s, p in targets if s == step]
        if not targets:
            raise click.ClickException(f"{root}: no checkpoint for step {step} (`hai ckpt ls {root}` lists them)")
    if not targets:
        raise click.ClickException(f"{root}: no committed checkpoints to verify")
    try:
        results = [verify_checkpoint(path) for _, path in targets]
    except CheckpointError as exc:  # e.g. xxhash missing
        raise click.ClickException(str(exc)) from None
    bad = [r for r in results if not r.ok]
    if as_json:
        click.echo(
            json.dumps(
                {
                    "directory": str(root),
                    "ok": not bad,
                    "checkpoints": [
                        {
                            "step": r.step,
                            "path": str(r.path),
                            "ok": r.ok,
                            "problems": [{"file": p.file, "reason": p.reason} for p in r.problems],
                        }
                        for r in results
                    ],
                },
                indent=2,
            )
        )
    else:
        for r in results:
            if r.ok:
                size = _human_bytes(r.manifest.total_bytes) if r.manifest else "?"
                count = len(r.manifest.files) if r.manifest else 0
                click.echo(f"{r.path.name}: ok ({count} files, {size})")
            else:
                for problem in r.problems:
                    click.echo(f"{r.path.name}: BAD {problem.file}: {problem.reason}")
    if bad:
        if not as_json:
            click.echo(f"{len(bad)} of {len(results)} checkpoints are bad", err=True)
        click.get_current_context().exit(EXIT_BAD_CHECKPOINT)
