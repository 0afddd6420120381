"""Hostile input, tried by hypothesis: everything slurm-hai parses from outside.

Slurm's records of every version (`squeue`/`scontrol`/`sacct --json`, pyslurm), Slurm's text
(`scontrol show node -o`, `sacctmgr -P`, hostlists, versions), the policy TOML, hai-submit's
options and the values of the SPANK plugin's --hai-* options. The promise: a value slurm-hai
cannot use is one line and a non-zero exit (or one typed error the caller turns into one),
never a traceback, and nothing is written. Accepted values never add a line to the sbatch
script, and the C plugin accepts exactly what the Python side accepts.

Derandomized (the same examples on every run), with a small example budget per property.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurm_hai.cli import admin as admin_cli
from slurm_hai.cli import submit as submit_cli
from slurm_hai.jobs.request import JobRequest, RequestError, render_script, validate
from slurm_hai.policy.limits import MAX_LEVEL_NAME, MAX_LEVELS
from slurm_hai.policy import hostlist
from slurm_hai.policy.model import Policy, PolicyError, default_policy, load_policy, parse_policy
from slurm_hai.policy.placement import spank_arguments
from slurm_hai.slurm import commands
from slurm_hai.slurm.records import PYSLURM, PYSLURM_DB, JobInfo, RecordError, job_from_record, jobs_from_json
from slurm_hai.slurm.version import SlurmVersion
from squeue_text import recorded_releases, recorded_rows, render
from test_frontdoor_submit import FakeSlurm
from test_spank_policy import plugstack_args, python_priority, spank_plugin, start_plugin  # noqa: F401

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "slurm"
LOCAL_POLICY = REPO / "contrib" / "localcluster" / "policy.toml"

FAST = settings(max_examples=60, deadline=None, derandomize=True, database=None,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

# ------------------------------------------------------------------ values

# JSON as a hostile Slurm could print it (json.loads also reads NaN and Infinity).
json_scalars = (st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
                | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12)
                | st.sampled_from(["", " ", "\n", "PENDING", "RUNNING REQUEUED", "UNLIMITED", "SIGNALED"]))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.sampled_from(["set", "infinite", "number", "status", "return_code",
                                                              "signal", "id", "current", "x"]), inner, max_size=3),
                           max_leaves=6)


def fixture_docs() -> list[tuple[str, str, dict]]:
    """(release, command, document) for every recorded Slurm JSON document."""
    names = {"squeue.json": "squeue --json", "scontrol.json": "scontrol show job --json", "sacct.json": "sacct --json"}
    return [(d.name, names[f.name], json.loads(f.read_text())) for d in sorted(FIXTURES.iterdir()) if d.is_dir()
            for f in sorted(d.iterdir()) if f.name in names]


DOCS = fixture_docs()


def paths(value: object, prefix: tuple = ()) -> list[tuple]:
    """Every place (key path) in a JSON value."""
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += paths(v, (*prefix, i))
    return out


def replaced(doc: object, path: tuple, value: object) -> object:
    if not path:
        return value
    doc = copy.copy(doc)
    doc[path[0]] = replaced(doc[path[0]], path[1:], value)
    return doc


# ------------------------------------------------------------------ Slurm's records


@FAST
@given(st.sampled_from(DOCS), st.data())
def test_a_record_of_any_shape_is_read_or_refused_in_one_line(doc_of, data):
    release, command, doc = doc_of
    job = data.draw(st.integers(0, len(doc["jobs"]) - 1))
    where = data.draw(st.sampled_from(paths(doc["jobs"][job])))
    value = data.draw(json_values)
    doc = replaced(doc, ("jobs", job, *where), value)
    # what reaches the parser went through json.dumps/loads as Slurm's output would
    doc = json.loads(json.dumps(doc))
    jobs, problems = jobs_from_json(doc, command)
    assert len(jobs) + len(problems) == len(doc["jobs"])
    assert all(isinstance(j, JobInfo) for j in jobs)
    for problem in problems:
        assert isinstance(problem, RecordError) and "\n" not in str(problem) and release in str(problem)


@FAST
@given(json_values)
def test_a_document_without_a_job_list_is_one_record_error(doc):
    try:
        jobs, problems = jobs_from_json(doc, "squeue --json")
    except RecordError as e:
        assert "\n" not in str(e)
    else:
        assert isinstance(doc, dict) and isinstance(doc.get("jobs"), list)


PYSLURM_RECORD = {"id": 7, "name": "a", "user_name": "u", "state": "RUNNING", "state_reason": "None", "qos": "low",
                  "num_nodes": 2, "allocated_nodes": "n[1-2]", "nodelist": "n[1-2]", "requeue_count": 0,
                  "submit_time": 1, "start_time": 2, "eligible_time": 1, "priority": 5, "exit_code": None,
                  "exit_code_signal": None, "end_time": "UNLIMITED"}


@FAST
@given(st.sampled_from([PYSLURM, PYSLURM_DB]), st.sampled_from(sorted(PYSLURM_RECORD)), json_values)
def test_a_pyslurm_record_of_any_shape_is_read_or_refused_in_one_line(spec, key, value):
    try:
        job = job_from_record({**PYSLURM_RECORD, key: value}, spec, "Slurm 25.11.7 pyslurm.Jobs")
    except RecordError as e:
        assert "\n" not in str(e)
    else:
        assert isinstance(job, JobInfo)


slurm_text = st.text(alphabet=st.sampled_from("NodeName=Gres:gpu,()Partitions= n1\n\t|[]-0123456789x"), max_size=80)


@FAST
@given(slurm_text)
def test_scontrol_and_sacctmgr_text_of_any_shape_never_crashes(text):
    for node in commands.nodes_from_text(text):
        assert node.name and node.gpus >= 0
    assert all(set(row) <= set(commands.QOS_FIELDS) for row in commands.parsable_rows(text, commands.QOS_FIELDS))


@FAST
@given(st.text(alphabet=st.sampled_from("n[]-,0123456789 x"), max_size=24))
def test_a_hostlist_is_expanded_or_refused_in_one_line(text):
    try:
        hosts = hostlist.expand(text)
    except ValueError as e:
        assert "\n" not in str(e) and text.strip()
    else:
        assert all(h and "[" not in h and "," not in h for h in hosts)


def test_a_hostlist_expands_as_slurm_does():
    assert hostlist.expand("n[1-3,7],gpu[01-02]") == ["n1", "n2", "n3", "n7", "gpu01", "gpu02"]
    assert hostlist.expand("r[1-2]n[1-2]") == ["r1n1", "r1n2", "r2n1", "r2n2"]
    for bad in ("n[3-1]", "n[a-b]", "n[-]", "n[1-2", "n[1-999999999]"):
        with pytest.raises(ValueError, match="hostlist"):
            hostlist.expand(bad)


@FAST
@given(st.text(max_size=20))
def test_a_slurm_version_is_read_or_refused_in_one_line(text):
    try:
        version = SlurmVersion.parse(text)
    except ValueError as e:
        assert "\n" not in str(e).replace(repr(text), "")
    else:
        assert version.release.count(".") == 1


# ------------------------------------------------------------------ the policy file

toml_scalars = (st.integers(-5, 2000) | st.booleans() | st.text(max_size=8)
                | st.sampled_from(["HIGH", "30m", "2h", "unlimited", "USR2", "_IGN", "gpu\n", "HIGH\n", "n[1-2]"]))
toml_values = st.recursive(toml_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6) | st.sampled_from(["HIGH", "nodes", "users", "gpu"]),
                                             inner, max_size=3), max_leaves=6)
LOCAL = load_policy(LOCAL_POLICY)
LOCAL_DATA = __import__("tomllib").loads(LOCAL_POLICY.read_text())


@FAST
@given(st.sampled_from(paths(LOCAL_DATA)), toml_values)
def test_a_policy_of_any_shape_is_read_or_refused_in_one_located_line(where, value):
    data = replaced(LOCAL_DATA, where, value) if where else value
    try:
        policy = parse_policy(data if isinstance(data, dict) else {"levels": data}, source="p.toml")
    except PolicyError as e:
        assert str(e).startswith("p.toml: ") and "\n" not in str(e)
    else:
        assert isinstance(policy, Policy)
        # what reaches Slurm's configuration and the SPANK plugin is one word per name
        for name in [lvl.name for lvl in policy.ladder] + [g.name for g in policy.groups] + [
                g.nodes for g in policy.groups] + list(policy.user_quota) + list(policy.account_quota):
            assert name and not any(c.isspace() for c in name), name
        assert f"SIG{policy.notice_signal}" in __import__("signal").Signals.__members__


@FAST
@given(st.binary(max_size=60) | st.sampled_from([b"levels = [" * 2000, b"a = " + b"[" * 5000, b"\xff\xfe"]))
def test_policy_check_of_any_file_is_one_line_and_changes_nothing(tmp_path_factory, raw):
    path = tmp_path_factory.mktemp("p") / "policy.toml"
    path.write_bytes(raw)
    r = CliRunner().invoke(admin_cli.main, ["check", "--policy", str(path)])
    assert r.exit_code in (0, 1), r.output
    assert not isinstance(r.exception, Exception) or isinstance(r.exception, SystemExit), r.exception
    if r.exit_code:
        assert len(r.output.strip().splitlines()) == 1 and r.output.startswith("Error: ")
    assert path.read_bytes() == raw and os.listdir(path.parent) == ["policy.toml"]


def test_a_misleading_policy_value_is_refused():
    for data, needle in [({"notice_signal": "_IGN"}, "signal"), ({"levels": {"HIGH\n": 3}}, "level name"),
                         ({"groups": {"gpu\n": {"nodes": "n1"}}}, "group"),
                         ({"accounts": ["hai\n"]}, "account name"),
                         ({"levels": {"L" * (MAX_LEVEL_NAME + 1): 1}}, f"at most {MAX_LEVEL_NAME}"),
                         ({"levels": {f"L{i}": i for i in range(MAX_LEVELS + 1)}}, f"at most {MAX_LEVELS}")]:
        with pytest.raises(PolicyError, match=needle):
            parse_policy(data)


# ------------------------------------------------------------------ hai-submit's options


@pytest.fixture
def fake(monkeypatch, tmp_path):
    slurm = FakeSlurm()
    monkeypatch.setattr(submit_cli, "backend", lambda: slurm)
    monkeypatch.setenv("HAI_HOME", str(tmp_path / "hai"))
    (tmp_path / "policy.toml").write_text("min_gpus = 0\n")
    monkeypatch.setenv("HAI_POLICY", str(tmp_path / "policy.toml"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print(1)\n")
    return slurm


option_values = st.text(max_size=10) | st.sampled_from(
    ["0", "-1", "5", "99999999999999999999", "1e3", " 3", "3\n", "HIGH\n", "a b", "x;y", "$(id)", "\t", "-", "--"])
OPTIONS = ["--name", "-n", "-p", "--gpus-per-node", "-g", "-e", "--time", "--grace", "--retries", "--workdir",
           "--python"]


@FAST
@given(st.lists(st.tuples(st.sampled_from(OPTIONS), option_values), max_size=3))
def test_any_hai_submit_option_is_accepted_or_refused_in_one_line(fake, tmp_path, options):
    before = sorted(p.name for p in tmp_path.iterdir())
    argv = ["--dry-run", *[part for pair in options for part in pair], "train.py"]
    r = CliRunner().invoke(submit_cli.main, argv)
    assert not isinstance(r.exception, Exception) or isinstance(r.exception, SystemExit), (argv, r.exception)
    lines = r.output.strip().splitlines()
    if r.exit_code:
        assert len(lines) == 1 and lines[0].startswith("Error: ") and "Traceback" not in r.output, (argv, r.output)
    else:
        assert r.output.startswith("#!/bin/bash")
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # a dry run writes nothing


BASELINE_LINES = None


@FAST
@given(name=st.text(max_size=12), group=st.text(max_size=8), time=st.text(max_size=10),
       env=st.lists(st.text(max_size=10), max_size=2), priority=st.text(max_size=6) | st.sampled_from(["HIGH", "30"]))
def test_an_accepted_value_never_adds_a_line_to_the_sbatch_script(tmp_path_factory, name, group, time, env, priority):
    root = tmp_path_factory.mktemp("r")
    plain = JobRequest(script=str(root / "t.py"), name="job", group="gpu", time="10", env=["A=1"] * len(env),
                       job_root=str(root))
    req = JobRequest(script=str(root / "t.py"), name=name or None, group=group or None, time=time or None, env=env,
                     priority=priority, job_root=str(root))
    try:
        context = validate(req, default_policy())
    except RequestError as e:
        assert "\n" not in str(e).replace(repr(name), "").replace(repr(group), "").replace(repr(time), "")
        return
    script = render_script(context, term_is_notice=False)
    want = render_script(validate(plain, default_policy()), term_is_notice=False)
    shape = lambda text: [line.split("=")[0].split(" ")[0] for line in text.splitlines()]  # noqa: E731
    if not group:
        want = "\n".join(ln for ln in want.splitlines() if not ln.startswith("#SBATCH --partition"))
    if not time:
        want = "\n".join(ln for ln in want.splitlines() if not ln.startswith("#SBATCH --time"))
    assert shape(script) == shape(want), script


@pytest.mark.parametrize("field,value", [("name", "job\n"), ("env", ["A\n=1"]), ("time", "10\n"), ("group", "gpu\n"),
                                         ("time", "\u0663"), ("name", "job\n#SBATCH --uid=0")])
def test_a_value_that_would_end_its_line_early_is_refused(tmp_path, field, value):
    with pytest.raises(RequestError):
        validate(JobRequest(script=str(tmp_path / "t.py"), job_root=str(tmp_path), **{field: value}), default_policy())


# ------------------------------------------------------------------ the SPANK plugin's option values


# The plugin (spank/hai_spank.c, compiled as it is) behind the harness of test_spank_policy.py,
# started with the arguments plugstack.conf.j2 renders from the policy.

level_texts = (st.text(max_size=6) | st.sampled_from(["HIGH", "high", " HIGH", "HIGH ", "30", "+30", "030", "-1",
                                                      "-0", "auto", "AUTO ", "\u0663\u0660", "\u00b2", "--30", "3_0",
                                                      "0x1e"])
               | st.integers(-3, 60).map(str))


@settings(max_examples=80, deadline=None, derandomize=True, database=None)
@given(st.lists(level_texts, min_size=1, max_size=300))
def test_the_plugin_takes_the_priorities_hai_submit_takes(spank_plugin, texts):
    policy = default_policy()
    texts = [t for t in texts if "\x00" not in t]
    started = start_plugin(spank_plugin, plugstack_args(policy), [("priority", t) for t in texts])
    for text, c_answer in zip(texts, started.answers):
        python_answer = python_priority(policy, text)
        assert c_answer[0] == python_answer[0], text
        if c_answer[0] == "ok":
            assert c_answer == python_answer, text


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(st.dictionaries(st.text(alphabet=st.sampled_from("ABCZ_019x"), min_size=1, max_size=MAX_LEVEL_NAME + 3),
                       st.integers(-2, 1002), min_size=1, max_size=MAX_LEVELS + 3))
def test_every_ladder_a_policy_accepts_reaches_the_plugin_whole(spank_plugin, levels):
    try:
        policy = parse_policy({"levels": levels, "default_level": next(iter(levels)), "demotion": False})
    except PolicyError:
        return
    started = start_plugin(spank_plugin, plugstack_args(policy))
    assert (started.rc, started.errors) == (0, [])
    assert started.levels_arg == spank_arguments(policy)["levels_arg"]


GRACE_POLICY = parse_policy({"max_grace_seconds": 300})


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(st.lists(st.text(alphabet=st.sampled_from("0123456789 +-_x"), max_size=5) | st.integers(-2, 400).map(str),
                min_size=1, max_size=200))
def test_the_plugins_grace_is_a_decimal_in_the_range_hai_submit_takes(spank_plugin, texts):
    """--hai-grace is decimal digits, nothing else; in range as hai-submit's --grace (which
    reaches the job as its own number, never as this text)."""
    started = start_plugin(spank_plugin, plugstack_args(GRACE_POLICY), [("grace", t) for t in texts])
    for text, (kind, c_answer) in zip(texts, started.answers):
        try:
            grace = str(validate(JobRequest(script="t.py", grace=int(text), job_root="/r"), GRACE_POLICY)["grace"]) \
                if re.fullmatch(r"[0-9]+", text) else "refused"
        except RequestError:
            grace = "refused"
        assert (c_answer if kind == "ok" else kind) == grace, text


# ------------------------------------------------------------------ a request that can never run


class LimitedGroup(FakeSlurm):
    """A node group of 2 nodes whose partition takes at most 1 node and 1 hour per job."""

    def partitions(self):
        return [{**super().partitions()[0], "MaxNodes": "1", "MinNodes": "0", "MaxTime": "01:00:00"}]


@pytest.mark.parametrize("argv,needle", [
    (["-n", "2"], "node group gpu takes jobs of at most 1 node(s); ask for at most -n 1"),
    (["--time", "1:00:01"], "--time 1:00:01: node group gpu runs a job at most 01:00:00 at a time"),
    (["--time", "2-0"], "at most 01:00:00"),
    (["--time", "UNLIMITED"], "at most 01:00:00"),
    (["--time", "1:00:00\n"], "is not a Slurm time"),
])
def test_a_request_beyond_the_groups_limits_is_refused_at_submit_in_one_line(fake, monkeypatch, argv, needle):
    monkeypatch.setattr(submit_cli, "backend", LimitedGroup)
    r = CliRunner().invoke(submit_cli.main, ["--dry-run", *argv, "train.py"])
    assert r.exit_code == 2 and needle in r.output and len(r.output.strip().splitlines()) == 1, r.output


def test_a_request_within_the_groups_limits_is_taken(fake, monkeypatch):
    monkeypatch.setattr(submit_cli, "backend", LimitedGroup)
    r = CliRunner().invoke(submit_cli.main, ["--dry-run", "--time", "60", "train.py"])
    assert r.exit_code == 0 and "#SBATCH --time=60\n" in r.output, r.output


# ------------------------------------------------------------------ output cut short, usage errors

FRONT_ENDS = {"hai": ("slurm_hai.cli.front", "hai"), "hai-submit": ("slurm_hai.cli.front", "hai_submit"),
              "hai-admin": ("slurm_hai.cli.admin", "main")}


def run_into_a_closed_pipe(tool: str, *argv: str) -> subprocess.CompletedProcess:
    """`tool argv | head -0`, deterministically: stdout is a pipe nobody reads any more."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run([sys.executable, "-c", "from {} import {}; {}()".format(*FRONT_ENDS[tool], FRONT_ENDS[tool][1]), *argv],
                              stdout=write, stderr=subprocess.PIPE, text=True, cwd=REPO,
                              env={**os.environ, "HAI_POLICY": str(LOCAL_POLICY)})
    finally:
        os.close(write)


