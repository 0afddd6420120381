"""hai-admin: put the HAI time-sharing policy on a Slurm cluster and keep it there."""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import signal
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import click

from ..policy.levels import Level, variant_qos
from ..policy.model import Policy, load_policy, policy_path
from ..slurm import SlurmError, backend
from ..slurm.records import ENDED_STATES
from .common import Group, current_user, emit_json, one_line_errors, timeline_options

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
DEFAULT_SPANK_SO = "/usr/lib/x86_64-linux-gnu/slurm-wlm/hai_spank.so"


def _policy_option(fn: Callable) -> Callable:
    return click.option(
        "--policy", "-p", "policy_file", metavar="FILE", envvar="HAI_POLICY", show_envvar=True,
        help="The policy file (TOML, see docs/policy.md). Default: policy.toml beside $SLURM_CONF, "
             "else /etc/slurm-hai/policy.toml.")(fn)


def _load(policy_file: str | None) -> tuple[Policy, Path]:
    path = Path(policy_file) if policy_file else policy_path()
    if path is None:
        raise click.UsageError("no policy file: pass --policy FILE (or set HAI_POLICY); to start one, copy "
                               "the example this installation ships: "
                               "cp \"$(hai-admin files docs)/policy.example.toml\" policy.toml")
    return load_policy(path), path


@click.group(cls=Group, context_settings=CONTEXT)
@click.version_option(package_name="slurm-hai", prog_name="hai-admin")
def main() -> None:
    """Put the HAI time-sharing policy on a Slurm cluster and keep it there.

    \b
    The policy is one TOML file (docs/policy.md): priority levels, per-user node quotas
    per level (with per-user and per-account overrides), grace time, demotion, node groups.
    Slurm enforces most of it through one QOS per level; the policy daemon does the rest.

    \b
    Typical use, on the slurmctld host, as root (or the SlurmUser):
      hai-admin check  --policy /etc/slurm-hai/policy.toml
      hai-admin render --policy /etc/slurm-hai/policy.toml --out /etc/slurm/hai
      hai-admin plan   --policy /etc/slurm-hai/policy.toml
      hai-admin apply  --policy /etc/slurm-hai/policy.toml
      hai-admin daemon --policy /etc/slurm-hai/policy.toml    (or hai-policyd.service: hai-admin units)

    \b
    Exit status: 0 done (plan: nothing to change), 1 error, 2 bad usage,
    3 plan found changes to make, 4 another daemon holds the lock, 141 output cut short
    (`| head`).
    """


@main.command()
@_policy_option
@click.option("--json", "as_json", is_flag=True, help="Print the policy in force as JSON.")
@one_line_errors
def check(policy_file: str | None, as_json: bool) -> None:
    """Validate a policy file and print every value in force, the defaults it leaves out too.

    Every problem is reported with its place, e.g.
    `policy.toml: [quota.users.alice] HIGH: expected a non-negative integer, got 'x'`.
    """
    policy, path = _load(policy_file)
    p = _policy_json(policy)
    if as_json:
        click.echo(json.dumps(p, indent=2))
        return
    click.echo(f"{path}: valid")
    ladder = [lvl["name"] for lvl in p["levels"]]

    def every(levels: list[str]) -> str:
        return "every level" if levels == ladder else ", ".join(levels) if levels else "no level"

    click.echo("  levels, highest first, each with its QOS and the nodes one user may run at once at it:")
    for lvl in p["levels"]:
        quota = "unlimited" if lvl["quota"] is None else f"{lvl['quota']} node(s)"
        click.echo(f"    {lvl['name']:<14} {lvl['value']:>4}  qos {lvl['qos']:<14} quota {quota}"
                   + ("  (default level)" if lvl["name"] == p["default_level"] else ""))
    for kind, table in p["quota_overrides"].items():
        for owner, levels in table.items():
            qos = variant_qos(Level(0, "<LEVEL>"), kind[0], owner)  # the pattern of its levels' QOS names
            quotas = ", ".join(f"{name} {'unlimited' if o['quota'] is None else o['quota']}"
                               for name, o in levels.items())
            click.echo(f"  override for {kind[:-1]} {owner} (QOS {qos}), nodes at once: {quotas}")
    click.echo(f"  default level {p['default_level']}; AUTO {'allowed' if p['allow_auto'] else 'not allowed'}")
    click.echo(f"  grace {p['grace_seconds']} s; a job may ask for up to {p['max_grace_seconds']} s "
               f"(max_grace_seconds); suspend notice SIG{p['notice_signal']}")
    d = p["demotion"]
    click.echo(f"  minimum run {p['min_run_seconds']} s; "
               + (f"demotion {d['from']} -> {d['to']} after {d['after_seconds']} s" if d else "no demotion"))
    click.echo("  a waiting job takes back its place in line from later jobs of other users at "
               + every(p["fcfs_preempt_levels"]))
    grow = p["elastic"]["grow_after_seconds"]
    click.echo(f"  at least {p['min_gpus']} GPU(s) per node; "
               + (f"an elastic job grows into nodes idle {grow} s" if grow is not None else "elastic jobs never grow"))
    click.echo("  elastic jobs in place (hai-submit --in-place): "
               + (f"lighthouse service {p['elastic']['lighthouse_service']}" if p["elastic"]["lighthouse_service"]
                  else "none (no lighthouse_service)"))
    click.echo("  why jobs wait: " + (f"the policy daemon answers at {p['daemon']['service']}" if p["daemon"]["service"]
                                      else "each command reads the whole queue (no [daemon] service)"))
    click.echo("  accounts given the ladder by apply: "
               + (", ".join(p["accounts"]) or "none (only the associations of quota overrides)"))
    for g in p["groups"]:
        click.echo(f"  node group {g['name']}{' (default)' if g['default'] else ''}: nodes {g['nodes']}; "
                   f"PriorityTier {g['priority_tier']}; takes {every(g['levels'])}; "
                   f"at least {g['min_gpus']} GPU(s) per node")


