"""Render the jinja2 templates under `templates/` (config files, sbatch scripts).

Templates hold the shell and config text; Python passes validated values only.
Every value that lands in shell goes through the `sh` filter (shlex.quote).
"""

from __future__ import annotations

import shlex
from functools import lru_cache
from pathlib import Path

import jinja2


def templates_dir() -> Path:
    """`slurm_hai/_templates` in an installed wheel, else the repository's `templates/`."""
    packaged = Path(__file__).with_name("_templates")
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[1] / "templates"


@lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["sh"] = lambda value: shlex.quote(str(value))
    return env


def render(template: str, **context: object) -> str:
    return environment().get_template(template).render(**context)
