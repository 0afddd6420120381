"""The SPANK plugin decides --hai-priority and --hai-grace as the policy does.

spank/hai_spank.c is compiled as it is behind a small harness (its Slurm calls stubbed),
started with the arguments plugstack.conf.j2 renders from `placement.spank_arguments(policy)`,
and asked what hai-submit asks `placement.request_level` and `placement.grace_of`: on
generated policies and texts, the plugin accepts exactly what they accept, with the same
canonical level and the same words when it refuses. Without a policy (no or bad levels=,
max_grace=, allow_auto=) it refuses every --hai-* value, never falling back to a ladder of its
own. Its fixed tables and bounds are limits.py's.

Derandomized (the same examples on every run). tests/unit/test_hostile_input.py uses the same
harness (`spank_plugin`, `start_plugin`).
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurm_hai.policy import limits
from slurm_hai.policy.levels import AUTO
from slurm_hai.policy.model import Policy, default_policy, parse_policy
from slurm_hai.policy.placement import Refused, grace_of, level_hint, request_level, spank_arguments
from slurm_hai.render import render

REPO = Path(__file__).resolve().parents[2]

# ------------------------------------------------------------------ the harness

SPANK_HARNESS = r"""
#include "hai_spank.c"
#include <stdio.h>

/* Slurm's functions that the option and argument code calls, as the harness's own: errors
 * are collected (one per line), options counted. The other Slurm functions the plugin uses
 * are never called here, and left unresolved. */
static char said[65536];
static int registered;
static const char *usage[2];

void slurm_error(const char *fmt, ...) {
    size_t used = strlen(said);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(said + used, sizeof(said) - used - 1, fmt, ap);
    va_end(ap);
    strcat(said, "\n");
}
spank_context_t spank_context(void) { return S_CTX_LOCAL; }
spank_err_t spank_option_register(spank_t sp, struct spank_option *opt) {
    (void) sp;
    if (registered < 2) usage[registered] = opt->usage;
    registered++;
    return ESPANK_SUCCESS;
}
const char *spank_strerror(spank_err_t err) { (void) err; return "stub"; }

static void unhex(const char *h, char *out) {
    unsigned v; size_t i = 0;
    for (; h[0] && h[1] && sscanf(h, "%2x", &v) == 1; h += 2) out[i++] = (char) v;
    out[i] = 0;
}
static void hex(const char *s) {
    if (!*s) printf("-");
    for (; *s; s++) printf("%02x", (unsigned char) *s);
}
static void answer(int rc, const char *value) {
    if (rc) { printf("refused "); hex(said); }
    else { printf("ok "); hex(value); }
    printf("\n");
}

int main(void) {
    static char line[1 << 17], word[1 << 16];
    static char *av[64];
    char buf[32];
    int ac, i, rc;

    while (fgets(line, sizeof line, stdin)) {
        char *save = NULL, *tok = strtok_r(line + 1, " \n", &save);
        said[0] = 0;
        if (line[0] == 'I') {           /* I <hex arg>...: slurm_spank_init */
            for (ac = 0; tok && ac < 64; tok = strtok_r(NULL, " \n", &save)) {
                unhex(tok, word);
                av[ac++] = strdup(word);
            }
            memset(&hai, 0, sizeof(hai));
            registered = 0;
            usage[0] = usage[1] = "";
            rc = slurm_spank_init(NULL, ac, av);
            printf("%d %d ", rc, registered);
            hex(said); printf(" "); hex(usage[0]); printf(" "); hex(usage[1]); printf("\n");
        } else if (line[0] == 'L') {    /* L: the ladder and limits as the plugin holds them */
            printf("%d %ld %d %ld %ld ", hai.policy, hai.max_grace, hai.allow_auto, hai.port_base,
                   hai.port_span);
            for (i = 0; i < hai.nlevels; i++)
                printf("%s%s:%ld", i ? "," : "", hai.levels[i].name, hai.levels[i].value);
            printf("\n");
        } else if (line[0] == 'P') {    /* P <hex>: --hai-priority */
            unhex(tok ? tok : "", word);
            hai.priority[0] = 0;
            rc = hai_opts[0].cb(0, word, 0);
            answer(rc, hai.priority);
        } else if (line[0] == 'G') {    /* G <hex>: --hai-grace */
            unhex(tok ? tok : "", word);
            hai.grace = 0;
            rc = hai_opts[1].cb(0, word, 0);
            snprintf(buf, sizeof buf, "%ld", hai.grace);
            answer(rc, buf);
        } else if (line[0] == 'C') {    /* C: the compiled bounds */
            printf("%d %d %ld %ld %ld %ld %ld\n", HAI_MAX_LEVELS, HAI_NAME_LEN, HAI_MAX_LEVEL_VALUE,
                   HAI_MIN_GRACE, HAI_MAX_GRACE, HAI_DEFAULT_PORT_BASE, HAI_DEFAULT_PORT_SPAN);
        }
        fflush(stdout);
    }
    return 0;
}
"""


@pytest.fixture(scope="module")
def spank_plugin(tmp_path_factory) -> Path:
    """hai_spank.c, compiled as it is, behind SPANK_HARNESS's line protocol."""
    if shutil.which("cc") is None or not Path("/usr/include/slurm/spank.h").exists():
        pytest.fail("the SPANK plugin tests need cc and Slurm's headers (make venv installs libslurm-dev)")
    d = tmp_path_factory.mktemp("spank")
    (d / "harness.c").write_text(SPANK_HARNESS)
    exe = d / "plugin"
    subprocess.run(["cc", "-O0", "-w", f"-I{REPO / 'spank'}", "-o", str(exe), str(d / "harness.c"),
                    "-no-pie", "-Wl,-z,lazy", "-Wl,--unresolved-symbols=ignore-all"], check=True)
    return exe