def _policy_json(policy: Policy) -> dict:
    """Every value of `policy` in force, the defaults its file leaves out too: what a level
    or group left open means is spelled out (every level, the policy's min_gpus)."""
    d = policy.demotion

    def overrides(table: dict[str, dict[str, int | None]], kind: str) -> dict:
        return {owner: {name: {"quota": quota, "qos": variant_qos(policy.level(name), kind, owner)}
                        for name, quota in levels.items()} for owner, levels in sorted(table.items())}

    return {
        "source": policy.source,
        "levels": [{"name": lvl.name, "value": lvl.value, "qos": lvl.qos, "quota": policy.quota.get(lvl.name)}
                   for lvl in policy.levels_high_to_low],
        "default_level": policy.default_level,
        "allow_auto": policy.allow_auto,
        "grace_seconds": policy.grace_seconds,
        "max_grace_seconds": policy.grace_limit,
        "min_run_seconds": policy.min_run_seconds,
        "notice_signal": policy.notice_signal,
        "demotion": {"from": d.source, "to": d.target, "after_seconds": d.after_seconds} if d else None,
        "fcfs_preempt_levels": [lvl.name for lvl in policy.levels_high_to_low if policy.fcfs_preempts(lvl.name)],
        "min_gpus": policy.min_gpus,
        "elastic": {"grow": policy.grow_after_seconds is not None, "grow_after_seconds": policy.grow_after_seconds,
                    "lighthouse_service": policy.lighthouse_service},
        "daemon": {"service": policy.daemon_service},
        "accounts": list(policy.accounts),
        "quota_overrides": {"users": overrides(policy.user_quota, "u"),
                            "accounts": overrides(policy.account_quota, "a")},
        "groups": [{"name": g.name, "nodes": g.nodes, "priority_tier": g.priority_tier, "default": g.default,
                    "levels": [lvl.name for lvl in policy.levels_high_to_low if g.accepts(lvl.name)],
                    "min_gpus": policy.min_gpus_for(g.name)} for g in policy.groups],
    }


@main.command()
@_policy_option
@click.option("--out", "-o", "out_dir", metavar="DIR", default=".", show_default=True,
              type=click.Path(file_okay=False), help="Directory to write the files into (created if missing).")
@click.option("--spank-plugin", metavar="PATH", default=DEFAULT_SPANK_SO, show_default=True,
              help="Where hai_spank.so is installed on the cluster (for plugstack.conf).")
@one_line_errors
def render(policy_file: str | None, out_dir: str, spank_plugin: str) -> None:
    """Write the Slurm configuration that carries the policy.

    \b
    Files written into DIR:
      hai-policy.conf   slurm.conf fragment: preemption, priority weights (Include it)
      partitions.conf   the node groups as partitions (Include it, replacing your own)
      qos-ladder.sh     sacctmgr commands that create the QOS ladder on an empty database
      job_submit.lua    level -> QOS mapping, quota refusal, AUTO (JobSubmitPlugins=lua)
      plugstack.conf    the hai_spank.so line (--hai-priority and friends)

    On a running cluster prefer `hai-admin apply` for the QOS part: it compares with
    what Slurm has. slurmctld re-reads job_submit.lua by itself when it changes; the
    slurm.conf fragments need `scontrol reconfigure` (PreemptType: a restart).
    """
    from ..policy.ladder import ClusterState, offline_access_changes, plan_changes, template_context  # lazy: +5 ms to every hai-admin command
    from ..render import render as render_template  # lazy: jinja2, +20 ms to every hai-admin command
    from ..slurm.commands import change_argv  # lazy: +2 ms to every hai-admin command

    policy, _ = _load(policy_file)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ctx = template_context(policy)
    changes = [(c, change_argv(c)) for c in plan_changes(policy, ClusterState())]
    access = [(c, change_argv(c)) for c in offline_access_changes(policy)]
    files = {
        "hai-policy.conf": render_template("slurm/hai-policy.conf.j2", **ctx),
        "partitions.conf": render_template("slurm/partitions.conf.j2", **ctx),
        "qos-ladder.sh": render_template("slurm/qos-ladder.sh.j2", changes=changes, access=access, **ctx),
        "job_submit.lua": render_template("slurm/job_submit.lua.j2", **ctx),
        "plugstack.conf": render_template("slurm/plugstack.conf.j2", spank_so=spank_plugin, **ctx),
    }
    for name, text in files.items():
        path = out / name
        path.write_text(text)
        if name.endswith(".sh"):
            path.chmod(0o755)
        click.echo(f"wrote {path}")


