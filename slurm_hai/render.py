"""Render the jinja2 templates that travel with the package (`slurm_hai/templates`, the
repository's top-level `templates/`): config files and sbatch scripts.

Templates hold the shell and config text; Python passes validated values only.
Every value that lands in shell goes through the `sh` filter (shlex.quote).
"""

from __future__ import annotations

import shlex
from functools import lru_cache
import jinja2

from .slurm.version import OLDEST_SUPPORTED


@lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("slurm_hai", "templates"),  # found through importlib
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["sh"] = lambda value: shlex.quote(str(value))
    # templates/slurm/ ask `slurm.<feature>`; unless the context names a version, the
    # oldest supported one, whose spellings every later Slurm still accepts
    env.globals["slurm"] = OLDEST_SUPPORTED
    return env


def render(template: str, **context: object) -> str:
    return environment().get_template(template).render(**context)