def hexed(text: str) -> str:
    return text.encode().hex() or "-"


def unhexed(text: str) -> str:
    return "" if text == "-" else bytes.fromhex(text).decode(errors="replace")


@dataclass
class Started:
    rc: int
    registered: int  # options registered
    errors: list[str]  # what slurm_spank_init logged, one per line
    priority_usage: str
    grace_usage: str
    policy: bool
    max_grace: int
    allow_auto: bool
    port_base: int
    port_span: int
    levels_arg: str  # the ladder it holds, as NAME:VALUE,...
    answers: list[tuple[str, str]]  # ("ok", value) or ("refused", error lines), one per ask


def start_plugin(exe: Path, args: list[str], asks: list[tuple[str, str]] = ()) -> Started:
    """Start the plugin with plugstack arguments `args`, then give it each (option, value) of
    `asks`: option "priority" (--hai-priority) or "grace" (--hai-grace)."""
    lines = ["I " + " ".join(hexed(a) for a in args), "L"]
    lines += [f"{ {'priority': 'P', 'grace': 'G'}[opt]} {hexed(value)}" for opt, value in asks]
    out = subprocess.run([str(exe)], input="".join(f"{line}\n" for line in lines), text=True, capture_output=True,
                         check=True).stdout.splitlines()
    rc, registered, said, usage0, usage1 = out[0].split(" ")
    policy, max_grace, allow_auto, base, span, *ladder = out[1].split(" ")
    answers = []
    for line in out[2:]:
        kind, value = line.split(" ")
        answers.append((kind, unhexed(value)))
    assert len(answers) == len(asks)
    return Started(int(rc), int(registered), unhexed(said).splitlines(), unhexed(usage0), unhexed(usage1),
                   policy == "1", int(max_grace), allow_auto == "1", int(base), int(span), "".join(ladder), answers)


def compiled_bounds(exe: Path) -> list[int]:
    out = subprocess.run([str(exe)], input="C\n", text=True, capture_output=True, check=True).stdout
    return [int(v) for v in out.split()]


def plugstack_args(policy: Policy) -> list[str]:
    """The arguments of the hai_spank.so line that `hai-admin render` writes for `policy`, as
    Slurm splits them (on white space, after the optional/required word and the path)."""
    text = render("slurm/plugstack.conf.j2", spank_so="/usr/lib/slurm/hai_spank.so", **spank_arguments(policy))
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert len(lines) == 1, text
    words = shlex.split(lines[0], posix=False)
    assert words[:2] == ["optional", "/usr/lib/slurm/hai_spank.so"], lines[0]
    return words[2:]


# ------------------------------------------------------------------ what Python decides