def _plan(policy: Policy, partitions: bool):
    """(changes, the cluster's state they were planned against)."""
    from ..controller.apply import plan_policy  # lazy: +10 ms to every hai-admin command

    return plan_policy(policy, backend(), partitions=partitions)


def _record_option(fn: Callable) -> Callable:
    return click.option("--record", "record_file", metavar="FILE", default=None,
                        help="The install record (default: $HAI_INSTALL_RECORD, else hai-install.json "
                             "beside slurm.conf).")(fn)


def _remove_option(fn: Callable) -> Callable:
    return click.option("--remove", is_flag=True,
                        help="Take slurm-hai out again: undo what the install record says apply made.")(fn)


def _site_warnings(changes, state, record_file: str | None) -> list[str]:
    """What of the site's would defeat slurm-hai or be changed by it, one line each on stderr;
    the site's QOS that `apply` changes only with --adopt."""
    from ..controller.apply import load_record, record_path  # lazy: +10 ms to every hai-admin command
    from ..policy.install import config_warnings, conflict_warning, qos_conflicts  # lazy: +8 ms to every hai-admin command

    record = load_record(Path(record_file) if record_file else record_path())
    conflicts = list(qos_conflicts(changes, state, record))
    for name in conflicts:
        click.echo(conflict_warning(name, state), err=True)
    try:
        config = backend().config()
    except SlurmError as e:  # slurmdbd answers, slurmctld not yet (plan --no-partitions before it starts)
        click.echo(f"note: slurm.conf's preemption settings not checked: {' '.join(str(e).split())}", err=True)
        return conflicts
    for line in config_warnings(config):
        click.echo(line, err=True)
    return conflicts


def _removal(record_file: str | None, apply_it: bool, report=None):
    from ..controller.apply import remove_policy  # lazy: +10 ms to every hai-admin command

    return remove_policy(backend(), Path(record_file) if record_file else None, report=report, dry_run=not apply_it)


QUOTA_DROPPED = re.compile(r"^(\S+): .*MaxTRESPU node=(\d+) -> \(none\)")


def quota_loss_warning(changes) -> str:
    """A warning naming every quota the changes would remove (a quota that becomes
    unlimited, a per-user or per-account override deleted); '' when none is. An empty or
    near-empty policy file means "no quotas", which is rarely what was meant."""
    dropped = [f"{m.group(1)} ({m.group(2)} nodes per user)" for c in changes
               if (m := QUOTA_DROPPED.match(c.why))]
    deleted = [c.where["name"] for c in changes if (c.op, c.entity) == ("delete", "qos") and "name" in c.where]
    if not dropped and not deleted:
        return ""
    parts = ([f"removes the quota of {', '.join(dropped)}"] if dropped else []) + (
        [f"deletes the overrides {', '.join(deleted)}"] if deleted else [])
    return f"warning: this policy {' and '.join(parts)}; is the policy file the one you meant?"


# Each rendered file as installed beside slurm.conf: where it may be (the first found is
# compared; slurm-hai's job_submit.lua called from a site's own is hai_job_submit.lua, and the
# site's job_submit.lua is then not ours to compare), its template, its comment mark.
RENDERED_CHECKED = {("hai_job_submit.lua", "job_submit.lua"): ("slurm/job_submit.lua.j2", "--"),
                    ("hai-policy.conf",): ("slurm/hai-policy.conf.j2", "#")}


def stale_rendered_files(policy: Policy, conf_dir: Path) -> list[str]:
    """The rendered files installed beside slurm.conf (job_submit.lua, hai-policy.conf)
    that differ from what this policy renders, comments aside: they need `render` again."""
    from ..policy.ladder import template_context  # lazy: +5 ms to every hai-admin command
    from ..render import render as render_template  # lazy: jinja2, +20 ms to every hai-admin command

    ctx = template_context(policy)
    stale = []
    for names, (template, comment) in RENDERED_CHECKED.items():
        installed = next((conf_dir / name for name in names if (conf_dir / name).is_file()), None)
        if installed is None:
            continue

        def body(text: str) -> list[str]:
            return [ln.rstrip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith(comment)]

        if body(installed.read_text(errors="replace")) != body(render_template(template, **ctx)):
            stale.append(str(installed))
    return stale


def _command(change) -> str:
    """The command line that makes `change`, as `plan` and `apply` print it."""
    from ..slurm.commands import change_argv  # lazy: +2 ms to every hai-admin command

    return shlex.join(change_argv(change))


def _show(changes, as_json: bool) -> None:
    if as_json:
        from ..slurm.commands import change_argv  # lazy: +2 ms to every hai-admin command

        click.echo(json.dumps([{"argv": change_argv(c), "why": c.why} for c in changes], indent=2))
        return
    for c in changes:
        click.echo(f"{_command(c)}\n    # {c.why}")