@pytest.mark.parametrize("tool,argv", [("hai", ["--help"]), ("hai-submit", ["--help"]), ("hai-admin", ["--version"]),
                                       ("hai-admin", ["check", "--json"]), ("hai", ["ckpt", "--help"])])
def test_output_cut_short_ends_quietly_with_the_status_of_sigpipe(tool, argv):
    p = run_into_a_closed_pipe(tool, *argv)
    assert (p.returncode, p.stderr) == (141, "")


@pytest.mark.parametrize("tool,argv,needle", [
    ("hai-submit", ["-n", "x", "train.py"], "Invalid value for '-n' / '--nodes': 'x': give a node count N, or a range"),
    ("hai-submit", [], "Missing argument 'SCRIPT'"),
    ("hai", ["status", "x"], "is not a job id"),
    ("hai", ["lsit"], "No such command 'lsit'"),
    ("hai-admin", ["check", "--bogus"], "No such option '--bogus'"),
])
def test_a_usage_error_is_one_line_with_where_to_look(tool, argv, needle):
    main = {"hai": __import__("slurm_hai.cli.user").cli.user.main, "hai-submit": submit_cli.main,
            "hai-admin": admin_cli.main}[tool]
    r = CliRunner().invoke(main, argv, prog_name=tool)
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
    assert needle in r.output and r.output.startswith("Error: ") and "--help)" in r.output


