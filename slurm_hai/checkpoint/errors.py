"""Errors raised by the checkpoint library (stdlib only, so the CLI can import them)."""

from __future__ import annotations

from dataclasses import dataclass


class CheckpointError(Exception):
    """A checkpoint could not be saved, found or loaded; the message says what to do."""


class SupersededRunError(CheckpointError):
    """This run of a job may not commit: a newer run of the same job has started (Slurm
    requeued the job while this run's processes were cut off from it). The process must
    stop; CheckpointManager turns this into SystemExit."""


@dataclass(frozen=True)
class Problem:
    """One reason a committed checkpoint is not trustworthy."""

    file: str  # path relative to the checkpoint directory ("manifest.json", "state.safetensors")
    reason: str

    def __str__(self) -> str:
        return f"{self.file}: {self.reason}"


class CorruptCheckpointError(CheckpointError):
    """A committed checkpoint failed verification (size, checksum or format)."""

    def __init__(self, path: str, problems: list[Problem]) -> None:
        self.path = path
        self.problems = problems
        listed = "; ".join(str(p) for p in problems)
        super().__init__(f"checkpoint {path} is corrupt: {listed}")
