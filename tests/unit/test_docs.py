"""The docs name only what exists (issue 54): every `hai`, `hai-submit` and `hai-admin`
command and option they show, every repository file they point at; and the command
reference is what the commands print (slurm_hai/cli/reference.py writes it)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import click
import pytest

from slurm_hai.cli.reference import commands

REPO = Path(__file__).resolve().parents[2]
# The manual: what a user or an admin reads. The dated record of runs (results-archive.md)
# and the CHANGELOG are history: they may name what has since gone.
MANUAL = sorted({REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "contrib").glob("*/README.md"),
                 REPO / "spank" / "README.md"} - {REPO / "docs" / "results-archive.md"})
# The pages a user or an admin of an installation reads: the README and docs/ (the contrib/
# READMEs are the source tree's, for its developers, and may name its CI host's layout).
PAGES = sorted({REPO / "README.md", *(REPO / "docs").glob("*.md")} - {REPO / "docs" / "results-archive.md"})
PROGRAMS = ("hai-submit", "hai-admin", "hai")
TREE = {path: (command, ctx) for path, command, ctx in commands()}
# Files the docs name by their repository path.
PATH = re.compile(r"(?<![\w./~-])((?:contrib|docs|tests|slurm_hai|examples|benchmarks|templates|spank|\.ci)/[\w./*-]*[\w*])")


def test_the_command_reference_is_what_the_commands_print():
    # in a fresh interpreter, as `make docs` writes it: other tests change what this one holds
    p = subprocess.run([sys.executable, "-m", "slurm_hai.cli.reference"], capture_output=True, text=True, cwd=REPO,
                       env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, timeout=120)
    assert p.returncode == 0, p.stderr
    assert (REPO / "docs" / "reference.md").read_text() == p.stdout, "run `make docs`"


def code_spans(text: str) -> list[str]:
    """The inline code and the lines of code blocks of a markdown text."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M)
    outside = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M)
    return [line for block in blocks for line in block.splitlines()] + re.findall(r"`([^`\n]+)`", outside)


def invocations(text: str) -> list[list[str]]:
    """Each command line of ours in `text`'s code: from the program's name to the end of the
    line, a pipe, a `;` or a comment."""
    found = []
    for span in code_spans(text):
        span = span.strip().removeprefix("$ ")
        for m in re.finditer(r"(?:^|[\s(\"'])(hai-submit|hai-admin|hai)(?=\s|$)", span):
            rest = re.split(r"\s[|;#]|\s&&|\)|\s>", span[m.start(1):], maxsplit=1)[0]
            try:
                words = shlex.split(rest)
            except ValueError:
                continue
            found.append(words)
    return found


def check(words: list[str]) -> list[str]:
    """What of `words` (one command line) is not a command or an option of ours."""
    path, i = words[0], 1
    while i < len(words) and f"{path} {words[i]}" in TREE:
        path, i = f"{path} {words[i]}", i + 1
    if isinstance(TREE[path][0], click.Group) and i < len(words) and re.fullmatch(r"[a-z][a-z-]+", words[i]) \
            and words[i] not in ("JOB", "DIR"):
        return [f"`{path} {words[i]}`: no such command"]
    command, ctx = TREE[path]
    params = {opt: p for p in command.get_params(ctx) for opt in (*p.opts, *p.secondary_opts)}
    wrong = []
    while i < len(words):
        word = words[i]
        if word == "--" or (path == "hai-submit" and not word.startswith("-")) or word == "...":
            break  # what follows the script is the script's
        if word.startswith("-") and len(word) > 1 and not re.fullmatch(r"-\d+", word):
            name = word.split("=", 1)[0].rstrip(":,.")
            p = params.get(name)
            if p is None:
                wrong.append(f"`{path}`: no option {name}")
            elif "=" not in word and isinstance(p, click.Option) and not p.is_flag and not p.count:
                i += 1  # its value
        i += 1
    return wrong


@pytest.mark.parametrize("doc", MANUAL, ids=lambda p: str(p.relative_to(REPO)))
def test_every_command_and_option_the_manual_shows_exists(doc):
    lines = invocations(doc.read_text())
    wrong = [f"{' '.join(words)}: {w}" for words in lines for w in check(words)]
    assert not wrong, "\n".join(wrong)