def python_priority(policy: Policy, text: str) -> tuple[str, str]:
    """What hai-submit -p says (cli/common.parse_priority, less its joining of a value's lines)."""
    try:
        level = request_level(policy, text)
    except Refused as e:
        return "refused", f"hai: {e}{level_hint(policy, text)}\n"  # one line of slurm_error
    return "ok", level if level == AUTO else level.name


def python_grace(policy: Policy, text: str) -> tuple[str, str]:
    try:
        return "ok", str(grace_of(policy, text))
    except Refused as e:
        return "refused", f"hai: {e}\n"  # one line of slurm_error


# ------------------------------------------------------------------ generated policies

UPPER = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
level_names = st.builds(str.__add__, st.sampled_from(UPPER),
                        st.text(alphabet=UPPER + "0123456789_", max_size=limits.MAX_LEVEL_NAME - 1)
                        | st.text(alphabet="AUTOHIGH_1", max_size=4)).filter(lambda n: n != AUTO)
level_values = st.integers(0, limits.MAX_LEVEL_VALUE) | st.sampled_from([0, 1, limits.MAX_LEVEL_VALUE])
ladders = st.lists(st.tuples(level_names, level_values), min_size=1, max_size=8,
                   unique_by=(lambda t: t[0], lambda t: t[1]))


@st.composite
def policies(draw) -> Policy:
    ladder = draw(ladders)
    grace = draw(st.integers(limits.MIN_GRACE, limits.MAX_GRACE) | st.sampled_from([limits.MIN_GRACE, 5, 300]))
    data: dict[str, object] = {"levels": dict(ladder), "default_level": draw(st.sampled_from(ladder))[0],
                               "demotion": False, "allow_auto": draw(st.booleans()), "grace_seconds": grace}
    if draw(st.booleans()):
        top = draw(st.integers(grace, limits.MAX_GRACE) | st.sampled_from([grace, limits.MAX_GRACE]))
        # as a site writes it: seconds, or a duration ("10m": the plugin once kept its own 300)
        data["max_grace_seconds"] = f"{top // 60}m" if top % 60 == 0 and draw(st.booleans()) else top
    return parse_policy(data)


SPACE = " \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f"  # what Python's str.strip() takes off ASCII text
padding = st.text(alphabet=SPACE, max_size=2)
junk = st.text(alphabet=st.characters(min_codepoint=1, max_codepoint=127), max_size=8)


@st.composite
def priority_texts(draw, policy: Policy) -> str:
    lvl = draw(st.sampled_from(policy.ladder))
    name = "".join(c.lower() if flip else c for c, flip in
                   zip(lvl.name, draw(st.lists(st.booleans(), min_size=len(lvl.name), max_size=len(lvl.name)))))
    core = draw(st.sampled_from([
        name, lvl.name, lvl.name.lower(), str(lvl.value), "0" * draw(st.integers(1, 40)) + str(lvl.value),
        "-" + str(lvl.value), "+" + str(lvl.value), "-0", "-00", "+0", "-1", "-01", "--1", "AUTO", "auto", "Auto",
        "AUTO1", "AUTP", "atuo", lvl.name + "_", lvl.name[:-1], lvl.name[1:], lvl.name[::-1], lvl.name.lower()[:-1] + "x",
        lvl.name + lvl.name, str(lvl.value + 1), f"{lvl.value}.0",
        f"0x{lvl.value:x}", "", "1e3", str(limits.MAX_LEVEL_VALUE + 1), "9" * 25, lvl.name.replace("_", "-")]))
    core = draw(st.just(core) | junk | st.integers(-3, limits.MAX_LEVEL_VALUE + 2).map(str))
    return draw(padding) + core + draw(padding)


@st.composite
def grace_texts(draw, policy: Policy) -> str:
    limit = policy.grace_limit
    n = draw(st.integers(-2, limit + 2) | st.sampled_from([0, 1, limit, limit + 1, limits.MAX_GRACE,
                                                           limits.MAX_GRACE + 1, policy.grace_seconds]))
    return draw(st.sampled_from([str(n), "0" * draw(st.integers(1, 30)) + str(n), f"+{n}", f" {n}", f"{n} ",
                                 f"{n}s", f"{n}m", f"{n}.0", "", "-0", "9" * 30, "\u0663", "1e2"])
                | junk | padding)


