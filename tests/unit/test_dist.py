"""The release stands alone: `make dist`'s wheel and sdist hold what a site needs, and the
wheel, installed in a fresh venv and run from outside the checkout, checks and renders a
policy, dry-runs a submission, builds the SPANK plugin against this host's Slurm headers
(libslurm-dev) and says where the systemd units, the dashboard and the slurm-docker
contrib are.

The archives are built as `make dist` builds them (python -m build --no-isolation: the sdist,
then the wheel from the sdist); the venv gets the wheel alone (--no-deps) and sees its
dependencies (click, jinja2, markupsafe, filelock) through a .pth naming a directory of
links to this environment's copies, so that nothing of the checkout is importable there.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VERSION = re.search(r'^__version__ = "([^"]+)"', (REPO / "slurm_hai" / "__init__.py").read_text(), re.M).group(1)
# the wheel's dependencies (and jinja2's), as importable names
DEPENDENCIES = ("click", "jinja2", "markupsafe", "filelock") + (("tomli",) if sys.version_info < (3, 11) else ())
BUILD_OUTPUTS = (".so", ".o", ".flags")  # never shipped (gitignored; spank/Makefile's .flags)

# Where each shipped directory of the wheel comes from in the repository.
SHIPPED = {"slurm_hai/templates": "templates", "slurm_hai/share/spank": "spank",
           "slurm_hai/share/docs": "docs", "slurm_hai/share/grafana": "contrib/grafana",
           "slurm_hai/share/slurm-docker": "contrib/slurm-docker"}


def repo_files(rel: str) -> set[str]:
    """The files under REPO/rel, as paths relative to it (build outputs and caches left out)."""
    root = REPO / rel
    return {p.relative_to(root).as_posix() for p in root.rglob("*")
            if p.is_file() and not p.name.endswith(BUILD_OUTPUTS) and "__pycache__" not in p.parts}


def run(argv: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, text=True, capture_output=True, timeout=120, **kw)


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> tuple[Path, Path]:
    """(wheel, sdist), built as `make dist` builds them."""
    out = tmp_path_factory.mktemp("dist")
    p = run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(REPO)])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (wheel,) = out.glob("*.whl")
    (sdist,) = out.glob("*.tar.gz")
    return wheel, sdist


@pytest.fixture(scope="module")
def site(dist, tmp_path_factory) -> dict:
    """The wheel installed in a fresh venv; a place outside the checkout to run it from, with
    fake Slurm commands on PATH (they fail as an unreachable slurmctld does) and no SLURM_CONF."""
    wheel, _ = dist
    tmp = tmp_path_factory.mktemp("site")
    venv = tmp / "venv"
    p = run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    assert p.returncode == 0, p.stderr
    p = run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
             "--no-deps", "--no-index", str(wheel)])
    assert p.returncode == 0, p.stdout + p.stderr
    deps = tmp / "deps"
    deps.mkdir()
    for name in DEPENDENCIES:
        (deps / name).symlink_to(Path(__import__(name).__file__).parent)
    (site_packages,) = (venv / "lib").glob("python3*/site-packages")
    (site_packages / "deps.pth").write_text(f"{deps}\n")
    fake = tmp / "fake-slurm"
    fake.mkdir()
    for cmd in ("scontrol", "sinfo", "squeue", "sbatch", "sacct", "sacctmgr"):
        (fake / cmd).write_text("#!/bin/sh\necho 'Unable to contact slurm controller (connect failure)' >&2\nexit 1\n")
        (fake / cmd).chmod(0o755)
    work = tmp / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "SLURM_CONF", "HAI_POLICY", "CC")
           and not k.startswith(("HAI_", "SLURM_"))}
    env.update(PATH=f"{venv / 'bin'}:{fake}:/usr/local/bin:/usr/bin:/bin", HAI_HOME=str(tmp / "hai-home"))
    return {"venv": venv, "site_packages": site_packages, "work": work, "env": env}


def installed(site: dict, tool: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run one of the wheel's commands from the work directory (outside the checkout)."""
    return run([str(site["venv"] / "bin" / tool), *args], cwd=site["work"], env={**site["env"], **(env or {})})


