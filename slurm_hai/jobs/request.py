"""What `hai-submit` asks Slurm for: a validated request rendered into an sbatch script.

Every user value is checked here, before it reaches a template: `validate` (pure) checks
the values, `check_files` the script and working directory on disk, as the job's user.
Values that go into `#SBATCH` lines must be free of whitespace and quotes (sbatch reads
those lines itself, not through a shell); values that reach the shell are quoted.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Collection, Iterable, Sequence

from ..policy.levels import AUTO
from ..policy.limits import NOTICE_MARGIN
from ..policy.model import Policy
from ..policy.placement import REFUSALS, Refused, closest, grace_of, group_of, request_level
from ..policy.sizes import NodeRange
from ..policy.tags import DIR as DIR_TAG, GRACE as GRACE_TAG, NODES as NODES_TAG, PARTS as PARTS_TAG

# Each is matched whole (fullmatch: a trailing newline is not "the end"), in ASCII.
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
ENV_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Slurm's --time: MINUTES, MINUTES:SECONDS, HOURS:MINUTES:SECONDS, DAYS-HOURS,
# DAYS-HOURS:MINUTES, DAYS-HOURS:MINUTES:SECONDS, or UNLIMITED/INFINITE.
TIME_RE = re.compile(r"(?:([0-9]+)-)?([0-9]+)(?::([0-9]{1,2}))?(?::([0-9]{1,2}))?|UNLIMITED|INFINITE", re.I)
GROUP_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
RESERVED_ENV = {"SLURM_", "HAI_JOB_DIR", "HAI_SUSPEND_FLAG", "HAI_CONTRACT", "HAI_SUBMIT_TOKEN"}


class RequestError(ValueError):
    """A bad hai-submit value; the message says what to do."""


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """'did you mean GPU? ' for a near miss of one of `choices` (placement.closest), else ''."""
    found = closest(word, choices)
    return f"did you mean {found}? " if found else ""


@dataclass
class JobRequest:
    script: str
    args: list[str] = field(default_factory=list)
    name: str | None = None
    nodes: int | str = 1  # N, or MIN:MAX[:STEP] / MIN-MAX for an elastic job (policy/sizes.py)
    priority: str | None = None  # a level name or number, or AUTO; None: the policy's default level
    gpus_per_node: int = 0
    group: str | None = None
    env: list[str] = field(default_factory=list)  # KEY=VALUE
    time: str | None = None
    grace: int | None = None  # None: the policy's grace_seconds
    retries: int = 0
    workdir: str = "."
    python: str = sys.executable
    job_root: str = ""
    torchrun: bool = False  # run SCRIPT under torchrun, once per node (runtime/torchrun.py)
    in_place: bool = False  # an elastic job in place: a job array of one-node parts (runtime/part_task.py)


def requested_nodes(req: JobRequest) -> NodeRange:
    try:
        return NodeRange.parse(req.nodes, "-n/--nodes")
    except ValueError as e:
        raise RequestError(str(e)) from None


def _safe_path(value: str, what: str) -> str:
    if not value or any(c.isspace() for c in value) or any(c in value for c in "'\"\\`$;&|<>%"):
        raise RequestError(f"{what} {value!r} must be a path without spaces, quotes or shell characters")
    return value


def validate(req: JobRequest, policy: Policy) -> dict:
    """Check every field; return the template context. Raises RequestError. The level, its
    node group and the grace are the cluster's `policy`'s decisions (policy/placement.py,
    which job_submit.lua makes again in the same words); the quota needs the job's account,
    which Slurm knows: job_submit.lua refuses a job over it."""
    name = req.name or Path(req.script).stem or "hai-job"
    if not NAME_RE.fullmatch(name):
        fix = "choose another --name" if req.name else "name it with --name"
        raise RequestError(f"job name {name!r} may only use letters, digits, '.', '_' and '-' (at most 64); {fix}")
    nodes = requested_nodes(req)
    if not 0 <= req.gpus_per_node <= 64:
        raise RequestError(f"--gpus-per-node must be between 0 and 64, got {req.gpus_per_node}")
    check_group_name(req.group)
    try:
        level = request_level(policy, req.priority)
        grace = grace_of(policy, req.grace)
    except Refused as e:
        raise RequestError(str(e)) from None
    # AUTO goes to Slurm as the QOS "auto": job_submit.lua places the job, and the policy
    # daemon moves it to the highest level where its owner has quota, every cycle.
    qos, level_name = ("auto", AUTO) if isinstance(level, str) else (level.qos, level.name)  # str: AUTO
    group = group_of(policy, req.group or "")
    if not isinstance(level, str) and group is not None and not group.accepts(level.name):
        raise RequestError(REFUSALS["group_levels"] % (group.name, ", ".join(group.levels)))
    if req.time is not None:
        time_minutes(req.time, "--time")
    if not 0 <= req.retries <= 100:
        raise RequestError(f"--retries must be between 0 and 100, got {req.retries}")
    env = []
    for item in req.env:
        key, sep, value = item.partition("=")
        if not sep or not ENV_KEY_RE.fullmatch(key):
            raise RequestError(f"-e {item!r}: expected KEY=VALUE with KEY a shell variable name")
        if key.startswith("SLURM_") or key in RESERVED_ENV:
            raise RequestError(f"-e {key}: this variable is set by Slurm or slurm-hai; choose another name")
        env.append((key, value))
    workdir = str(Path(req.workdir).resolve())
    _safe_path(workdir, "--workdir")
    _safe_path(req.job_root, "job directory root (HAI_HOME)")
    script = Path(req.script)
    if req.torchrun and script.suffix != ".py":
        raise RequestError(f"--torchrun runs a Python script (SCRIPT.py), not {req.script}; "
                           "drop --torchrun to run a program once per node")
    in_place = _in_place(req, nodes, policy) if req.in_place else None
    if req.torchrun:  # torchrun per node, one process per GPU (1 on CPU nodes), SCRIPT under --python
        command = [sys.executable, "-m", "slurm_hai.runtime.torchrun", f"--nproc-per-node={req.gpus_per_node or 1}",
                   f"--python={req.python}", "--", str(script.resolve()), *req.args]
    elif script.suffix == ".py":
        command = [req.python, str(script.resolve()), *req.args]
    else:
        command = [str(script.resolve()) if script.exists() else req.script, *req.args]
    return {
        "name": name, "nodes": nodes.min, "node_range": str(nodes), "slurm_nodes": nodes.slurm(),
        "nodes_tag": f";{NODES_TAG}={nodes.tag()}" if nodes.elastic and not in_place else "",
        "in_place": in_place, "parts": in_place["parts"] if in_place else None,
        "gpus": req.gpus_per_node, "qos": qos, "level": level_name,
        "partition": req.group, "time": req.time, "grace": grace, "retries": req.retries,
        "notice_signal": policy.notice_signal, "notice_seconds": grace + NOTICE_MARGIN, "dir_tag": DIR_TAG, "grace_tag": GRACE_TAG,
        "workdir": workdir, "job_root": req.job_root,
        "env": env, "python": sys.executable, "command": command,
    }


def _in_place(req: JobRequest, nodes: NodeRange, policy: Policy) -> dict:
    """What an elastic job in place adds to the template's context: the array of MAX parts,
    the range as a tag, the site's lighthouse service. RequestError for what it cannot be."""
    if not policy.lighthouse_service:
        raise RequestError("--in-place: this cluster runs no lighthouse service (the policy's [elastic] "
                           "lighthouse_service); submit without --in-place")
    if not nodes.elastic or nodes.step != 1:
        raise RequestError(f"--in-place needs a node range MIN:MAX (one part per node), got -n {req.nodes}")
    if req.torchrun or Path(req.script).suffix != ".py":
        raise RequestError("--in-place runs a Python script of parts (slurm_hai.runtime.parts), one process per "
                           "node, without --torchrun")
    return {"parts": nodes.max, "min": nodes.min, "tag": f";{PARTS_TAG}={nodes.min}:{nodes.max}",
            "lighthouse_service": policy.lighthouse_service}