PROPERTY = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@PROPERTY
@given(st.data())
def test_the_plugin_started_with_a_policy_decides_as_the_policy(spank_plugin, data):
    policy = data.draw(policies(), label="policy")
    priorities = data.draw(st.lists(priority_texts(policy), min_size=20, max_size=60), label="priorities")
    graces = data.draw(st.lists(grace_texts(policy), min_size=10, max_size=40), label="graces")
    started = start_plugin(spank_plugin, plugstack_args(policy),
                           [("priority", t) for t in priorities] + [("grace", t) for t in graces])
    assert (started.rc, started.registered, started.errors) == (0, 2, [])
    assert (started.policy, started.max_grace, started.allow_auto) == (True, policy.grace_limit, policy.allow_auto)
    assert started.levels_arg == spank_arguments(policy)["levels_arg"]
    assert (started.port_base, started.port_span) == (limits.MASTER_PORT_BASE, limits.MASTER_PORT_SPAN)
    for text, c_answer in zip(priorities, started.answers[:len(priorities)]):
        assert c_answer == python_priority(policy, text), text
    for text, c_answer in zip(graces, started.answers[len(priorities):]):
        assert c_answer == python_grace(policy, text), text


def test_the_usage_shows_the_policy(spank_plugin):
    policy = parse_policy({"levels": {"GOLD": 30, "SILVER": 10, "BRONZE": 0}, "default_level": "SILVER",
                           "demotion": False, "grace_seconds": 60, "max_grace_seconds": "10m", "allow_auto": False})
    started = start_plugin(spank_plugin, plugstack_args(policy), [("grace", "600"), ("grace", "601"),
                                                                  ("priority", "auto"), ("priority", " gold ")])
    assert started.priority_usage == "HAI priority level: GOLD(30), SILVER(10), BRONZE(0), a level number"
    assert started.grace_usage == "seconds a preempted job gets to checkpoint (1-600)"
    assert [a[0] for a in started.answers] == ["ok", "refused", "refused", "ok"]
    assert started.answers[2][1] == ("hai: priority AUTO is not allowed on this cluster; use one of GOLD(30), "
                                     "SILVER(10), BRONZE(0)\n")


def test_an_unknown_level_is_told_the_nearest_name_as_hai_submit_tells_it(spank_plugin):
    """The names come from the policy, through plugstack.conf's levels= and allow_auto=."""
    metals = {"levels": {"GOLD": 30, "SILVER": 10, "BRONZE": 0}, "default_level": "SILVER", "demotion": False,
              "grace_seconds": 60, "allow_auto": True}
    policy = parse_policy(metals)
    asks = [" slivr ", "Gold1", "atuo", "zzz", "glod\u00e9"]
    started = start_plugin(spank_plugin, plugstack_args(policy), [("priority", t) for t in asks])
    told = [said.removeprefix("hai: unknown priority level ") for _, said in started.answers]
    assert told == [
        "'slivr'; use one of GOLD(30), SILVER(10), BRONZE(0) or AUTO; did you mean SILVER?\n",
        "'Gold1'; use one of GOLD(30), SILVER(10), BRONZE(0) or AUTO; did you mean GOLD?\n",
        "'atuo'; use one of GOLD(30), SILVER(10), BRONZE(0) or AUTO; did you mean AUTO?\n",
        "'zzz'; use one of GOLD(30), SILVER(10), BRONZE(0) or AUTO\n",
        "'glod\u00e9'; use one of GOLD(30), SILVER(10), BRONZE(0) or AUTO\n"]  # no guess outside ASCII
    assert [python_priority(policy, t) for t in asks] == started.answers
    no_auto = parse_policy({**metals, "allow_auto": False})  # AUTO is not offered where it is refused
    assert start_plugin(spank_plugin, plugstack_args(no_auto), [("priority", "atuo")]).answers == [
        ("refused", "hai: unknown priority level 'atuo'; use one of GOLD(30), SILVER(10), BRONZE(0) or AUTO\n")]


