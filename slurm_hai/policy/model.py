"""The HAI scheduling policy: levels, quotas, grace, demotion, node groups (pure).

Loaded from one TOML file (every field: docs/policy.md); `default_policy()` is HAI's.
`load_policy(path)` validates the whole file and raises `PolicyError` with one located
message, e.g. ``policy.toml: [quota.users.alice] HIGH: expected a non-negative integer, got 'x'``.

Quotas are per user, per level, in nodes running at once. A level without a quota is
unlimited; 0 forbids the level. Overrides go user > account > default.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from . import hostlist
from .levels import AUTO, DEFAULT_LADDER, Level, variant_qos
from .limits import (MAX_GRACE, MAX_LEVEL_NAME, MAX_LEVEL_VALUE, MAX_LEVELS, MIN_GRACE, NOTICE_SIGNALS)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

UNLIMITED = "unlimited"
# "Every task uses at least 8 GPUs" (HAI's scheduling page): a training job takes whole nodes.
HAI_MIN_GPUS = 8
MAX_GPUS_PER_NODE = 64  # what hai-submit accepts per node
# One text for hai-submit and job_submit.lua (a printf format both Python and Lua's string.format
# read): node group, GPUs needed, GPUs asked for, GPUs needed.
MIN_GPUS_REFUSAL = ("node group %s takes jobs of at least %d GPUs per node (whole nodes); this job asks for %d per "
                    "node: use --gpus-per-node=%d")
LEVEL_NAME = re.compile(r"^[A-Z][A-Z0-9_]*$")
# Users and accounts end up in QOS names (see levels.variant_qos); keep them to what Slurm and
# POSIX user names allow, without the '.' that separates a QOS name's parts.
OWNER_NAME = re.compile(r"^[a-z_][a-z0-9_-]*\$?$")
GROUP_NAME = re.compile(r"^[A-Za-z0-9_-]+$")
HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class PolicyError(ValueError):
    """A policy file that cannot be used; the message names the file, table and key."""


@dataclass(frozen=True)
class NodeGroup:
    """A node group is a Slurm partition."""

    name: str
    nodes: str
    priority_tier: int = 1
    levels: tuple[str, ...] = ()  # empty: every level
    default: bool = False
    min_gpus: int | None = None  # GPUs per node its jobs must ask for; None: the policy's min_gpus

    def accepts(self, level: str) -> bool:
        return not self.levels or level in self.levels


@dataclass(frozen=True)
class Demotion:
    source: str = "ABOVE_NORMAL"
    target: str = "NORMAL"
    after_seconds: int = 30 * 60


@dataclass(frozen=True)
class Policy:
    ladder: tuple[Level, ...] = DEFAULT_LADDER
    default_level: str = "NORMAL"
    grace_seconds: int = 5
    # the most grace a job may ask for (hai-submit --grace, sbatch --hai-grace); None: grace_seconds
    max_grace_seconds: int | None = None
    min_run_seconds: int = 0
    demotion: Demotion | None = field(default_factory=Demotion)
    # level name -> default per-user node quota (missing: unlimited)
    quota: dict[str, int] = field(default_factory=dict)
    groups: tuple[NodeGroup, ...] = ()
    # user -> level -> quota, account -> level -> quota; None means unlimited for that owner
    user_quota: dict[str, dict[str, int | None]] = field(default_factory=dict)
    account_quota: dict[str, dict[str, int | None]] = field(default_factory=dict)
    # Slurm accounts whose associations `hai-admin apply` gives the ladder (QOS access, default QOS)
    accounts: tuple[str, ...] = ()
    allow_auto: bool = True
    # what the daemon sends a job's steps when it preempts a demoted job (hai-submit's --signal)
    notice_signal: str = "USR2"
    # levels at which a waiting job earlier in line suspends later jobs of other users (HAI
    # rule 3); None: every level
    fcfs_preempt_levels: tuple[str, ...] | None = None
    # GPUs per node a job must ask for (HAI: at least 8, a whole node); a group may set its own
    min_gpus: int = HAI_MIN_GPUS
    # an elastic job below its MAX grows into nodes idle this long (policy/elastic.py); None: never
    grow_after_seconds: int | None = 60
    # the site's lighthouse service (`hai-admin lighthouse`), http://HOST:PORT, that the parts
    # of an elastic job in place ask (hai-submit --in-place); None: the site runs none
    lighthouse_service: str | None = None
    # where the leading policy daemon answers why jobs wait (controller/why.py), http://HOST:PORT;
    # None: the commands read the whole queue to say it
    daemon_service: str | None = None
    source: str = field(default="<default>", compare=False)

    @property
    def grace_limit(self) -> int:
        """The most grace a job may ask for; the QOS GraceTime (Slurm's own hard bound)."""
        return self.grace_seconds if self.max_grace_seconds is None else self.max_grace_seconds

    def level(self, name: str) -> Level:
        for lvl in self.ladder:
            if lvl.name == name:
                return lvl
        raise KeyError(name)

    def lower_levels(self, lvl: Level) -> list[Level]:
        """Levels that `lvl` may preempt: every strictly lower one, never its own."""
        return [other for other in self.ladder if other.value < lvl.value]

    @property
    def levels_high_to_low(self) -> tuple[Level, ...]:
        return tuple(sorted(self.ladder, key=lambda lvl: -lvl.value))

    def quota_for(self, level: str, user: str = "", account: str = "") -> int | None:
        """Nodes `user` may run at once at `level` (None: unlimited); user > account > default."""
        if user in self.user_quota and level in self.user_quota[user]:
            return self.user_quota[user][level]
        if account in self.account_quota and level in self.account_quota[account]:
            return self.account_quota[account][level]
        return self.quota.get(level)

    def override_owner(self, level: str, user: str = "", account: str = "") -> tuple[str, str] | None:
        """("u", user) or ("a", account) when an override decides `level` for them, else None."""
        if user in self.user_quota and level in self.user_quota[user]:
            return ("u", user)
        if account in self.account_quota and level in self.account_quota[account]:
            return ("a", account)
        return None

    def qos_for(self, level: str, user: str = "", account: str = "") -> str:
        """The QOS a job of `user` (in `account`) at `level` runs in."""
        owner = self.override_owner(level, user, account)
        return variant_qos(self.level(level), *owner) if owner else self.level(level).qos

    def min_gpus_for(self, group: str | None) -> int:
        """GPUs per node a job in node group `group` must ask for (None: the default group;
        a partition the policy does not name: the top-level min_gpus)."""
        g = self.group(group) if group is not None else self.default_group
        return g.min_gpus if g is not None and g.min_gpus is not None else self.min_gpus

    def min_gpus_refusal(self, group: str | None, gpus_per_node: int) -> str | None:
        """The one-line refusal (job_submit.lua says the same) of a job in `group` asking for
        `gpus_per_node` GPUs per node, or None when that is enough."""
        need = self.min_gpus_for(group)
        if gpus_per_node >= need:
            return None
        name = group if group is not None else (self.default_group.name if self.default_group else "-")
        return MIN_GPUS_REFUSAL % (name, need, gpus_per_node, need)

    def fcfs_preempts(self, level: str) -> bool:
        """Whether a waiting job at `level` takes the nodes of later jobs of other users of it."""
        return self.fcfs_preempt_levels is None or level in self.fcfs_preempt_levels

    def group(self, name: str) -> NodeGroup | None:
        for g in self.groups:
            if g.name == name:
                return g
        return None

    @property
    def default_group(self) -> NodeGroup | None:
        for g in self.groups:
            if g.default:
                return g
        return self.groups[0] if self.groups else None


def default_policy(nodes: str = "ALL") -> Policy:
    return Policy(groups=(NodeGroup(name="gpu", nodes=nodes, default=True),))


# ------------------------------------------------------------------ loading

SYSTEM_POLICY = Path("/etc/slurm-hai/policy.toml")


def policy_path() -> Path | None:
    """Where this host's policy is: $HAI_POLICY, else policy.toml beside $SLURM_CONF, else
    /etc/slurm-hai/policy.toml; None when there is none."""
    if os.environ.get("HAI_POLICY"):
        return Path(os.environ["HAI_POLICY"])
    candidates = []
    if os.environ.get("SLURM_CONF"):
        candidates.append(Path(os.environ["SLURM_CONF"]).with_name("policy.toml"))
    candidates.append(SYSTEM_POLICY)
    return next((p for p in candidates if p.is_file()), None)


def find_policy() -> Policy:
    """This host's policy (see `policy_path`), or HAI's default when there is none. Read once
    per process while the file stays as it is (a command may ask for it more than once)."""
    path = policy_path()
    if path is None:
        return default_policy()
    try:
        st = path.stat()
    except OSError:
        return load_policy(path)  # which says why
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    kept = _kept.get(path)
    if kept is None or kept[0] != key:
        kept = _kept[path] = (key, load_policy(path))
    return kept[1]


_kept: dict[Path, tuple[tuple[int, int, int, int], Policy]] = {}  # find_policy's, by path



def load_policy(path: str | Path) -> Policy:
    """Read and validate a policy file; every problem is a `PolicyError` naming its place."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise PolicyError(f"{path}: no such policy file") from None
    except OSError as e:
        raise PolicyError(f"{path}: cannot read: {e.strerror}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise PolicyError(f"{path}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as e:
        raise PolicyError(f"{path}: invalid TOML: {e}") from None
    except RecursionError:  # tomllib reads nested arrays and tables by recursion
        raise PolicyError(f"{path}: invalid TOML: nested too deeply") from None
    return parse_policy(data, source=str(path))


def parse_policy(data: Mapping[str, Any], source: str = "policy.toml") -> Policy:
    return _Parser(source).policy(data)


TOP_KEYS = ("default_level", "grace_seconds", "max_grace_seconds", "min_run_seconds", "accounts", "allow_auto", "notice_signal",
            "fcfs_preempt_levels", "min_gpus", "levels", "demotion", "quota", "groups", "elastic", "daemon")
DEMOTION_KEYS = ("enabled", "from", "to", "after_seconds")
ELASTIC_KEYS = ("grow", "grow_after", "lighthouse_service")
DAEMON_KEYS = ("service",)
GROUP_KEYS = ("nodes", "priority_tier", "levels", "default", "min_gpus")
DURATION = re.compile(r"^\s*(\d+)\s*(s|m|h|d)?\s*$")
UNIT = {None: 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


class _Parser:
    def __init__(self, source: str) -> None:
        self.source = source

    def error(self, table: str, key: str | None, message: str) -> PolicyError:
        where = f"[{table}] " if table else ""
        return PolicyError(f"{self.source}: {where}{key + ': ' if key else ''}{message}")

    def known(self, table: str, mapping: Mapping[str, Any], keys: tuple[str, ...]) -> None:
        for key in mapping:
            if key not in keys:
                raise self.error(table, key, f"unknown key (expected one of: {', '.join(keys)})")

    def table(self, table: str, key: str, value: Any) -> Mapping[str, Any]:
        """A TOML table whose keys are distinct without regard to case: level names, user and
        account names, QOS and partition names are one name to Slurm, or to a reader, in any case."""
        if not isinstance(value, dict):
            raise self.error(table, key, f"expected a table, got {value!r}")
        seen: dict[str, str] = {}
        inner = f"{table}.{key}" if table else key
        for name in value:
            if name.lower() in seen:
                raise self.error(inner, name, f"the same name as {seen[name.lower()]!r} but for case; keep one")
            seen[name.lower()] = name
        return value

    def integer(self, table: str, key: str, value: Any, low: int = 0, high: int | None = None) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
            what = "a non-negative integer" if low == 0 and high is None else f"an integer from {low} to {high}"
            raise self.error(table, key, f"expected {what}, got {value!r}")
        return value

    def seconds(self, table: str, key: str, value: Any, low: int = 0, high: int = 10 * 365 * 86400) -> int:
        """A duration from `low` to `high` seconds: integer seconds, or a string such as "90s", "30m", "2h"."""
        if isinstance(value, str) and (m := DURATION.match(value)):
            value = int(m.group(1)) * UNIT[m.group(2)]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise self.error(table, key, f"expected seconds (a non-negative integer) or a duration like \"30m\", "
                                         f"got {value!r}")
        if not low <= value <= high:
            raise self.error(table, key, f"expected from {low} to {high} seconds, got {value}")
        return value

    def boolean(self, table: str, key: str, value: Any) -> bool:
        if not isinstance(value, bool):
            raise self.error(table, key, f"expected true or false, got {value!r}")
        return value

    def string(self, table: str, key: str, value: Any) -> str:
        if not isinstance(value, str) or not value.strip():
            raise self.error(table, key, f"expected a non-empty string, got {value!r}")
        return value.strip()

    def level_name(self, table: str, key: str, value: Any, names: set[str]) -> str:
        text = self.string(table, key, value).upper()
        if text not in names:
            raise self.error(table, key, f"unknown level {value!r} (levels: {', '.join(sorted(names))})")
        return text

    def policy(self, data: Mapping[str, Any]) -> Policy:
        self.known("", data, TOP_KEYS)
        ladder = self.ladder(data.get("levels"))
        names = {lvl.name for lvl in ladder}
        if "default_level" in data:
            default_level = self.level_name("", "default_level", data["default_level"], names)
        elif "NORMAL" in names:
            default_level = "NORMAL"
        else:
            raise self.error("", "default_level", "required when the ladder has no NORMAL level")
        grace = self.seconds("", "grace_seconds", data.get("grace_seconds", 5), low=MIN_GRACE, high=MAX_GRACE)
        max_grace = None
        if "max_grace_seconds" in data:
            max_grace = self.seconds("", "max_grace_seconds", data["max_grace_seconds"], low=MIN_GRACE,
                                     high=MAX_GRACE)
            if max_grace < grace:
                raise self.error("", "max_grace_seconds", f"must be at least grace_seconds ({grace}), got {max_grace}")
        min_run = self.seconds("", "min_run_seconds", data.get("min_run_seconds", 0))
        accounts = self.owner_list("", "accounts", data.get("accounts", []))
        allow_auto = self.boolean("", "allow_auto", data.get("allow_auto", True))
        notice = self.signal_name("", "notice_signal", data.get("notice_signal", "USR2"))
        fcfs = self.level_list("", "fcfs_preempt_levels", data["fcfs_preempt_levels"], names) \
            if "fcfs_preempt_levels" in data else None
        min_gpus = self.integer("", "min_gpus", data.get("min_gpus", HAI_MIN_GPUS), 0, MAX_GPUS_PER_NODE)
        demotion = self.demotion(data.get("demotion"), ladder)
        grow_after, lighthouse = self.elastic(data.get("elastic", {}))
        daemon = self.table("", "daemon", data.get("daemon", {}))
        self.known("daemon", daemon, DAEMON_KEYS)
        service = self.service_url("daemon", "service", daemon["service"], "the policy daemon") \
            if "service" in daemon else None
        quota, users, accts = self.quotas(data.get("quota", {}), names)
        groups = self.groups(data.get("groups"), names)
        return Policy(ladder=ladder, default_level=default_level, grace_seconds=grace, max_grace_seconds=max_grace,
                      min_run_seconds=min_run,
                      demotion=demotion, quota=quota, groups=groups, user_quota=users, account_quota=accts,
                      accounts=accounts, allow_auto=allow_auto, notice_signal=notice, min_gpus=min_gpus,
                      fcfs_preempt_levels=fcfs, grow_after_seconds=grow_after, lighthouse_service=lighthouse,
                      daemon_service=service, source=self.source)

    def ladder(self, raw: Any) -> tuple[Level, ...]:
        if raw is None:
            return DEFAULT_LADDER
        levels = self.table("", "levels", raw)
        if not levels:
            raise self.error("levels", None, "the ladder needs at least one level")
        if len(levels) > MAX_LEVELS:
            raise self.error("levels", None, f"a ladder has at most {MAX_LEVELS} levels, got {len(levels)}")
        out: list[Level] = []
        seen: dict[int, str] = {}
        for name, value in levels.items():
            if name.upper() == AUTO:
                raise self.error("levels", name, "AUTO is not a level but a request (see allow_auto)")
            if not LEVEL_NAME.fullmatch(name):
                raise self.error("levels", name, "a level name is upper-case letters, digits and '_'")
            if len(name) > MAX_LEVEL_NAME:
                raise self.error("levels", name, f"a level name has at most {MAX_LEVEL_NAME} characters")
            number = self.integer("levels", name, value, 0, MAX_LEVEL_VALUE)
            if number in seen:
                raise self.error("levels", name, f"value {number} is already used by {seen[number]}")
            seen[number] = name
            out.append(Level(number, name))
        return tuple(sorted(out, key=lambda lvl: -lvl.value))

    def level_list(self, table: str, key: str, raw: Any, names: set[str]) -> tuple[str, ...]:
        if not isinstance(raw, list):
            raise self.error(table, key, f"expected a list of level names, got {raw!r}")
        return tuple(dict.fromkeys(self.level_name(table, key, item, names) for item in raw))

    def owner_list(self, table: str, key: str, raw: Any) -> tuple[str, ...]:
        if not isinstance(raw, list):
            raise self.error(table, key, f"expected a list of names, got {raw!r}")
        return tuple(self.owner(table, key, item) for item in raw)

    def owner(self, table: str, key: str, value: Any) -> str:
        if not isinstance(value, str) or not OWNER_NAME.fullmatch(value):
            raise self.error(table, key, f"expected a user or account name (lower-case letters, digits, '_', '-'), "
                                         f"got {value!r}")
        return value

    def signal_name(self, table: str, key: str, value: Any) -> str:
        text = self.string(table, key, value).upper().removeprefix("SIG")
        if text not in NOTICE_SIGNALS:
            raise self.error(table, key, f"expected one of {', '.join(NOTICE_SIGNALS)} (a signal Slurm sends as a "
                                         f"job's notice and a job can take as one), got {value!r}")
        return text

    def demotion(self, raw: Any, ladder: tuple[Level, ...]) -> Demotion | None:
        names = {lvl.name for lvl in ladder}
        if raw is False:
            return None
        if raw is None:
            ok = {"ABOVE_NORMAL", "NORMAL"} <= names
            return Demotion() if ok else None
        t = self.table("", "demotion", raw)
        self.known("demotion", t, DEMOTION_KEYS)
        if not self.boolean("demotion", "enabled", t.get("enabled", True)):
            return None
        for key in ("from", "to"):
            if key not in t and not {"ABOVE_NORMAL", "NORMAL"} <= names:
                raise self.error("demotion", key, "required with a custom ladder")
        source = self.level_name("demotion", "from", t.get("from", "ABOVE_NORMAL"), names)
        target = self.level_name("demotion", "to", t.get("to", "NORMAL"), names)
        values = {lvl.name: lvl.value for lvl in ladder}
        if values[target] >= values[source]:
            raise self.error("demotion", "to", f"{target} is not below {source}")
        after = self.seconds("demotion", "after_seconds", t.get("after_seconds", 30 * 60))
        if after == 0:
            raise self.error("demotion", "after_seconds", "must be at least 1 second (or set enabled = false)")
        return Demotion(source=source, target=target, after_seconds=after)

    def hostlist(self, table: str, nodes: str) -> None:
        """A Slurm hostlist ("gpu[001-064],n7") that Slurm can read, naming nodes it can name."""
        try:
            hosts = hostlist.expand(nodes)
        except ValueError as e:
            raise self.error(table, "nodes", f"{e}; write it as Slurm does, e.g. \"gpu[001-064],n7\"") from None
        bad = next((h for h in hosts if not HOST_NAME.fullmatch(h)), None) if hosts else nodes
        if bad is not None:
            raise self.error(table, "nodes", f"{bad!r} is not a node name (letters, digits, '.', '_', '-'); "
                                             f"write the list as Slurm does, e.g. \"gpu[001-064],n7\"")

    def elastic(self, raw: Any) -> tuple[int | None, str | None]:
        """[elastic]: grow = true|false, grow_after = seconds (at least 1), lighthouse_service =
        "http://HOST:PORT": (grow_after_seconds, lighthouse_service)."""
        t = self.table("", "elastic", raw)
        self.known("elastic", t, ELASTIC_KEYS)
        service = self.service_url("elastic", "lighthouse_service", t["lighthouse_service"]) \
            if "lighthouse_service" in t else None
        if not self.boolean("elastic", "grow", t.get("grow", True)):
            return None, service
        after = self.seconds("elastic", "grow_after", t.get("grow_after", 60), high=86400)
        if after == 0:
            raise self.error("elastic", "grow_after", "must be at least 1 second (or set grow = false)")
        return after, service

    def service_url(self, table: str, key: str, value: Any, who: str = "`hai-admin lighthouse`") -> str:
        """http://HOST:PORT, nothing after the port, where `who` listens."""
        m = re.fullmatch(r"http://([A-Za-z0-9.-]+|\[[0-9A-Fa-f:]+\]):(\d{1,5})/?", self.string(table, key, value))
        if m is None or not 0 < int(m.group(2)) < 65536:
            raise self.error(table, key, f"expected http://HOST:PORT (where {who} listens), "
                                         f"got {value!r}")
        return f"http://{m.group(1)}:{int(m.group(2))}"

    def quota_table(self, table: str, raw: Mapping[str, Any], names: set[str],
                    allow_unlimited: bool) -> dict[str, int | None]:
        out: dict[str, int | None] = {}
        for key, value in raw.items():
            name = key.upper()
            if name not in names:
                raise self.error(table, key, f"unknown level (levels: {', '.join(sorted(names))})")
            if allow_unlimited and value == UNLIMITED:
                out[name] = None
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise self.error(table, key, f"expected a non-negative integer, got {value!r}")
            out[name] = value
        return out

    def quotas(self, raw: Any, names: set[str]):
        q = self.table("", "quota", raw)
        defaults = {k: v for k, v in q.items() if k not in ("users", "accounts")}
        base = {k: v for k, v in self.quota_table("quota", defaults, names, True).items() if v is not None}
        overrides: list[dict[str, dict[str, int | None]]] = []
        for kind in ("users", "accounts"):
            sub = self.table("quota", kind, q.get(kind, {}))
            out: dict[str, dict[str, int | None]] = {}
            for owner, levels in sub.items():
                table = f"quota.{kind}.{owner}"
                self.owner(f"quota.{kind}", owner, owner)
                out[owner] = self.quota_table(table, self.table(f"quota.{kind}", owner, levels), names, True)
            overrides.append(out)
        return base, overrides[0], overrides[1]

    def groups(self, raw: Any, names: set[str]) -> tuple[NodeGroup, ...]:
        if raw is None:
            return (NodeGroup(name="gpu", nodes="ALL", default=True),)
        t = self.table("", "groups", raw)
        if not t:
            raise self.error("groups", None, "at least one node group is needed")
        out = []
        for name, body in t.items():
            table = f"groups.{name}"
            if not GROUP_NAME.fullmatch(name):
                raise self.error("groups", name, "a group (partition) name is letters, digits, '_' and '-'")
            if name.upper() == "DEFAULT":
                raise self.error("groups", name, "DEFAULT is not a partition to Slurm (PartitionName=DEFAULT sets "
                                                 "the defaults of the others); choose another name")
            g = self.table("groups", name, body)
            self.known(table, g, GROUP_KEYS)
            if "nodes" not in g:
                raise self.error(table, "nodes", "required (a Slurm hostlist such as \"gpu[001-064]\", or ALL)")
            nodes = self.string(table, "nodes", g["nodes"])
            if any(c.isspace() for c in nodes):
                raise self.error(table, "nodes", f"a hostlist has no spaces, got {nodes!r}")
            if nodes.upper() != "ALL":
                self.hostlist(table, nodes)
            tier = self.integer(table, "priority_tier", g.get("priority_tier", 1), 0, 65533)
            levels_raw = g.get("levels", [])
            if not isinstance(levels_raw, list):
                raise self.error(table, "levels", f"expected a list of level names, got {levels_raw!r}")
            levels = tuple(self.level_name(table, "levels", lv, names) for lv in levels_raw)
            default = self.boolean(table, "default", g.get("default", False))
            min_gpus = (self.integer(table, "min_gpus", g["min_gpus"], 0, MAX_GPUS_PER_NODE) if "min_gpus" in g
                        else None)
            out.append(NodeGroup(name=name, nodes=nodes, priority_tier=tier, levels=levels, default=default,
                                 min_gpus=min_gpus))
        defaults = [g.name for g in out if g.default]
        if len(defaults) > 1:
            raise self.error("groups", None, f"only one group can be the default, got {', '.join(defaults)}")
        if not defaults:
            out[0] = NodeGroup(**{**out[0].__dict__, "default": True})
        return tuple(out)