@main.command()
@_policy_option
@click.option("--no-partitions", is_flag=True, help="Leave partitions alone (compare QOS and associations only).")
@click.option("--json", "as_json", is_flag=True, help="Print the changes as JSON: [{argv, why}].")
@_remove_option
@_record_option
@one_line_errors
def plan(policy_file: str | None, no_partitions: bool, as_json: bool, remove: bool, record_file: str | None) -> None:
    """Show exactly which sacctmgr/scontrol commands `apply` would run.

    Compares the policy with the live cluster: the QOS ladder (priority, Preempt, grace,
    per-user node quota, DenyOnLimit), the quota-override QOS, which QOS each association
    of the policy's accounts may use and its default QOS, and the partitions (PriorityTier,
    AllowQos, Default, Nodes). Warns, one line each, about what of the site's would defeat
    slurm-hai (PreemptMode, PreemptType, JobRequeue) and about QOS of the site's that apply
    would change only with --adopt. With --remove: the commands that take slurm-hai out.
    Changes nothing. Exit status 0: nothing to change, 3: changes.
    """
    adopt: list[str] = []
    if remove:
        changes = _removal(record_file, apply_it=False)
    else:
        policy, _ = _load(policy_file)
        changes, state = _plan(policy, not no_partitions)
        warning = quota_loss_warning(changes)
        if warning:
            click.echo(warning, err=True)
        adopt = _site_warnings(changes, state, record_file)
        conf_dir = Path(os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")).parent
        for path in stale_rendered_files(policy, conf_dir):
            click.echo(f"note: {path} differs from what this policy renders: run `hai-admin render` and install it "
                       "(slurm.conf fragments then need `scontrol reconfigure`)", err=True)
    if not changes:
        if as_json:
            click.echo("[]")
        else:
            click.echo(_nothing_to_remove(record_file) if remove else "no change: the cluster matches the policy")
        return
    _show(changes, as_json)
    if not as_json:
        how = " --remove" if remove else f" --adopt {','.join(adopt)}" if adopt else ""
        click.echo(f"{len(changes)} change(s); run `hai-admin apply{how}` to make them")
    sys.exit(3)


@main.command()
@_policy_option
@click.option("--no-partitions", is_flag=True, help="Leave partitions alone (QOS and associations only).")
@click.option("--quiet", "-q", is_flag=True, help="Print only a summary line.")
@click.option("--adopt", metavar="QOS[,QOS...]", default="",
              help="QOS of the site's that the ladder needs and may change (remove puts their settings back).")
@_remove_option
@_record_option
@one_line_errors
def apply(policy_file: str | None, no_partitions: bool, quiet: bool, adopt: str, remove: bool,
          record_file: str | None) -> None:
    """Make the changes that `plan` shows; running it again changes nothing.

    Keeps an install record of what it creates and of what of the site's it changes, as it
    was: `apply --remove` undoes exactly that. It never deletes a QOS it did not create,
    and changes a QOS of the site's only when --adopt names it. Partition changes made with
    scontrol last until slurmctld restarts: install the `render` output (partitions.conf)
    to keep them.
    """
    from ..controller.apply import apply_policy  # lazy: +10 ms to every hai-admin command

    made = []

    def report(change) -> None:  # each change once it is made
        made.append(change)
        if not quiet:
            click.echo(f"{_command(change)}    # {change.why}")

    try:
        if remove:
            done = _removal(record_file, apply_it=True, report=report)
            click.echo(f"{len(done)} change(s) applied: slurm-hai is taken out" if done
                       else _nothing_to_remove(record_file))
            return
        policy, path = _load(policy_file)
        warning = quota_loss_warning(_plan(policy, not no_partitions)[0])
        if warning:
            click.echo(warning, err=True)
        done = apply_policy(policy, backend(), partitions=not no_partitions, report=report,
                            record=Path(record_file) if record_file else None,
                            adopt=[q.strip().lower() for q in adopt.split(",") if q.strip()])
    except SlurmError as e:
        if not made:
            raise
        raise click.ClickException(f"{' '.join(str(e).split())}; {len(made)} change(s) were made before it"
                                   f"{'' if quiet else ' (above)'}: `hai-admin plan{' --remove' if remove else ''}` "
                                   "shows what is left") from None
    click.echo(f"{len(done)} change(s) applied from {path}" if done else "no change: the cluster matches the policy")


def _nothing_to_remove(record_file: str | None) -> str:
    """What `plan --remove` and `apply --remove` say when they find nothing to take out: the
    install record names nothing left, or there is no record at all (nothing known)."""
    from ..controller.apply import record_path  # lazy: +10 ms to every hai-admin command

    path = Path(record_file) if record_file else record_path()
    if not path.exists():
        return (f"no change: there is no install record at {path}, so nothing of slurm-hai is known to take out "
                "(--record FILE names another)")
    return "no change: nothing of slurm-hai is left to take out"


@main.command()
@_policy_option
@click.option("--once", is_flag=True, help="Run one cycle and exit (for cron or a test): exit 1 if Slurm did not "
              "answer or an action failed.")
@click.option("--interval", "-i", type=click.FloatRange(min=0.1), default=2.0, show_default=True, metavar="S",
              help="Most seconds between cycles: the daemon cycles every 0.5 s while a cycle takes under "
                   "a tenth of the time between two, and at least this often.")
@click.option("--lock", "lock_file", metavar="FILE", default=None,
              help="Lock file that makes one daemon the leader. [default: hai-policyd.lock in Slurm's "
                   "StateSaveLocation, which controller hosts of an HA pair share]")
@click.option("--wait-for-lock", is_flag=True, help="If another daemon leads, stand by until it stops "
              "(instead of exiting with status 4).")
@click.option("--dry-run", "-n", is_flag=True, help="Log what would be done, do nothing.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True, help="Logging threshold (one line per action at info).")
@click.option("--metrics-port", type=click.IntRange(1, 65535), metavar="PORT", default=None,
              help="Serve Prometheus metrics at http://ADDR:PORT/metrics (needs slurm-hai[metrics]; "
                   "docs/admin-guide.md, \"Metrics\"). Default: no metrics.")
@click.option("--metrics-address", metavar="ADDR", default="0.0.0.0", show_default=True,
              help="Address the metrics server listens on.")
@one_line_errors
def daemon(policy_file: str | None, once: bool, interval: float, lock_file: str | None, wait_for_lock: bool,
           dry_run: bool, log_level: str, metrics_port: int | None, metrics_address: str) -> None:
    """Run the policy loop: what Slurm cannot do alone.

    \b
    Every cycle it reads the queue (one squeue) and:
      - requeues a preempted job still running after its grace time (Slurm looks every 30 s);
      - requeues a preempted job that died of its suspend notice (Slurm 22.05 ends it FAILED);
      - marks an ABOVE_NORMAL job demoted to NORMAL after its time, and preempts demoted jobs
        for a waiting job of a level Slurm will not let preempt them (notice, grace, requeue);
      - gives a requeued job back its submit-time level;
      - moves a pending AUTO job to the highest level where its user has quota left;
      - starts a requeued job held back by Slurm's requeue delay (BeginTime) at once;
      - releases a job held by Slurm's requeue limit (JobHoldMaxRequeue);
      - sets priorities that keep each level's pending jobs in submission order, so a
        requeued job keeps its place ahead of later jobs.

    \b
    Each action is logged on one line with the job id and the reason. Only one daemon
    leads (lock file); Slurm errors are logged and retried with back-off. The policy file
    is re-read when it changes. SIGTERM/SIGINT stop it after the current cycle.

    \b
    With --metrics-port it serves Prometheus metrics while it leads: nodes held by level
    and user, pending jobs by level and reason, suspensions, forced suspensions, restarts,
    preemption and restart latencies, suspend checkpoint time, cycle time and errors.
    Where the policy names a [daemon] service, it answers there, while it leads, why each
    job waits (`hai status`, `hai list` ask it instead of reading the whole queue).
    """
    from ..controller.daemon import LockBusy, PolicyDaemon, leader_lock, shared_lock_path, write_pid  # lazy: +5 ms to every hai-admin command
    from ..controller.why import serve as serve_why  # lazy: +2 ms to every hai-admin command

    logging.basicConfig(level=getattr(logging, log_level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.Formatter.converter = time.localtime
    policy, path = _load(policy_file)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        lock_path = Path(lock_file) if lock_file else shared_lock_path(backend(), stop)
        lock = leader_lock(lock_path, wait=wait_for_lock, stop=stop)
    except LockBusy as e:
        click.echo(f"hai-admin daemon: {e}", err=True)
        sys.exit(4)
    metrics = answers = None
    try:
        write_pid(lock_path)
        if metrics_port:
            metrics = _serve_metrics(metrics_port, metrics_address, policy)
        answers = serve_why(policy)
        d = PolicyDaemon(backend(remember_queue=True), policy=policy, policy_path=path, interval=interval,
                         dry_run=dry_run, metrics=metrics, why=answers)
        code = d.run(once=once, stop=stop)
        why = "after one cycle (--once)" if once and not stop.is_set() else "on a signal" if stop.is_set() else (
            f"with status {code}")
        logging.getLogger("hai-policyd").info("policy daemon stopped %s", why)
    finally:
        if metrics is not None:
            metrics.close()
        if answers is not None:
            answers.close()
        lock.release()
    sys.exit(code)


@main.command("persist-agent")
@click.option("--spool", metavar="DIR", default=None,
              help="Where jobs on this node leave their requests. [default: $HAI_PERSIST_SPOOL, "
                   "else /run/slurm-hai/persist]")
@click.option("--once", is_flag=True, help="Handle the requests waiting now, then exit (for a test).")
@click.option("--sweep-every", metavar="SECONDS", type=click.FloatRange(min=1.0), default=30.0, show_default=True,
              help="How often to look for node memory of jobs that are over (it is removed once seen twice).")
@one_line_errors
def persist_agent(spool: str | None, once: bool, sweep_every: float) -> None:
    """Finish the durable copy of suspend checkpoints on this node (run one per node, as root).

    \b
    A job that suspends with CheckpointManager.suspend_save() commits its checkpoint to
    this node's memory and lets go of the node at once; this agent then copies the node's
    share to the durable directory (checksummed, fsynced) and, on the last node to finish,
    commits it. Each request runs as the job's user. Without an agent on every node of a
    job, suspend_save() saves to the durable directory itself, as a blocking save.
    It also removes the node memory (/dev/shm/slurm-hai-<job>-*) of jobs that are over.
    docs/checkpoint.md ("Suspend in memory time"); `hai-admin units` writes its unit file.
    """
    from ..checkpoint.agent import Agent, AgentError, prepare_spool  # lazy: +70 ms to every hai-admin command
    from ..checkpoint.memory import spool_dir  # lazy: +70 ms to every hai-admin command

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    where = Path(spool) if spool else spool_dir()
    try:
        prepare_spool(where)
    except AgentError as e:
        raise click.ClickException(str(e)) from None
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: sys.exit(0))
    Agent(where, jobs_over=_jobs_over, sweep_s=sweep_every).serve(once=once)


@main.command()
@click.option("--listen", metavar="ADDR", default="0.0.0.0", show_default=True,
              help="The address the jobs' parts ask on.")
@click.option("--port", type=click.IntRange(0, 65535), default=29510, show_default=True,
              help="The port they ask on (torchft's lighthouse port; 0: any free one, logged).")
@click.option("--state-dir", metavar="DIR", default="/var/lib/slurm-hai/lighthouse", show_default=True,
              help="Where each lighthouse is recorded (<job>.json) and logs its warnings (<job>.log).")
@click.option("--sweep-every", metavar="SECONDS", type=click.FloatRange(min=0.5), default=30.0, show_default=True,
              help="How often to stop the lighthouses of jobs that ended.")
@click.option("--heartbeat-timeout-ms", metavar="MS", type=click.IntRange(min=100), default=None,
              help="A part silent this long is left out of the next quorum: what the parts that stay lose when "
                   "others leave. Default 300; raise it where a node's network stalls longer.")
@one_line_errors
def lighthouse(listen: str, port: int, state_dir: str, sweep_every: float, heartbeat_timeout_ms: int | None) -> None:
    """Run the elastic jobs' torchft lighthouses: one per job, outliving its parts.

    \b
    A job's parts ask GET http://HOST:PORT/v1/jobs/<job id> for the address of the job's
    lighthouse; the first ask starts it (while Slurm holds the job). Each lighthouse is a
    process of its own (torchft's Rust lighthouse, no torch loaded: about 14 MiB): this
    service's restart leaves them running, and it finds them again in --state-dir. A job's
    lighthouse is stopped once the job ended. Needs torchft: pip install 'slurm-hai[elastic]'.
    docs/elastic-in-place.md; `hai-admin units` writes its unit file.
    """
    from ..controller.lighthouse import HEARTBEAT_TIMEOUT_MS, LighthouseError, Service, serve, torchft_extension  # lazy: +25 ms to every hai-admin command

    def ended(job_ids: list[int]) -> set[int]:
        try:
            return _jobs_over(job_ids)
        except SlurmError as e:
            raise LighthouseError(f"cannot ask Slurm whether a job ended: {e}") from None

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        torchft_extension()
        serve(Service(Path(state_dir), ended=ended, heartbeat_timeout_ms=heartbeat_timeout_ms or HEARTBEAT_TIMEOUT_MS),
              listen, port, sweep_every)
    except LighthouseError as e:
        raise click.ClickException(str(e)) from None
    except PermissionError as e:
        raise click.ClickException(f"{e.filename}: permission denied; run as root or give another --state-dir") \
            from None


def _jobs_over(job_ids: list[int]) -> set[int]:
    """Those of the jobs that Slurm says ended, or no longer knows; a job array (a job in
    place) once every task of it ended. Asked one by one: squeue of one job id is one small
    RPC (slurm_load_job); of several, squeue loads the whole queue and picks them out. A node
    holds the memory of one job or a few."""
    slurm = backend()
    return {job for job in job_ids if all(info.state in ENDED_STATES for info in slurm.jobs([job]))}


def _serve_metrics(port: int, address: str, policy: Policy):
    """The daemon's metrics, served on address:port; a one-line error when prometheus_client is
    missing (the daemon runs without it as long as no metrics are asked for) or the port is taken."""
    try:
        from ..controller.metrics import DaemonMetrics  # lazy: prometheus-client, an optional extra (metrics)
    except ModuleNotFoundError as e:
        if e.name != "prometheus_client":
            raise
        raise click.ClickException("--metrics-port needs the prometheus_client library: "
                                   "pip install 'slurm-hai[metrics]'") from None
    metrics = DaemonMetrics(policy.ladder)
    try:
        metrics.serve(port, address)
    except OSError as e:
        raise click.ClickException(f"cannot serve metrics on {address}:{port}: {e.strerror or e}") from None
    logging.getLogger("hai-policyd").info("metrics at http://%s:%d/metrics", address, port)
    return metrics


@main.command()
@_policy_option
@click.argument("job_ids", nargs=-1, type=int)
@click.option("--json", "as_json", is_flag=True, help="Print JSON: [{job_id, user, state, why}].")
@one_line_errors
def explain(policy_file: str | None, job_ids: tuple[int, ...], as_json: bool) -> None:
    """Say in words why jobs wait (all pending and running jobs when none is given)."""
    from ..policy.explain import Explainer  # lazy: +2 ms to every hai-admin command

    policy, _ = _load(policy_file)
    jobs = backend().jobs()
    wanted = [j for j in jobs if (j.job_id in job_ids if job_ids else j.state in ("PENDING", "RUNNING"))]
    missing = set(job_ids) - {j.job_id for j in wanted}
    if missing:
        raise click.ClickException(f"no such job in the queue: {', '.join(map(str, sorted(missing)))}")
    why = Explainer(jobs, policy)
    rows = [(j, why(j)) for j in sorted(wanted, key=lambda j: j.job_id)]
    if as_json:
        emit_json([{"job_id": j.job_id, "user": j.user, "state": j.state, "why": why} for j, why in rows])
        return
    if not rows:
        click.echo("no job is waiting or running: nothing to explain")
    for j, text in rows:
        click.echo(f"{j.job_id:>8}  {j.user:<12} {text}")


@main.command()
@_policy_option
@timeline_options
@one_line_errors
def timeline(policy_file: str | None, since: str, until: str | None, out: str, as_json: bool) -> None:
    """Draw the cluster's nodes over time, as one HTML page that opens offline.

    Which job held each node when, coloured by the policy's levels, with a mark where a run
    was suspended (go_suspend() or by force), restarted, shrunk or grown; hover for the
    details. Every run of every job comes from Slurm's accounting (sacct); the marks from
    each job's events, so run it as root to see every user's. `hai timeline` draws one
    user's jobs.
    """
    from ..jobs.timeline import collect  # lazy: +7 ms to every hai-admin command
    from .user import timeline_window, write_timeline  # lazy: +5 ms to every hai-admin command

    start, end = timeline_window(since, until)
    policy, _ = _load(policy_file)
    tl = collect(backend(), start, end, current_user(), policy.ladder)
    write_timeline(tl, out, "HAI cluster timeline", as_json)


# ------------------------------------------------------------------ what an admin installs by hand

# The files that travel with the package for the admin (slurm_hai/share/ and
# slurm_hai/templates/ link to the repository's spank/, contrib/ and templates/; a wheel holds
# copies): name -> (place in the package, what it holds).
SHARED = {
    "spank": ("share/spank", "the SPANK plugin's sources: `hai-admin spank install` builds and installs it"),
    "docs": ("share/docs", "the guides, the policy reference (policy.md) and policy.example.toml to start from"),
    "grafana": ("share/grafana", "slurm-hai.json: a Grafana dashboard of the daemon's metrics (--metrics-port)"),
    "slurm-docker": ("share/slurm-docker", "slurm-hai on giovtorres/slurm-docker-cluster (its README.md)"),
    "templates": ("templates", "the templates `hai-admin render` and `hai-submit` fill in (read-only)"),
}
# The Makefile's flags (spank/Makefile) less -Werror: a site's newer compiler may warn where
# ours does not, and a warning is no reason to leave the plugin out.
SPANK_CFLAGS = ("-O2", "-g", "-Wall", "-Wextra", "-Wshadow", "-Wformat=2", "-Wpointer-arith", "-fPIC", "-shared")
SPANK_INCLUDE_DIRS = ("/usr/include", "/usr/local/include")  # where gcc finds slurm/spank.h unaided


def shared_dir(name: str) -> Path:
    """Where the installed package keeps one of SHARED's directories."""
    from importlib.resources import files  # lazy: +2 ms to every hai-admin command

    path = Path(str(files("slurm_hai").joinpath(*SHARED[name][0].split("/"))))
    if not path.is_dir():
        raise click.ClickException(f"{path} is missing from this installation of slurm-hai: reinstall it")
    return path


@main.command()
@click.argument("what", required=False, type=click.Choice(list(SHARED)))
@one_line_errors
def files(what: str | None) -> None:
    """Say where the files an admin installs by hand are, in this installation.

    \b
    With WHAT, print only that directory, e.g.
      cp "$(hai-admin files docs)/policy.example.toml" /etc/slurm-hai/policy.toml
    The systemd units: `hai-admin units`.
    """
    if what:
        click.echo(shared_dir(what))
        return
    for name, (_, about) in SHARED.items():
        click.echo(f"{name:<13} {shared_dir(name)}\n{'':<14}{about}")


UNITS = {"hai-policyd.service": "the slurmctld host and its backup",
         "slurm-hai-persist.service": "every compute node",
         "hai-lighthouse.service": "one host the nodes reach: elastic jobs in place"}


@main.command()
@click.option("--out", default="/etc/systemd/system", show_default=True, type=click.Path(file_okay=False),
              help="Directory to write the unit files into.")
@one_line_errors
def units(out: str) -> None:
    """Write slurm-hai's systemd units into OUT, each running this installation's hai-admin
    (whatever venv or prefix it is in) and naming its documentation. Then
    `systemctl daemon-reload` and `systemctl enable --now UNIT` of those this host runs."""
    from ..render import render  # lazy: jinja2, +20 ms to every hai-admin command

    here = Path(sys.executable).with_name("hai-admin")
    hai_admin = here if here.exists() else Path(shutil.which("hai-admin") or here)
    docs = shared_dir("docs")
    target = Path(out)
    target.mkdir(parents=True, exist_ok=True)
    for name, where in UNITS.items():
        (target / name).write_text(render(f"systemd/{name}.j2", hai_admin=hai_admin, docs=docs))
        click.echo(f"wrote {target / name}: for {where}")
    click.echo(f"runs {hai_admin}; next: systemctl daemon-reload && systemctl enable --now UNIT")


def _slurm_headers(include: str | None) -> tuple[Path, str]:
    """The include directory holding slurm/spank.h, and which Slurm its headers are of ("Slurm 22.05.8")."""
    dirs = [Path(include)] if include else [Path(d) for d in SPANK_INCLUDE_DIRS]
    found = next((d for d in dirs if (d / "slurm" / "spank.h").is_file()), None)
    if found is None:
        raise click.ClickException(
            f"no slurm/spank.h under {' or '.join(map(str, dirs))}: install Slurm's development headers "
            "(Debian/Ubuntu: libslurm-dev; RHEL/Rocky/SUSE: slurm-devel) of the Slurm the cluster runs, "
            "or name their directory with --slurm-include DIR")
    try:
        text = (found / "slurm" / "slurm_version.h").read_text(errors="replace")
    except OSError:
        text = ""
    m = re.search(r"#\s*define\s+SLURM_VERSION_NUMBER\s+(0x[0-9a-fA-F]+)", text)
    if not m:
        return found, "a Slurm of unknown version"
    n = int(m.group(1), 16)
    return found, f"Slurm {n >> 16 & 0xff}.{n >> 8 & 0xff:02d}.{n & 0xff}"


def build_spank_plugin(out_dir: Path, include: str | None) -> tuple[Path, str]:
    """Compile the shipped hai_spank.c against the site's Slurm headers into out_dir/hai_spank.so
    (replaced whole); returns it and which Slurm the headers are of."""
    headers, slurm = _slurm_headers(include)
    target = out_dir / "hai_spank.so"
    _compile(shared_dir("spank") / "hai_spank.c", target, [f"-I{headers}", *SPANK_CFLAGS],
             f"against the headers of {slurm} in {headers}")
    return target, slurm


def _compile(source: Path, target: Path, flags: list[str], against: str = "") -> None:
    """`$CC FLAGS -o TARGET SOURCE` (gcc where $CC is unset), TARGET replaced whole (mode 0755);
    the compiler's warnings shown, its failure one line."""
    cc, *cc_flags = shlex.split(os.environ.get("CC", "")) or ["gcc"]
    if shutil.which(cc) is None:
        raise click.ClickException(f"no C compiler {cc!r} on PATH: install gcc (Debian/Ubuntu: apt-get install gcc; "
                                   "RHEL/Rocky: dnf install gcc), or name one in $CC")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    p = subprocess.run([cc, *cc_flags, *flags, "-o", str(tmp), str(source)], capture_output=True, text=True)
    said = p.stderr.rstrip().splitlines()
    if said:  # warnings, or the errors summed up below
        more = f"\n({len(said) - 40} more lines)" if len(said) > 40 else ""
        click.echo("\n".join(said[:40]) + more, err=True)
    if p.returncode != 0:
        tmp.unlink(missing_ok=True)
        first = next((ln for ln in p.stderr.splitlines() if "error" in ln), p.stderr.strip()[:300])
        raise click.ClickException(f"{cc} could not build {source.name}{' ' + against if against else ''} "
                                   f"(exit {p.returncode}): {first.strip()}")
    tmp.chmod(0o755)
    os.replace(tmp, target)


def _slurm_include_option(fn: Callable) -> Callable:
    return click.option("--slurm-include", metavar="DIR", default=None,
                        help="The include directory of the Slurm the cluster runs, the one holding "
                             "slurm/spank.h. [default: /usr/include, else /usr/local/include]")(fn)


@main.group(context_settings=CONTEXT)
def spank() -> None:
    """Build and install the SPANK plugin (hai_spank.so: --hai-priority, --hai-grace and the
    job's HAI environment) against this site's Slurm headers.

    \b
    Needs gcc and Slurm's development headers (Debian/Ubuntu: libslurm-dev; RHEL/Rocky: slurm-devel).
    A SPANK plugin is built per Slurm release: build it again after a Slurm upgrade. Install it
    on every node that runs slurmd and every host where users run sbatch, salloc or srun, then
    the plugstack.conf that `hai-admin render` writes.
    """


@spank.command("build")
@_slurm_include_option
@click.option("--out", "-o", "out_dir", metavar="DIR", default=".", show_default=True,
              type=click.Path(file_okay=False), help="Directory to write hai_spank.so into (created if missing).")
@one_line_errors
def spank_build(slurm_include: str | None, out_dir: str) -> None:
    """Compile hai_spank.so into DIR (to copy to the nodes yourself)."""
    so, slurm = build_spank_plugin(Path(out_dir), slurm_include)
    click.echo(f"built {so} for {slurm}")


@spank.command("install")
@_slurm_include_option
@click.option("--plugin-dir", metavar="DIR", default=str(Path(DEFAULT_SPANK_SO).parent), show_default=True,
              type=click.Path(file_okay=False), help="Directory to install hai_spank.so into (e.g. /usr/lib64/slurm "
              "with RPMs).")
@one_line_errors
def spank_install(slurm_include: str | None, plugin_dir: str) -> None:
    """Compile hai_spank.so and install it into DIR on this host (replaced whole, mode 0755)."""
    target, slurm = build_spank_plugin(Path(plugin_dir), slurm_include)
    click.echo(f"installed {target}, built for {slurm}")
    if str(target) != DEFAULT_SPANK_SO:
        click.echo(f"render plugstack.conf with: hai-admin render --spank-plugin {target}")


if __name__ == "__main__":  # pragma: no cover
    main()
