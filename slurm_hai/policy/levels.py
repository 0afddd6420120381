"""Priority levels of the HAI model (pure; no I/O).

A level is a name and a number. Higher numbers win. AUTO is not a level but a
request: "the highest level where I still have quota" (resolved at submission).
"""

from __future__ import annotations

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


def parse_level(text: str | int, ladder: tuple[Level, ...] = DEFAULT_LADDER) -> Level | str:
    """Turn a user's priority (name, number or AUTO) into a Level, or AUTO.

    Names are case-insensitive; a number must be exactly a level's value.
    """
    raw = str(text).strip()
    if raw.upper() == AUTO or raw == str(AUTO_VALUE):
        return AUTO
    names = {lvl.name: lvl for lvl in ladder}
    if raw.upper() in names:
        return names[raw.upper()]
    if raw.lstrip("-").isdigit():
        for lvl in ladder:
            if lvl.value == int(raw):
                return lvl
    choices = ", ".join(f"{lvl.name}({lvl.value})" for lvl in ladder)
    raise LevelError(f"unknown priority level {raw!r}; use one of {choices} or AUTO")


def level_of_qos(qos: str, ladder: tuple[Level, ...] = DEFAULT_LADDER) -> Level | None:
    for lvl in ladder:
        if lvl.qos == qos.lower():
            return lvl
    return None


def ladder_arg(ladder: tuple[Level, ...]) -> str:
    """The ladder as `NAME:VALUE,...`, the form the SPANK plugin takes."""
    return ",".join(f"{lvl.name}:{lvl.value}" for lvl in ladder)