def test_the_version_is_one_number(dist, site):
    wheel, sdist = dist
    assert wheel.name == f"slurm_hai-{VERSION}-py3-none-any.whl" and sdist.name == f"slurm_hai-{VERSION}.tar.gz"
    p = installed(site, "hai-admin", "--version")
    assert p.returncode == 0 and p.stdout.strip() == f"hai-admin, version {VERSION}", p.stdout + p.stderr
    changelog = (REPO / "CHANGELOG.md").read_text()
    assert re.search(rf"^## {re.escape(VERSION)}\b", changelog, re.M), "CHANGELOG.md has no entry for " + VERSION


def test_the_wheel_holds_the_templates_and_the_admins_files(dist):
    wheel, _ = dist
    names = set(zipfile.ZipFile(wheel).namelist())
    for shipped, source in SHIPPED.items():
        have = {n[len(shipped) + 1:] for n in names if n.startswith(shipped + "/")}
        assert have == repo_files(source), f"{shipped} in the wheel is not {source}/ of the repository"
    assert {"hai_spank.c", "Makefile"} <= repo_files("spank")
    assert {f"systemd/{u}.service.j2" for u in ("hai-policyd", "slurm-hai-persist", "hai-lighthouse")} <= repo_files(
        "templates")
    assert {"admin-guide.md", "policy.md", "policy.example.toml"} <= repo_files("docs")
    assert "slurm-hai.json" in repo_files("contrib/grafana")
    assert not [n for n in names if n.endswith(BUILD_OUTPUTS)]


def test_the_sdist_is_the_repository_once(dist):
    _, sdist = dist
    top = f"slurm_hai-{VERSION}/"
    names = {n[len(top):] for n in tarfile.open(sdist).getnames() if n.startswith(top)}
    for source in {*SHIPPED.values(), "contrib/localcluster", "docs", "examples"}:
        assert {f"{source}/{f}" for f in repo_files(source)} <= names, f"{source}/ is incomplete in the sdist"
    assert {"CHANGELOG.md", "README.md", "Makefile", "pyproject.toml"} <= names
    # the links of the checkout are not copied a second time; no build outputs
    assert not [n for n in names if n.startswith(("slurm_hai/templates/", "slurm_hai/share/"))]
    assert not [n for n in names if n.endswith(BUILD_OUTPUTS) or "/.hypothesis/" in f"/{n}"]


def test_the_installed_package_is_the_wheels(site):
    p = run([str(site["venv"] / "bin" / "python"), "-c",
             "import slurm_hai, click, slurm_hai.cli.admin; print(slurm_hai.__file__); print(click.__file__)"],
            cwd=site["work"], env=site["env"])
    assert p.returncode == 0, p.stderr
    ours, click_file = p.stdout.split()
    assert Path(ours).is_relative_to(site["site_packages"]) and not Path(ours).is_relative_to(REPO)
    assert not Path(click_file).resolve().is_relative_to(REPO / "slurm_hai")


def test_files_says_where_the_shipped_files_are(site):
    p = installed(site, "hai-admin", "files")
    assert p.returncode == 0, p.stderr
    for name in ("spank", "docs", "grafana", "slurm-docker", "templates"):
        q = installed(site, "hai-admin", "files", name)
        assert q.returncode == 0, q.stderr
        where = Path(q.stdout.strip())
        assert str(where) in p.stdout and where.is_relative_to(site["site_packages"]) and where.is_dir()
    docs = Path(installed(site, "hai-admin", "files", "docs").stdout.strip())
    example = installed(site, "hai-admin", "check", "--policy", str(docs / "policy.example.toml"))
    assert example.returncode == 0 and "valid" in example.stdout, example.stdout + example.stderr


def test_units_run_this_installations_hai_admin_and_name_its_docs(site):
    out = site["work"] / "units"
    p = installed(site, "hai-admin", "units", "--out", str(out))
    assert p.returncode == 0 and p.stdout.count("wrote ") == 3, p.stdout + p.stderr
    venv_admin = site["venv"] / "bin" / "hai-admin"
    for unit in ("hai-policyd.service", "slurm-hai-persist.service", "hai-lighthouse.service"):
        text = (out / unit).read_text()
        starts = [line.split("=", 1)[1].split()[0] for line in text.splitlines() if line.startswith("ExecStart")]
        assert starts and set(starts) == {str(venv_admin)}, (unit, starts)
        (doc,) = [line.split("file://", 1)[1] for line in text.splitlines() if line.startswith("Documentation=")]
        assert Path(doc).is_file() and Path(doc).is_relative_to(site["site_packages"]), doc
        assert "{{" not in text and "contrib/systemd" not in text
    grafana = Path(installed(site, "hai-admin", "files", "grafana").stdout.strip())
    assert json.loads((grafana / "slurm-hai.json").read_text())["panels"]