# ------------------------------------------------------------------ a hostile queue, end to end


def hai_over(monkeypatch, tmp_path: Path, rows: list[dict[str, str]], argv: list[str]):
    """`hai argv` with the commands backend reading a queue of `rows` from squeue."""
    from slurm_hai.cli import common, user
    from slurm_hai.slurm import cli as slurm_cli
    from slurm_hai.slurm import squeue

    class Ended:  # the Slurm command, run: what it printed
        returncode = 0

        def __init__(self, argv):
            self.out = render(argv, rows) if argv[0] == "squeue" else ""

        def communicate(self, input=None, timeout=None):
            return self.out, ""

    def start(job_ids=(), user=None):
        argv = squeue.queue_argv("~t~", job_ids, user)
        return squeue.Read("~t~", argv, Ended(argv))

    monkeypatch.setattr(slurm_cli, "_start", lambda argv, cwd=None, env=None, stdin=False: Ended(argv))
    monkeypatch.setattr(squeue, "start", start)
    monkeypatch.setattr(common, "slurm_backend", slurm_cli.CliBackend)
    monkeypatch.setenv("HAI_HOME", str(tmp_path))
    monkeypatch.setenv("HAI_POLICY", str(LOCAL_POLICY))
    return CliRunner().invoke(user.main, argv)


