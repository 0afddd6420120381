"""The import rules of docs/design.md, checked on the source:

- imports go down the floors of the module map, never up or sideways, and no two modules
  import each other, even through others (imports at any depth: in functions and under
  `if TYPE_CHECKING:` too);
- an import inside a function says why it is there (`# lazy: ...`);
- policy/ imports only the standard library (and itself);
- runtime/client imports only the standard library when training code imports it;
- runtime/ pulls in neither click nor jinja2;
- the CLI and runtime/client import no training framework (the integrations are extras), and
  each integration imports only its own framework;
- no module outside slurm/ names a Slurm command;
- the persist agent (checkpoint/agent.py) loads no torch.
"""

from __future__ import annotations

import ast
import io
import json
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "slurm_hai"
DESIGN = PACKAGE.parent / "docs" / "design.md"
SLURM_COMMANDS = {"sbatch", "srun", "salloc", "squeue", "scontrol", "scancel", "sacct", "sacctmgr", "sinfo",
                  "sprio", "sshare", "sdiag", "sstat", "strigger"}


def modules(under: str = "") -> list[Path]:
    return sorted(p for p in (PACKAGE / under).rglob("*.py") if "__pycache__" not in p.parts)


def imports(path: Path) -> list[tuple[str, int]]:
    """(absolute module name, line) of every import, less those under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text())
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
               and getattr(node.test, "id", "") == "TYPE_CHECKING" for n in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                found.append((".".join(base + ([node.module] if node.module else [])), node.lineno))
            else:
                found.append((node.module or "", node.lineno))
    return found


# The floors of docs/design.md's module map, bottom to top: a package imports its own modules
# and the packages of lower floors, nothing else. "__init__" is slurm_hai/__init__.py, which
# every import of the package runs first: it imports nothing of ours (the in-job API's names
# are loaded by importlib when first used).
FLOORS = (("policy", "__init__"), ("slurm", "checkpoint"), ("render",), ("jobs",), ("runtime",),
          ("controller", "integrations"), ("cli",))
FLOOR = {package: number for number, packages in enumerate(FLOORS, 1) for package in packages}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in modules()}


def package_of(module: str) -> str:
    """policy, slurm, ..., render for slurm_hai/render.py, __init__ for slurm_hai itself."""
    return (module.split(".") + ["__init__"])[1]


def our_imports(path: Path) -> list[tuple[str, int]]:
    """(module of ours, line) of every import in `path`, at any depth; `from .x import y`
    names the module x.y where y is one, else x."""
    here = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here.split(".")[: len(here.split(".")) - node.level + 1] + ([base] if base else []))
            found += [(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base, node.lineno)
                      for alias in node.names]
    return [(name, line) for name, line in found if name in MODULES]


def test_every_package_has_a_floor():
    assert {package_of(m) for m in MODULES} == set(FLOOR)


def test_imports_go_down_the_floors():
    wrong = []
    for module, path in MODULES.items():
        for target, line in our_imports(path):
            here, there = package_of(module), package_of(target)
            if here != there and FLOOR[there] >= FLOOR[here]:
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {module} -> {target} "
                             f"({here}, floor {FLOOR[here]} -> {there}, floor {FLOOR[there]})")
    assert not wrong, "imports up or sideways:\n" + "\n".join(wrong)


def test_no_circle_of_modules():
    graph = {module: {target for target, _ in our_imports(path) if target != module}
             for module, path in MODULES.items()}
    circles = []
    for start in sorted(graph):  # a path back to `start` through modules after it (each circle once)
        stack = [(start, [start])]
        seen = set()
        while stack:
            module, trail = stack.pop()
            for target in sorted(graph[module]):
                if target == start:
                    circles.append(" -> ".join(trail + [start]))
                elif target > start and target not in seen:
                    seen.add(target)
                    stack.append((target, trail + [target]))
    assert not circles, "modules that import each other:\n" + "\n".join(circles)


def test_the_design_names_the_same_floors():
    """docs/design.md's list of floors ("1. policy, __init__.py") is the one checked here."""
    listed = re.findall(r"^(\d)\. (.+)$", DESIGN.read_text().split("Floors, bottom to top", 1)[1], re.M)
    floors = tuple(tuple(name.strip("` ").removesuffix(".py") for name in names.split(","))
                   for _, names in listed)
    assert floors == FLOORS