def test_check_render_and_a_dry_run_from_the_wheel(site):
    docker = Path(installed(site, "hai-admin", "files", "slurm-docker").stdout.strip())
    policy = docker / "policy.toml"  # the policy shipped with the slurm-docker contrib
    p = installed(site, "hai-admin", "check", "--policy", str(policy))
    assert p.returncode == 0 and f"{policy}: valid" in p.stdout, p.stdout + p.stderr

    out = site["work"] / "rendered"
    so = "/opt/site/lib/slurm/hai_spank.so"
    p = installed(site, "hai-admin", "render", "--policy", str(policy), "--out", str(out), "--spank-plugin", so)
    assert p.returncode == 0, p.stdout + p.stderr
    assert sorted(f.name for f in out.iterdir()) == sorted(f.name for f in (docker / "rendered").iterdir())
    assert so in (out / "plugstack.conf").read_text() and "EXTREME_HIGH" in (out / "job_submit.lua").read_text()

    script = site["work"] / "train.py"
    script.write_text("print('hello')\n")
    p = installed(site, "hai-submit", "--dry-run", "--json", "-n", "1", "-p", "HIGH", str(script),
                  env={"HAI_POLICY": str(policy)})
    assert p.returncode == 0, p.stdout + p.stderr
    job = json.loads(p.stdout)
    assert job["dry_run"] is True and job["level"] == "HIGH" and "#SBATCH --nodes=1" in job["script"]
    assert str(site["venv"] / "bin" / "python") in job["script"]  # the job runs the installed package


def test_spank_build_and_install_compile_the_shipped_plugin(site):
    out = site["work"] / "spank-build"
    p = installed(site, "hai-admin", "spank", "build", "--out", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    so = out / "hai_spank.so"
    assert re.fullmatch(rf"built {re.escape(str(so))} for Slurm \d+\.\d\d\.\d+\n", p.stdout)
    data = so.read_bytes()
    assert data[:4] == b"\x7fELF" and b"slurm_spank_init" in data and so.stat().st_mode & 0o111
    assert not list(out.glob(".*"))  # no temporary file left

    plugin_dir = site["work"] / "plugins"
    p = installed(site, "hai-admin", "spank", "install", "--plugin-dir", str(plugin_dir))
    assert p.returncode == 0, p.stdout + p.stderr
    assert (plugin_dir / "hai_spank.so").read_bytes()[:4] == b"\x7fELF"
    assert f"--spank-plugin {plugin_dir / 'hai_spank.so'}" in p.stdout  # not the default place: says so


def test_spank_build_says_what_to_install_in_one_line(site):
    empty = site["work"] / "no-headers"
    empty.mkdir()
    p = installed(site, "hai-admin", "spank", "build", "--slurm-include", str(empty), "--out", str(empty))
    assert p.returncode == 1 and len(p.stderr.splitlines()) == 1, p.stderr
    assert "slurm/spank.h" in p.stderr and "libslurm-dev" in p.stderr and "slurm-devel" in p.stderr
    p = installed(site, "hai-admin", "spank", "build", "--out", str(empty), env={"CC": "no-such-cc"})
    assert p.returncode == 1 and len(p.stderr.splitlines()) == 1 and "install gcc" in p.stderr, p.stderr
    assert not list(empty.iterdir())


def test_spank_build_compiles_as_the_makefile_does_less_werror():
    from slurm_hai.cli.admin import SPANK_CFLAGS

    makefile = (REPO / "spank" / "Makefile").read_text()
    flags = {m.group(1): m.group(2).split() for m in re.finditer(r"^(CFLAGS|WARN)\s*[?:]?=\s*(.*)$", makefile, re.M)}
    assert set(SPANK_CFLAGS) == {*flags["CFLAGS"], *flags["WARN"], "-fPIC", "-shared"} - {"-Werror"}
    assert "-fPIC -shared" in makefile