def built(path: str) -> bool:
    """Whether `path` is what a build writes (git ignores it): a clean checkout has none."""
    return subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=REPO).returncode == 0


@pytest.mark.parametrize("doc", MANUAL, ids=lambda p: str(p.relative_to(REPO)))
def test_every_repository_file_the_manual_names_exists(doc):
    missing = sorted({p for p in PATH.findall(doc.read_text())
                      if not any(REPO.glob(p.split("::")[0])) and not built(p)})
    assert not missing, f"{doc.name} names files the repository does not have: {missing}"


# A path on one machine: under /work, /root or /home, not part of a longer path or a URL.
HOST_PATH = re.compile(r"(?<![\w.~:/-])/(?:work|root|home)/[^\s`)'\"]*")
UP = re.compile(r"(?<![\w.~/-])(?:\.\./)+[^\s`)'\"]*")


def outside(doc: Path, text: str) -> list[str]:
    """The paths in `text` (of `doc`) that are not the repository's: a path under /work, /root
    or /home of some machine, and a `../` path that, read from the page's directory as a link
    is, leads out of the repository."""
    found = [p.rstrip(".,;:") for p in HOST_PATH.findall(text) + UP.findall(text)]
    return [p for p in found if p.startswith("/") or not (doc.parent / p).resolve().is_relative_to(REPO)]


@pytest.mark.parametrize("doc", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_the_manual_names_no_path_outside_the_repository(doc):
    found = outside(doc, doc.read_text())
    assert not found, f"{doc.name} names paths a reader's machine does not have: {found}"


def documentation_list(readme: str) -> set[str]:
    """The pages README.md's "Documentation" section names."""
    section = readme.split("\n## Documentation\n", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"docs/[\w.-]+\.md", section))


def test_the_readme_lists_every_page_of_the_docs():
    listed = documentation_list((REPO / "README.md").read_text())
    pages = {f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")}
    assert not pages - listed, f"README.md's Documentation does not name {sorted(pages - listed)}"
    assert not listed - pages, f"README.md's Documentation names pages docs/ lacks: {sorted(listed - pages)}"


def test_the_checks_catch_what_they_look_for():
    manual = [d.read_text() for d in MANUAL]  # they read the docs, not nothing
    assert sum(map(len, map(invocations, manual))) >= 300 and sum(len(PATH.findall(t)) for t in manual) >= 200
    assert check(["hai-submit", "--nodes", "2", "--no-such", "train.py", "--not-ours"]) == [
        "`hai-submit`: no option --no-such"]
    assert check(["hai", "stauts", "6"]) == ["`hai stauts`: no such command"]
    assert check(["hai-admin", "plan", "--policy", "p.toml", "--adopt", "x"]) == ["`hai-admin plan`: no option --adopt"]
    assert invocations("run `hai logs -f 6 | head` and\n```sh\n$ hai-admin units --out DIR  # writes\n```\n") == [
        ["hai-admin", "units", "--out", "DIR"], ["hai", "logs", "-f", "6"]]
    assert PATH.findall("see docs/policy.md, `tests/unit/test_docs.py::test_x`, tests/unit/test_c*.py and "
                        "contrib/slurm-docker/.") == [
        "docs/policy.md", "tests/unit/test_docs.py", "tests/unit/test_c*.py", "contrib/slurm-docker"]
    assert built("spank/hai_spank.so") and not built("spank/hai_spank.c") and not built("docs/no-such.md")
    page = REPO / "docs" / "page.md"
    assert outside(page, "`--before /work/bench-before`, /root/x and (/home/alice/y), not /homes/z, "
                         "https://example.org/work/a, .venv/work/b or /var/lib/work/c") == [
        "/work/bench-before", "/root/x", "/home/alice/y"]
    assert outside(page, "[ex](../examples/minimal.py), `../batch-<id>.log`, ../../shared/v.tar, "
                         "contrib/../x") == ["../../shared/v.tar"]
    assert outside(REPO / "README.md", "`up --slurm-source ../shared/vendor/s.tar.gz`") == ["../shared/vendor/s.tar.gz"]
    assert documentation_list("# x\n## Documentation\n\n- `docs/a.md`: a.\n- docs/b.md and docs/c.md\n"
                              "## Next\n- `docs/d.md`\n") == {"docs/a.md", "docs/b.md", "docs/c.md"}