def test_an_import_in_a_function_says_why():
    """An import belongs at the top of its module, unless it would cost a command's start-up
    time or load an optional extra where that must not be needed: the line then says which."""
    silent = []
    for path in modules():
        text = path.read_text()
        comments = {token.start[0]: token.string for token in tokenize.generate_tokens(io.StringIO(text).readline)
                    if token.type == tokenize.COMMENT}
        for function in ast.walk(ast.parse(text)):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and not any(
                        comments.get(line, "").startswith("# lazy: ")
                        for line in range(node.lineno, (node.end_lineno or node.lineno) + 1)):
                    silent.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {ast.unparse(node)}")
    assert not silent, "imports inside functions without a `# lazy: why` comment:\n" + "\n".join(sorted(set(silent)))


# tomli is tomllib on Python 3.10; site hooks are loaded by the interpreter, not by us.
NOT_OURS = {"tomli", "sitecustomize", "usercustomize"}


def is_stdlib(name: str) -> bool:
    return name.split(".")[0] in sys.stdlib_module_names | NOT_OURS or name == "__future__"


@pytest.mark.parametrize("path", modules("policy"), ids=lambda p: p.name)
def test_policy_imports_only_the_standard_library(path):
    bad = [(name, line) for name, line in imports(path)
           if not is_stdlib(name) and not name.startswith("slurm_hai.policy")]
    assert not bad, f"{path.relative_to(PACKAGE)} imports {bad}"


def imported_by(module: str) -> list[str]:
    code = f"import sys, json; import {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def test_the_client_loads_only_the_standard_library():
    loaded = imported_by("slurm_hai.runtime.client")
    foreign = [m for m in loaded if not is_stdlib(m) and not m.startswith(("slurm_hai", "_"))]
    assert not foreign, foreign
    public = imported_by("slurm_hai")  # `import slurm_hai as hai` costs nothing more
    assert not [m for m in public if not is_stdlib(m) and not m.startswith(("slurm_hai", "_"))]


@pytest.mark.parametrize("path", modules("runtime"), ids=lambda p: p.name)
def test_runtime_needs_neither_click_nor_jinja2(path):
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    loaded = imported_by(module)
    assert not [m for m in loaded if m.split(".")[0] in ("click", "jinja2")], module


@pytest.mark.parametrize("path", [p for p in modules() if "slurm" not in p.relative_to(PACKAGE).parts[:1]],
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_only_the_slurm_package_names_a_slurm_command(path):
    """A string that is exactly a Slurm command's name is how argv starts; outside slurm/
    there must be none (docstrings and messages that merely mention one are fine)."""
    named = [(node.value, node.lineno) for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Constant) and node.value in SLURM_COMMANDS]
    assert not named, f"{path.relative_to(PACKAGE)} runs Slurm itself: {named}"


FRAMEWORKS = ("transformers", "accelerate", "lightning", "pytorch_lightning")


def frameworks_loaded_by(module: str) -> set[str]:
    return {m.split(".")[0] for m in imported_by(module)} & set(FRAMEWORKS)


@pytest.mark.parametrize("module", ["slurm_hai.cli.user", "slurm_hai.cli.submit", "slurm_hai.cli.admin",
                                    "slurm_hai.runtime.client", "slurm_hai.integrations"])
def test_the_cli_and_the_client_import_no_training_framework(module):
    assert not frameworks_loaded_by(module), module


@pytest.mark.parametrize("integration, framework", [("transformers", "transformers.trainer"),
                                                    ("lightning", "lightning.pytorch")])
def test_each_integration_imports_only_its_own_framework(integration, framework):
    # (lightning.pytorch itself imports transformers when it is installed)
    assert frameworks_loaded_by(f"slurm_hai.integrations.{integration}") == frameworks_loaded_by(framework)


def test_the_persist_agent_loads_no_torch():
    """The agent starts a child per request: it must start in a fraction of a second."""
    loaded = imported_by("slurm_hai.checkpoint.agent")
    assert "torch" not in loaded and "slurm_hai.checkpoint.manager" not in loaded


def test_the_lighthouse_service_loads_no_torch():
    """It hosts no training: importing the torchft package would import torch (200 MiB) into
    the service; its lighthouses load torchft's extension alone (test_lighthouse_service.py)."""
    loaded = imported_by("slurm_hai.controller.lighthouse")
    assert "torch" not in loaded and "torchft" not in loaded