@pytest.mark.parametrize("release", recorded_releases())
@pytest.mark.parametrize("value", ["10000000000000000000", str(2**63), str(2**64 - 2), str(2**64 - 1), "1e19", "-1"])
def test_a_time_beyond_any_clock_is_a_record_left_out_not_a_traceback(monkeypatch, tmp_path, release, value):
    """A time_t holds less than 2**63, and squeue prints it in digits (SLURM_TIME_FORMAT=%s)."""
    rows = [{**row, "SubmitTime": value, "StartTime": value} for row in recorded_rows(release)]
    r = hai_over(monkeypatch, tmp_path, rows, ["list", "--all", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output[r.output.index("["):]) == []


@FAST
@given(st.sampled_from(recorded_releases()), st.data(),
       st.sampled_from([["list", "--all"], ["list", "--all", "--json"], ["status"], ["quota"]]))
def test_hai_over_a_queue_with_any_value_in_any_field_prints_or_says_one_line(monkeypatch, tmp_path_factory, release,
                                                                              data, argv):
    """squeue's text as the commands backend reads it, one field of one job replaced by any
    text (newlines, digits beyond any clock, a state no Slurm has, the other separators):
    `hai` prints what it can read, and a job it cannot read is left out, never a traceback."""
    rows = recorded_rows(release)
    row = data.draw(st.integers(0, len(rows) - 1))
    field = data.draw(st.sampled_from(sorted(rows[row])))
    rows[row][field] = data.draw(st.text(max_size=24) | st.sampled_from(["", "\n", "N/A", "99999999999999999999",
                                                                         "1:2:3", "(null)", "RUNNING REQUEUED"]))
    r = hai_over(monkeypatch, tmp_path_factory.mktemp("home"), rows, argv)
    assert not isinstance(r.exception, Exception) or isinstance(r.exception, SystemExit), (field, r.exception)
    if r.exit_code:
        assert len(r.output.strip().splitlines()) == 1 and r.output.startswith("Error: "), r.output