def test_the_largest_ladder_a_policy_may_have_reaches_the_plugin_whole(spank_plugin):
    n, width = limits.MAX_LEVELS, limits.MAX_LEVEL_NAME
    policy = parse_policy({"levels": {f"L{i:0{width - 1}d}": limits.MAX_LEVEL_VALUE - i for i in range(n)},
                           "default_level": f"L{0:0{width - 1}d}", "demotion": False,
                           "max_grace_seconds": limits.MAX_GRACE})
    last = policy.ladder[-1]
    started = start_plugin(spank_plugin, plugstack_args(policy),
                           [("priority", last.name.lower()), ("priority", str(last.value)), ("priority", "x"),
                            ("grace", str(limits.MAX_GRACE))])
    assert (started.rc, started.errors, started.levels_arg) == (0, [], spank_arguments(policy)["levels_arg"])
    assert started.answers[:2] == [("ok", last.name)] * 2 and started.answers[3] == ("ok", str(limits.MAX_GRACE))
    assert started.answers[2] == python_priority(policy, "x")  # the whole ladder in the refusal
    assert started.priority_usage.endswith(f"{last.name}({last.value}), a level number, or AUTO")


# What Python's str.strip() and str.upper() make of some non-ASCII text: "hıgh".upper() is
# "HIGH", "ﬁne".upper() is "FINE", "\xa0" is white space. The plugin refuses any text that is
# not ASCII; levels.parse_level should too.
UNICODE_TEXTS = ["h\u0131gh", "\u0131", "\u017fILVER", "pa\u00df", "\ufb01ne", "GOLD\u00a0", "\u3000GOLD",
                 "GOLD\u2028", "\u0085gold"]


def test_the_plugin_refuses_a_level_named_in_text_that_is_not_ascii(spank_plugin):
    policy = parse_policy({"levels": {"GOLD": 30, "HIGH": 20, "I": 15, "SILVER": 10, "PASS": 5, "FINE": 0},
                           "default_level": "GOLD", "demotion": False})
    started = start_plugin(spank_plugin, plugstack_args(policy), [("priority", t) for t in UNICODE_TEXTS])
    assert [a[0] for a in started.answers] == ["refused"] * len(UNICODE_TEXTS)


def test_the_policy_refuses_a_level_named_in_text_that_is_not_ascii():
    policy = parse_policy({"levels": {"GOLD": 30, "HIGH": 20, "I": 15, "SILVER": 10, "PASS": 5, "FINE": 0},
                           "default_level": "GOLD", "demotion": False})
    assert [python_priority(policy, t)[0] for t in UNICODE_TEXTS] == ["refused"] * len(UNICODE_TEXTS)


# ------------------------------------------------------------------ no policy, no ladder

GOOD = {"levels": "GOLD:30,SILVER:10", "max_grace": "600", "allow_auto": "yes"}
NO_POLICY = [
    {"levels": None},
    {"max_grace": None},
    {"allow_auto": None},
    {"levels": None, "max_grace": None, "allow_auto": None},
    {"levels": ""},
    {"levels": "GOLD"},
    {"levels": "gold:30"},
    {"levels": "GOLD:30,GOLD:10"},
    {"levels": "GOLD:30,SILVER:30"},
    {"levels": "GOLD:30,"},
    {"levels": ",GOLD:30"},
    {"levels": "GOLD:30,,SILVER:10"},
    {"levels": "GOLD:+30"},
    {"levels": "GOLD:-1"},
    {"levels": "GOLD: 30"},
    {"levels": f"GOLD:{limits.MAX_LEVEL_VALUE + 1}"},
    {"levels": "AUTO:30"},
    {"levels": "1GOLD:30"},
    {"levels": "GO-LD:30"},
    {"levels": "G" * (limits.MAX_LEVEL_NAME + 1) + ":1"},
    {"levels": ",".join(f"L{i}:{i}" for i in range(limits.MAX_LEVELS + 1))},
    {"max_grace": "0"},
    {"max_grace": str(limits.MAX_GRACE + 1)},
    {"max_grace": "10m"},
    {"max_grace": ""},
    {"max_grace": "+5"},
    {"max_grace": "-5"},
    {"allow_auto": "true"},
    {"allow_auto": "YES"},
    {"allow_auto": ""},
    {"twice": "levels=GOLD:30"},
    {"twice": "max_grace=600"},
    {"twice": "allow_auto=no"},
]