def check_group_name(group: str | None) -> None:
    if group is not None and not GROUP_RE.fullmatch(group):
        raise RequestError(f"--group {group!r} is not a valid node group (partition) name")


def time_minutes(text: str, what: str) -> int | None:
    """A Slurm time limit in whole minutes, as Slurm reads it (seconds round up); None for
    no limit (UNLIMITED, INFINITE, 0). RequestError naming `what` if it is not a time."""
    m = TIME_RE.fullmatch(text)
    if not m:
        raise RequestError(f"{what} {text!r} is not a Slurm time (MINUTES, HH:MM:SS, D-HH:MM:SS)")
    if not m.group(2):
        return None
    days, first, second, third = (int(g) if g else 0 for g in m.groups())
    if m.group(1) is not None:  # DAYS-HOURS[:MINUTES[:SECONDS]]
        seconds = ((days * 24 + first) * 60 + second) * 60 + third
    elif m.group(4) is not None:  # HOURS:MINUTES:SECONDS
        seconds = (first * 60 + second) * 60 + third
    else:  # MINUTES[:SECONDS]
        seconds = first * 60 + second
    return -(-seconds // 60) or None


def fit_to_partition(group: str, partition: dict[str, str], want_nodes: NodeRange, time: str | None) -> None:
    """RequestError for a request the group's (partition's) own limits never let start, in
    our words: Slurm would take it and keep it waiting for ever (PartitionNodeLimit,
    PartitionTimeLimit). `partition`: `scontrol show partition -o` KEY=VALUE."""
    most, least = partition.get("MaxNodes", ""), partition.get("MinNodes", "")
    if most.isdigit() and want_nodes.max > int(most):
        raise RequestError(f"node group {group} takes jobs of at most {most} node(s); ask for at most -n {most}")
    if least.isdigit() and want_nodes.min < int(least):
        raise RequestError(f"node group {group} takes jobs of at least {least} node(s); ask for -n {least} or more")
    limit = partition.get("MaxTime", "UNLIMITED")
    try:
        limit_minutes = time_minutes(limit, "MaxTime")
    except RequestError:  # a MaxTime we cannot read: Slurm decides
        return
    if time is not None and limit_minutes is not None:
        wanted = time_minutes(time, "--time")
        if wanted is None or wanted > limit_minutes:
            raise RequestError(f"--time {time}: node group {group} runs a job at most {limit} at a time; ask for "
                               "that or less (near the limit the job gets the suspend notice and continues in a "
                               "new run)")


def fit_to_group(group: str, node_gpus: Collection[int], want_nodes: NodeRange, gpus_per_node: int | None) -> int:
    """The --gpus-per-node to ask for on `group`, whose nodes have `node_gpus` GPUs each
    (default: what every node of it has, 0 without GPUs); RequestError for a request the
    group's nodes can never satisfy."""
    members = sorted(node_gpus)
    if not members:
        raise RequestError(f"node group {group} has no nodes")
    if want_nodes.max > len(members):
        raise RequestError(f"node group {group} has {len(members)} node(s); ask for at most -n {len(members)}")
    if gpus_per_node is None:
        return members[0]
    fitting = sum(1 for g in members if g >= gpus_per_node)
    if fitting < want_nodes.max:
        most = members[-1]
        raise RequestError(
            f"--gpus-per-node {gpus_per_node}: " + (f"the nodes of group {group} have no GPUs; use 0" if most == 0 else
                                                    f"{fitting} node(s) of group {group} have that many GPUs "
                                                    f"(at most {most} per node); ask for fewer"))
    return gpus_per_node


# What a script that runs on several nodes uses to tell them apart (importing slurm_hai is
# not one: every resumable script does, for its notice and checkpoints).
MULTI_PROCESS_SIGNS = ("spawn", "torch.distributed", "RANK", "get_rank", "world_size", "init_process_group")
PARTS_SIGNS = ("slurm_hai.runtime.parts", "slurm_hai.runtime import parts")


def single_process_warning(req: JobRequest) -> str:
    """A warning when a Python script that looks single-process (no spawn, no
    torch.distributed, no RANK) is asked to run on several nodes: it would run once per
    node, every copy writing the same checkpoint directory. '' when nothing to say."""
    nodes = requested_nodes(req)
    if nodes.max <= 1 or req.torchrun or req.in_place or Path(req.script).suffix != ".py" \
            or _shows_a_sign(req.script, MULTI_PROCESS_SIGNS):
        return ""
    return (f"warning: {req.script} looks single-process (no spawn, torch.distributed or RANK), but runs once on "
            f"each of {nodes} nodes, every copy writing the same checkpoints; use -n 1, or see "
            "examples/train.py for several nodes")


def parts_warning(req: JobRequest) -> str:
    """A warning when the script of an elastic job in place does not use the parts' API: each
    of its MAX parts would run it whole (a wrapper that runs one that does is fine: a warning,
    not a refusal). '' when nothing to say."""
    if not req.in_place or _shows_a_sign(req.script, PARTS_SIGNS):
        return ""
    return (f"warning: {req.script} does not use slurm_hai.runtime.parts (join, leave_on): with --in-place each "
            f"of its {requested_nodes(req).max} parts runs it whole; see examples/parts_train.py")


def _shows_a_sign(script: str, signs: Sequence[str]) -> bool:
    """Whether the script's text has one of `signs`; True when it cannot be read (nothing to
    warn about: check_files says why)."""
    try:
        text = Path(script).read_text(errors="replace")
    except OSError:
        return True
    return any(sign in text for sign in signs)


def check_files(req: JobRequest) -> None:
    """Refuse, before anything is submitted, a script or working directory the job could only
    fail on once scheduled. Runs as the submitting user, who is the job's user, so
    os.access answers for the job. Raises RequestError naming what to fix."""
    workdir = Path(req.workdir).expanduser()
    if not workdir.exists():
        raise RequestError(f"--workdir {req.workdir}: no such directory; create it or pass an existing one")
    if not workdir.is_dir():
        raise RequestError(f"--workdir {req.workdir} is not a directory")
    if not os.access(workdir, os.X_OK):
        raise RequestError(f"--workdir {req.workdir}: you cannot enter it (no search permission); "
                           f"chmod u+x it or choose another")
    script = Path(req.script).expanduser()
    shown = req.script
    if not script.exists():
        raise RequestError(f"script {shown}: no such file (looked in {Path.cwd()})")
    if script.is_dir():
        raise RequestError(f"script {shown} is a directory; give the script to run, e.g. {shown.rstrip('/')}/train.py")
    if not script.is_file():
        raise RequestError(f"script {shown} is not a regular file")
    if not os.access(script, os.R_OK):
        raise RequestError(f"script {shown}: you cannot read it; chmod u+r {shlex.quote(shown)}")
    if script.suffix == ".py":
        python = req.python
        if not (os.path.isabs(python) and os.access(python, os.X_OK)) and shutil.which(python) is None:
            raise RequestError(f"--python {python}: no such interpreter")
        return
    with open(script, "rb") as f:
        head = f.read(4)
    if head[:2] != b"#!" and head != b"\x7fELF":
        raise RequestError(f"script {shown} is neither a Python file (.py) nor a program (no #! line); "
                           "give the training script, or add a #! line (e.g. #!/bin/bash)")
    if not os.access(script, os.X_OK):
        raise RequestError(f"script {shown} is not executable; chmod u+x {shlex.quote(shown)}")
    missing = missing_interpreter(script)
    if missing:
        raise RequestError(f"script {shown}: {missing}; fix its first line")


def missing_interpreter(program: str | Path) -> str:
    """What is wrong with the `#!` line of `program` (which exists) on this host: its
    interpreter does not exist, or `#!/usr/bin/env NAME` finds no NAME on PATH; '' when
    nothing is (or it has no #! line)."""
    try:
        with open(program, "rb") as f:
            first = f.readline(256)
    except OSError:
        return ""
    if not first.startswith(b"#!"):
        return ""
    words = first[2:].decode(errors="replace").split()
    if not words:
        return "its #! line names no interpreter"
    interpreter = words[0]
    if not os.access(interpreter, os.X_OK):
        return f"its #! interpreter {interpreter} does not exist here"
    if Path(interpreter).name == "env" and len(words) > 1 and not words[1].startswith("-") and shutil.which(words[1]) is None:
        return f"its #! line runs `env {words[1]}`, and there is no {words[1]} on PATH here"
    return ""


# the job scripts hai-submit renders: a job's, an elastic job in place's
JOB_TEMPLATE, PARTS_TEMPLATE = "job/sbatch.sh.j2", "job/parts.sh.j2"


def render_script(context: dict, term_is_notice: bool) -> str:
    from ..render import render  # lazy: jinja2, +20 ms

    template = PARTS_TEMPLATE if context["in_place"] else JOB_TEMPLATE
    return render(template, term_is_notice=term_is_notice, **context)
