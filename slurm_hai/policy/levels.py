"""Priority levels of the HAI model and the Slurm names they take (pure; no I/O).

A level is a name and a number. Higher numbers win. AUTO is not a level but a
request: "the highest level where I still have quota".

Each level is carried by a Slurm QOS: the lower-case level name (`normal`), or, for a
per-user or per-account quota override, a variant of it named `<level>.u.<user>` or
`<level>.a.<account>` (see policy/ladder.py). Every decoding of a QOS into a level goes
through `level_of_qos`; job_submit.lua (rendered from the same names) decodes the same way.
"""

from __future__ import annotations

import re

from dataclasses import dataclass

AUTO = "AUTO"
AUTO_VALUE = -1


@dataclass(frozen=True, order=True)
class Level:
    value: int
    name: str

    @property
    def qos(self) -> str:
        """The Slurm QOS that carries this level (lower-case level name)."""
        return self.name.lower()


# HAI's own ladder: the policy loader's default when a policy file has no [levels].
DEFAULT_LADDER: tuple[Level, ...] = (
    Level(50, "EXTREME_HIGH"),
    Level(40, "VERY_HIGH"),
    Level(30, "HIGH"),
    Level(20, "ABOVE_NORMAL"),
    Level(10, "NORMAL"),
    Level(8, "UNDER_NORMAL"),
    Level(5, "BELOW_NORMAL"),
    Level(0, "LOW"),
)


class LevelError(ValueError):
    """A priority given by a user that is not a level of the ladder."""


def parse_level(text: str | int, ladder: tuple[Level, ...]) -> Level | str:
    """Turn a user's priority (name, number or AUTO) into a Level of `ladder` (the policy's), or AUTO.

    Names are case-insensitive; a number must be exactly a level's value.
    """
    raw = str(text)
    # ASCII only, as the SPANK plugin and job_submit.lua read it (Unicode would strip other
    # white space and upper-case 'hıgh' to HIGH)
    names = {lvl.name: lvl for lvl in ladder} if raw.isascii() else {}
    raw = raw.strip()
    if names and (raw.upper() == AUTO or raw == str(AUTO_VALUE)):
        return AUTO
    if raw.upper() in names:
        return names[raw.upper()]
    if names and re.fullmatch(r"-?[0-9]+", raw):  # ASCII digits, as the SPANK plugin reads them
        for lvl in ladder:
            if lvl.value == int(raw):
                return lvl
    choices = ", ".join(f"{lvl.name}({lvl.value})" for lvl in ladder)
    raise LevelError(f"unknown priority level {raw!r}; use one of {choices} or AUTO")


# Multifactor priority = PriorityWeightQOS * qos.Priority / max(qos.Priority). QOS priority
# is level value + 1 (never 0), so a job's priority is (value + 1) * LEVEL_STRIDE and the
# policy daemon can order jobs inside one level with offsets below LEVEL_STRIDE.
LEVEL_STRIDE = 1_000_000
VARIANT_SEP = "."


def level_base(lvl: Level) -> int:
    """The multifactor priority every job of `lvl` gets from Slurm (before the daemon's offsets)."""
    return (lvl.value + 1) * LEVEL_STRIDE


def variant_qos(lvl: Level, kind: str, owner: str) -> str:
    """The QOS of an override: kind "u" (user) or "a" (account)."""
    return VARIANT_SEP.join((lvl.qos, kind, owner))


def parse_qos(name: str) -> tuple[str, str, str]:
    """QOS name -> (base qos, kind, owner); kind and owner are "" for a base QOS."""
    parts = name.lower().split(VARIANT_SEP, 2)
    if len(parts) == 3 and parts[1] in ("u", "a") and parts[2]:
        return parts[0], parts[1], parts[2]
    return name.lower(), "", ""


def level_of_qos(qos: str, ladder: tuple[Level, ...]) -> Level | None:
    """The level a QOS (base or override variant) carries; None for a QOS outside the ladder."""
    base = parse_qos(qos)[0]
    for lvl in ladder:
        if lvl.qos == base:
            return lvl
    return None