def no_policy_args(case: dict) -> list[str]:
    args = {**GOOD, **{k: v for k, v in case.items() if k != "twice"}}
    out = [f"{k}={v}" for k, v in args.items() if v is not None]
    return out + [case["twice"]] if "twice" in case else out


@pytest.mark.parametrize("case", NO_POLICY, ids=lambda c: " ".join(no_policy_args(c)) or "no arguments")
def test_a_plugin_without_a_policy_refuses_every_hai_option(spank_plugin, case):
    args = no_policy_args(case) + ["master_port_base=21000"]
    asks = [("priority", t) for t in ("GOLD", "gold", "30", "AUTO", "-1", "NORMAL", "HIGH", "EXTREME_HIGH", "")]
    asks += [("grace", t) for t in ("1", "5", "300", "600")]
    started = start_plugin(spank_plugin, args, asks)
    assert started.rc == -1 and started.registered == 2  # the options exist, to refuse
    assert len(started.errors) == 1 and "`hai-admin render`" in started.errors[0], started.errors
    assert "no policy" in started.errors[0]
    assert (started.policy, started.levels_arg, started.max_grace) == (False, "", 0)
    assert started.port_base == 21000  # what is not policy is still read
    assert "unavailable" in started.priority_usage and "unavailable" in started.grace_usage
    for (opt, value), (kind, said) in zip(asks, started.answers):
        assert kind == "refused", (opt, value)
        assert said.count("\n") == 1 and "has no policy" in said and f"--hai-{opt}" in said, said


def test_a_bad_port_argument_keeps_its_default_and_the_policy(spank_plugin):
    started = start_plugin(spank_plugin, [*no_policy_args({}), "master_port_base=x", "master_port_span=0"],
                           [("priority", "gold")])
    assert started.rc == -1 and len(started.errors) == 2 and started.policy
    assert (started.port_base, started.port_span) == (limits.MASTER_PORT_BASE, limits.MASTER_PORT_SPAN)
    assert started.answers == [("ok", "GOLD")]


def test_the_policy_of_the_default_policy_file_reaches_the_plugin(spank_plugin):
    policy = default_policy()
    started = start_plugin(spank_plugin, plugstack_args(policy), [("priority", "normal"), ("grace", "5")])
    assert (started.rc, started.errors, started.answers) == (0, [], [("ok", "NORMAL"), ("ok", "5")])


# ------------------------------------------------------------------ the bounds


def test_the_plugins_bounds_are_the_policy_limits(spank_plugin):
    """The plugin's fixed tables and range checks, as compiled, are limits.py's."""
    assert compiled_bounds(spank_plugin) == [
        limits.MAX_LEVELS, limits.MAX_LEVEL_NAME + 1, limits.MAX_LEVEL_VALUE, limits.MIN_GRACE, limits.MAX_GRACE,
        limits.MASTER_PORT_BASE, limits.MASTER_PORT_SPAN]


def test_the_plugin_has_no_ladder_or_grace_of_its_own():
    source = (REPO / "spank" / "hai_spank.c").read_text()
    for word in ("HAI_DEFAULT_LEVELS", "HAI_DEFAULT_MAX_GRACE", "EXTREME_HIGH", "NORMAL:"):
        assert word not in source, word


def test_an_oversized_option_value_is_refused_in_one_line_without_being_echoed(spank_plugin):
    """A value longer than HAI_MAX_OPTION_LEN (256 bytes) is refused unread, in one line that
    says what to give; one of 256 bytes is still decided as the policy decides it."""
    policy = default_policy()
    long_values = ["9" * 257, "0" * 300 + "5", "A" * 30_000, "5\n" * 200]
    asks = [(opt, v) for opt in ("priority", "grace") for v in long_values]
    asks += [("grace", "0" * 255 + "5"), ("priority", " " * 250 + "normal")]
    started = start_plugin(spank_plugin, plugstack_args(policy), asks)
    for (opt, value), (kind, said) in zip(asks[:-2], started.answers):
        assert kind == "refused", (opt, value[:20])
        assert said.count("\n") == 1 and f"--hai-{opt} refused: its value is longer than 256 bytes" in said
        assert len(said) < 120, said
    assert started.answers[-2:] == [("ok", "5"), ("ok", "NORMAL")]
    assert python_grace(policy, "0" * 255 + "5") == ("ok", "5")
