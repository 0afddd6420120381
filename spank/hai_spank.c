/*
 * hai_spank.c - SPANK plugin of slurm-hai (HAI Platform time-sharing on Slurm).
 *
 * Built for Slurm 22.05 (SPANK ABI is per major release: rebuild on upgrade).
 *
 * 1. OPTIONS (sbatch, salloc, srun), decided as slurm_hai/policy/placement.py
 *    decides them for hai-submit (request_level, grace_of; the plugin is
 *    started with that policy's ladder and limits, section 2):
 *      --hai-priority=LEVEL  LEVEL = a level name of the ladder (any case), the
 *                            number of a level (must equal one of the values),
 *                            or AUTO / -1 (refused when allow_auto=no).
 *                            Surrounding white space is ignored (what
 *                            Python's str.strip() removes from ASCII text);
 *                            text with any byte outside ASCII is refused.
 *      --hai-grace=SECONDS   whole seconds in decimal digits, 1 (MIN_GRACE) to
 *                            max_grace.
 *    A bad value is refused at submission (callback returns -1 with one
 *    "hai: ..." error line, the words of placement.REFUSALS; Slurm adds its own
 *    "Invalid --hai-... argument" line). An unknown level's line ends, as
 *    hai-submit's -p does (placement.level_hint), with the nearest of the
 *    ladder's names (or AUTO, when allowed): "; did you mean HIGH?". In sbatch/salloc/srun the canonical
 *    value goes to the controller as job control env
 *    (spank_job_control_setenv):
 *      HAI_PRIORITY=<LEVEL NAME in upper case, or AUTO>, HAI_GRACE=<seconds>.
 *    Seen on 22.05: job_submit.lua gets them in job_desc.spank_job_env as
 *    "HAI_PRIORITY=HIGH" and "HAI_GRACE=60", without the SPANK_ prefix (the
 *    table is indexed from 0: use pairs); prolog/epilog get SPANK_HAI_*.
 *    In slurmstepd (remote) the option callbacks never fail: values were
 *    validated at submission and a changed ladder must not kill running jobs.
 *
 * 2. PLUGIN ARGUMENTS (plugstack.conf), rendered from the site's policy by
 *    `hai-admin render` (templates/slurm/plugstack.conf.j2, from
 *    slurm_hai/policy/placement.py spank_arguments). The policy's three are
 *    required; the plugin has no ladder and no grace limit of its own:
 *      levels=GOLD:30,SILVER:10,...  the ladder: 1 to 32 (MAX_LEVELS) distinct
 *                     names [A-Z][A-Z0-9_]* of at most 31 (MAX_LEVEL_NAME)
 *                     characters, not AUTO, with distinct values 0 to 1000
 *                     (MAX_LEVEL_VALUE)
 *      max_grace=N    the policy's grace limit (max_grace_seconds, else
 *                     grace_seconds), 1 to 3600 (MIN_GRACE, MAX_GRACE)
 *      allow_auto=yes|no  whether --hai-priority may be AUTO
 *    When one of them is missing, bad or given twice the plugin logs one error
 *    (run `hai-admin render` and install its plugstack.conf), still registers
 *    its options, and refuses every --hai-priority and --hai-grace ("has no
 *    policy"); the environment contract (section 3) is set as usual.
 *    Not policy, optional (defaults MASTER_PORT_BASE, MASTER_PORT_SPAN of
 *    slurm_hai/policy/limits.py; a bad one is logged and its default kept):
 *      master_port_base=20000  master_port_span=10000
 *    The bounds above are limits.py's; tests/unit/test_spank_policy.py keeps
 *    them equal and checks, on generated policies, that this plugin accepts
 *    exactly what placement.py accepts.
 *
 * 3. HAI ENVIRONMENT CONTRACT, set in every task of every step (remote context:
 *    slurm_spank_task_init, which sees the task's final environment). Rules:
 *    a. extern step: nothing. If the step env has HAI_CONTRACT with a value
 *       other than "spank" (a launcher owns the contract): leave everything.
 *       HAI_CONTRACT=spank is our own mark inherited from an outer step (e.g.
 *       the batch script running srun): recompute and overwrite.
 *    b. RANK = NODE_RANK = node rank within the step (S_JOB_NODEID).
 *    c. WORLD_SIZE = number of nodes of the step (S_JOB_NNODES). The batch
 *       step (the job script, on the job's first node) reports 0 there: it
 *       gets the job's node count (SLURM_JOB_NUM_NODES, else SLURM_NNODES),
 *       the world its launcher starts with srun.
 *    d. master node = first host of the step's node list: SLURM_STEP_NODELIST,
 *       or SLURM_JOB_NODELIST for the batch step (and when the former is
 *       missing).
 *    e. MASTER_IP = MASTER_ADDR = IPv4 address of the master node: its NodeAddr
 *       in Slurm's node table (node names need not be in DNS; NodeAddr is what
 *       slurmd itself is reached at); getaddrinfo(AF_INET) only when NodeAddr is
 *       a host name (NodeAddr unset: the node name).
 *       Where: srun (local context, slurm_spank_local_user_init) asks the
 *       controller once per srun (step layout + node record: 2 small RPCs,
 *       independent of the node count) and exports HAI_MASTER_NODE and
 *       HAI_MASTER_IP to the tasks (up to 22.05; from 25.11 the step does
 *       not exist yet at that point, and the tasks look it up). slurmstepd uses HAI_MASTER_IP when
 *       HAI_MASTER_NODE equals the master node of its step; otherwise (batch
 *       step, no srun, stale value inherited from an outer step) task_init
 *       looks the node up itself (1 RPC per task of that step; batch step:
 *       1 per run). Never in user_init: from Slurm 23.x slurmstepd holds its
 *       auth lock around that callback (privileges dropped), and an RPC
 *       there is fatal to the step ("auth_g_create: pthread_rwlock_rdlock():
 *       Resource deadlock avoided", seen on 25.11); task_init runs with the
 *       lock released (slurmstepd/task.c, "test7.21").
 *    f. MASTER_PORT = HAI_MASTER_PORT from the step env when set (1..65535),
 *       else master_port_base + (SLURM_JOB_ID % master_port_span).
 *    g. HAI_RESTART_COUNT = S_SLURM_RESTART_COUNT (0 before the first
 *       restart), or SLURM_RESTART_COUNT from the task env when larger:
 *       Slurm 22.05 leaves the item at 0 even after a requeue (seen), while
 *       the task env of the batch script and of its srun steps has the count.
 *    h. HAI_MASTER_NODE and HAI_MASTER_IP are set too; HAI_CONTRACT=spank is
 *       set last, only when every value above could be computed. On failure
 *       an inherited HAI_CONTRACT=spank is removed (so a launcher recomputes
 *       instead of trusting stale values) and an error is logged.
 *
 * 4. Listed as "optional" in plugstack.conf: Slurm then ignores a failing
 *    callback (it only logs our error), so a broken lookup never fails a job;
 *    only a bad --hai-* value on the command line is fatal (by design), and
 *    any --hai-* value while plugstack.conf gives no policy (section 2).
 *
 * The plugin calls Slurm API functions (slurm_load_node_single, hostlists,
 * ...) that srun, sbatch, salloc and slurmstepd already export from
 * libslurmfull; it is deliberately not linked against libslurm.
 */

#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <netdb.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/types.h>

#include <slurm/slurm.h>
#include <slurm/slurm_errno.h>
#include <slurm/spank.h>
#include <slurm/slurm_version.h>

/* Slurm 23.02 made hostlist_t the struct itself (a pointer before). */
#if SLURM_VERSION_NUMBER >= SLURM_VERSION_NUM(23, 2, 0)
typedef hostlist_t *hai_hostlist_t;
#else
typedef hostlist_t hai_hostlist_t;
#endif

SPANK_PLUGIN(hai_spank, 1);

/* The bounds of slurm_hai/policy/limits.py (tests/unit/test_spank_policy.py
 * keeps them equal). */
#define HAI_MAX_LEVELS 32		/* MAX_LEVELS */
#define HAI_NAME_LEN 32			/* MAX_LEVEL_NAME + 1 */
#define HAI_MAX_LEVEL_VALUE 1000L	/* MAX_LEVEL_VALUE */
#define HAI_MIN_GRACE 1L		/* MIN_GRACE */
#define HAI_MAX_GRACE 3600L		/* MAX_GRACE */
/* Not policy: the rendezvous ports when plugstack.conf names none. */
#define HAI_DEFAULT_PORT_BASE 20000L	/* MASTER_PORT_BASE */
#define HAI_DEFAULT_PORT_SPAN 10000L	/* MASTER_PORT_SPAN */
/* The ladder as users read it: "NAME(1000), " at most per level. */
#define HAI_LIST_LEN (HAI_MAX_LEVELS * (HAI_NAME_LEN + 8))
/* What the plugin takes from a user, at most: an option value (a level name
 * is 31 characters, a grace 4 digits: a longer one is refused in one line,
 * unread), a variable of the task's environment that the job may set (longer:
 * treated as unset or refused, never grown into), and of a value the logs
 * show (non-printable bytes as '?': one log line per error, whatever it holds). */
#define HAI_MAX_OPTION_LEN 256
#define HAI_MAX_ENV_LEN 256
#define HAI_MAX_NODELIST_LEN (1 << 20)
#define HAI_SHOWN_LEN 68
#define HAI_CONTRACT_MARK "spank"
#define HAI_NO_POLICY "run `hai-admin render` and install the plugstack.conf " \
	"it writes"

struct hai_level {
	char name[HAI_NAME_LEN];
	long value;
};

/* The only state: plugin arguments and the values of our two options. */
static struct {
	int policy;			/* levels, max_grace, allow_auto valid */
	struct hai_level levels[HAI_MAX_LEVELS];
	int nlevels;
	long max_grace;
	int allow_auto;
	long port_base;
	long port_span;
	char priority[HAI_NAME_LEN];	/* canonical --hai-priority, "" unset */
	long grace;			/* --hai-grace, 0 unset */
	char priority_usage[HAI_LIST_LEN + 64];
	char grace_usage[128];
} hai;

/* ------------------------------------------------------------------------ */
/* small parsers                                                             */

/* Strict decimal integer in [lo, hi]; 0 on success. */
static int _parse_long(const char *s, long lo, long hi, long *out)
{
	char *end = NULL;
	long v;

	if (!s || !*s || isspace((unsigned char) *s))
		return -1;
	errno = 0;
	v = strtol(s, &end, 10);
	if (errno || !end || *end != '\0' || v < lo || v > hi)
		return -1;
	*out = v;
	return 0;
}

/*
 * The first len bytes of s as decimal digits (at least one, no sign, leading
 * zeros allowed, as Python's str.isdigit on ASCII) in [lo, hi]; 0 on success.
 * Independent of the locale.
 */
static int _parse_digits(const char *s, size_t len, long lo, long hi,
			 long *out)
{
	long v = 0;
	size_t i;

	if (!s || !len)
		return -1;
	for (i = 0; i < len; i++) {
		if (s[i] < '0' || s[i] > '9')
			return -1;
		if (v <= hi)	/* past hi: only the digits are checked */
			v = v * 10 + (s[i] - '0');
	}
	if (v < lo || v > hi)
		return -1;
	*out = v;
	return 0;
}

/* White space Python's str.strip() removes from ASCII text. */
static int _is_space(char c)
{
	return c == ' ' || (c >= '\t' && c <= '\r') ||
	       (c >= '\x1c' && c <= '\x1f');
}

static int _is_ascii(const char *s)
{
	for (; *s; s++)
		if ((unsigned char) *s > 0x7f)
			return 0;
	return 1;
}

static char _upper(char c)
{
	return (c >= 'a' && c <= 'z') ? (char) (c - 'a' + 'A') : c;
}

/* Whether the len bytes of word name level `name` (ASCII, any case). */
static int _names(const char *word, size_t len, const char *name)
{
	size_t i;

	if (strlen(name) != len)
		return 0;
	for (i = 0; i < len; i++)
		if (_upper(word[i]) != name[i])
			return 0;
	return 1;
}

/*
 * Parse "NAME:VALUE,NAME:VALUE,..." (the policy's ladder, as
 * placement.spank_arguments writes it) into a ladder; 0 on success.
 */
static int _parse_levels(const char *spec, struct hai_level *lv, int *n)
{
	const char *item = spec;
	int count = 0;

	if (!spec || !*spec)
		return -1;
	for (;;) {
		const char *colon = strchr(item, ':');
		const char *end = strchr(item, ',');
		size_t len, i;
		long value;
		int j;

		if (!end)
			end = item + strlen(item);
		if (!colon || colon > end || colon == item ||
		    count >= HAI_MAX_LEVELS)
			return -1;
		len = (size_t) (colon - item);
		if (len >= HAI_NAME_LEN || item[0] < 'A' || item[0] > 'Z')
			return -1;
		for (i = 0; i < len; i++) {
			char c = item[i];
			if (!(c >= 'A' && c <= 'Z') && !(c >= '0' && c <= '9') &&
			    c != '_')
				return -1;
			lv[count].name[i] = c;
		}
		lv[count].name[len] = '\0';
		if (_parse_digits(colon + 1, (size_t) (end - colon - 1), 0,
				  HAI_MAX_LEVEL_VALUE, &value))
			return -1;
		lv[count].value = value;
		if (!strcmp(lv[count].name, "AUTO"))
			return -1;
		for (j = 0; j < count; j++)
			if (!strcmp(lv[j].name, lv[count].name) ||
			    lv[j].value == value)
				return -1;
		count++;
		if (!*end)
			break;
		item = end + 1;
	}
	*n = count;
	return 0;
}

/*
 * The canonical name of a --hai-priority value: a level's name, "AUTO", or
 * NULL when the ladder has no such level. What placement.request_level takes
 * (levels.parse_level): surrounding white space is ignored; a name in any
 * case, AUTO or -1, or a level's number in decimal digits with an optional
 * '-' (no '+'). Whether AUTO is allowed is the caller's to check.
 */
static const char *_canonical_level(const char *arg)
{
	const char *digits;
	size_t len;
	long value;
	int i;

	if (!arg || !_is_ascii(arg))
		return NULL;
	while (_is_space(*arg))
		arg++;
	for (len = strlen(arg); len && _is_space(arg[len - 1]);)
		len--;
	if (!len)
		return NULL;
	if (_names(arg, len, "AUTO") || (len == 2 && !strncmp(arg, "-1", 2)))
		return "AUTO";
	for (i = 0; i < hai.nlevels; i++)
		if (_names(arg, len, hai.levels[i].name))
			return hai.levels[i].name;
	/* -0 is 0 (Python's int); any other negative number names no level */
	digits = arg[0] == '-' ? arg + 1 : arg;
	if (_parse_digits(digits, len - (size_t) (digits - arg), 0,
			  HAI_MAX_LEVEL_VALUE, &value) ||
	    (digits != arg && value != 0))
		return NULL;
	for (i = 0; i < hai.nlevels; i++)
		if (hai.levels[i].value == value)
			return hai.levels[i].name;
	return NULL;
}

/* The ladder as users may name it (placement.choices): "GOLD(30), ..." */
static void _level_list(char *buf, size_t len)
{
	size_t used = 0;
	int i;

	buf[0] = '\0';
	for (i = 0; i < hai.nlevels && used < len; i++) {
		int n = snprintf(buf + used, len - used, "%s%s(%ld)",
				 i ? ", " : "", hai.levels[i].name,
				 hai.levels[i].value);
		if (n < 0)
			break;
		used += (size_t) n;
	}
}

/*
 * The characters that the matching blocks of a[alo..ahi) and b[blo..bhi) hold,
 * as difflib's SequenceMatcher(a=a, b=b).get_matching_blocks() finds them: the
 * longest common block (of equal ones, the first to end in a, then in b),
 * then the same on each side of it. No junk: b is at most HAI_MAX_OPTION_LEN
 * bytes, and a b long enough for difflib's autojunk (200) matches no level's
 * name near enough anyway. Runs fit a byte: a is a level's name.
 */
static size_t _matched(const char *a, size_t alo, size_t ahi, const char *b,
		       size_t blo, size_t bhi)
{
	unsigned char run[2][HAI_MAX_OPTION_LEN];
	unsigned char *prev = run[0], *cur = run[1], *t;
	size_t i, j, besti = alo, bestj = blo, best = 0;

	memset(run[0], 0, sizeof(run[0]));
	for (i = alo; i < ahi; i++) {
		for (j = blo; j < bhi; j++) {
			cur[j] = a[i] != b[j] ? 0 : (unsigned char)
				 ((j > blo ? prev[j - 1] : 0) + 1);
			if (cur[j] > best) {
				best = cur[j];
				besti = i + 1 - best;
				bestj = j + 1 - best;
			}
		}
		t = prev;
		prev = cur;
		cur = t;
	}
	if (!best)
		return 0;
	return best + _matched(a, alo, besti, b, blo, bestj) +
	       _matched(a, besti + best, ahi, b, bestj + best, bhi);
}

/*
 * The level (or AUTO, where allowed) nearest to the len bytes of word (ASCII,
 * stripped, at most HAI_MAX_OPTION_LEN), as placement.closest finds it
 * (difflib's get_close_matches, n=1): ratio 2*M/T, M what _matched finds in
 * (name, WORD in upper case), T both lengths; the highest ratio of at least
 * NEAR_MISS (0.6), of equal ones the name last in strcmp order; NULL when none
 * comes that near. Ratios are compared in integers: Python's floats of two
 * ratios are equal exactly when the fractions are.
 */
static const char *_closest(const char *word, size_t len)
{
	char upper[HAI_MAX_OPTION_LEN];
	const char *best = NULL, *name;
	size_t i, m, t, best_m = 0, best_t = 1;
	int k;

	for (i = 0; i < len; i++)
		upper[i] = _upper(word[i]);
	for (k = 0; k < hai.nlevels + (hai.allow_auto ? 1 : 0); k++) {
		name = k < hai.nlevels ? hai.levels[k].name : "AUTO";
		t = strlen(name) + len;
		m = _matched(name, 0, strlen(name), upper, 0, len);
		if (10 * m < 3 * t)	/* 2m/t < 0.6 */
			continue;
		if (!best || m * best_t > best_m * t ||
		    (m * best_t == best_m * t && strcmp(name, best) > 0)) {
			best = name;
			best_m = m;
			best_t = t;
		}
	}
	return best;
}

/* ------------------------------------------------------------------------ */
/* options                                                                   */

static int _in_remote(void)
{
	return spank_context() == S_CTX_REMOTE;
}

static int _no_policy(const char *opt)
{
	slurm_error("hai: --%s refused: the slurm-hai SPANK plugin has no "
		    "policy (plugstack.conf gives hai_spank.so no valid "
		    "levels=, max_grace=, allow_auto=); the admin must %s",
		    opt, HAI_NO_POLICY);
	return -1;
}

/* Refuses (one line, -1) an option value longer than HAI_MAX_OPTION_LEN;
 * looks at no more of it than that. */
static int _too_long(const char *opt, const char *optarg)
{
	if (!optarg || strnlen(optarg, HAI_MAX_OPTION_LEN + 1) <=
	    HAI_MAX_OPTION_LEN)
		return 0;
	slurm_error("hai: --%s refused: its value is longer than %d bytes; "
		    "give a %s", opt, HAI_MAX_OPTION_LEN,
		    strcmp(opt, "hai-grace") ? "level's name or number" :
		    "number of seconds");
	return -1;
}

static int _opt_priority(int val, const char *optarg, int remote)
{
	const char *name;
	char list[HAI_LIST_LEN];

	(void) val;
	if (remote || _in_remote())
		return 0;	/* validated at submission */
	if (!hai.policy)
		return _no_policy("hai-priority");
	if (_too_long("hai-priority", optarg))
		return -1;
	name = _canonical_level(optarg);
	_level_list(list, sizeof(list));
	if (!name) {
		char shown[256];
		const char *a = optarg ? optarg : "", *near;
		size_t len;

		while (_is_space(*a))
			a++;
		len = strlen(a);
		while (len && _is_space(a[len - 1]))
			len--;
		snprintf(shown, sizeof(shown), "%.*s", (int) len, a);
		near = _is_ascii(a) ? _closest(a, len) : NULL;
		slurm_error("hai: unknown priority level '%s'; use one of %s "
			    "or AUTO%s%s%s", shown, list,
			    near ? "; did you mean " : "", near ? near : "",
			    near ? "?" : "");
		return -1;
	}
	if (!strcmp(name, "AUTO") && !hai.allow_auto) {
		slurm_error("hai: priority AUTO is not allowed on this "
			    "cluster; use one of %s", list);
		return -1;
	}
	snprintf(hai.priority, sizeof(hai.priority), "%s", name);
	return 0;
}

static int _opt_grace(int val, const char *optarg, int remote)
{
	long grace;

	(void) val;
	if (remote || _in_remote())
		return 0;	/* validated at submission */
	if (!hai.policy)
		return _no_policy("hai-grace");
	if (_too_long("hai-grace", optarg))
		return -1;
	if (!optarg || _parse_digits(optarg, strlen(optarg), HAI_MIN_GRACE,
				     hai.max_grace, &grace)) {
		slurm_error("hai: grace '%s' is not allowed on this cluster; "
			    "ask for whole seconds from %ld to %ld (the "
			    "policy's max_grace_seconds)", optarg ? optarg : "",
			    HAI_MIN_GRACE, hai.max_grace);
		return -1;
	}
	hai.grace = grace;
	return 0;
}

static struct spank_option hai_opts[] = {
	{ "hai-priority", "LEVEL", NULL, 1, 0, _opt_priority },
	{ "hai-grace", "SECONDS", NULL, 1, 0, _opt_grace },
	SPANK_OPTIONS_TABLE_END
};

/* ------------------------------------------------------------------------ */
/* plugin arguments                                                          */

/* Add one problem (printf format) to the list in buf. */
__attribute__ ((format (printf, 3, 4)))
static void _problem(char *buf, size_t len, const char *fmt, ...)
{
	size_t used = strlen(buf);
	va_list ap;

	if (used + 2 >= len)
		return;
	if (used) {
		memcpy(buf + used, "; ", 3);
		used += 2;
	}
	va_start(ap, fmt);
	vsnprintf(buf + used, len - used, fmt, ap);
	va_end(ap);
}

static int _parse_args(int ac, char **av)
{
	char problems[512] = "";
	int seen_levels = 0, seen_grace = 0, seen_auto = 0;
	int i, rc = 0;

	memset(hai.levels, 0, sizeof(hai.levels));
	hai.policy = 0;
	hai.nlevels = 0;
	hai.max_grace = 0;
	hai.allow_auto = 0;
	hai.port_base = HAI_DEFAULT_PORT_BASE;
	hai.port_span = HAI_DEFAULT_PORT_SPAN;

	for (i = 0; i < ac; i++) {
		const char *a = av[i];
		long v;

		if (!strncmp(a, "levels=", 7)) {
			if (seen_levels++) {
				_problem(problems, sizeof(problems),
					 "levels= given twice");
				hai.nlevels = 0;
			} else if (_parse_levels(a + 7, hai.levels,
						 &hai.nlevels)) {
				_problem(problems, sizeof(problems),
					 "bad levels= (want NAME:VALUE,... with "
					 "1-%d distinct names [A-Z][A-Z0-9_]* "
					 "of at most %d characters, values "
					 "0-%ld)", HAI_MAX_LEVELS,
					 HAI_NAME_LEN - 1, HAI_MAX_LEVEL_VALUE);
				hai.nlevels = 0;
			}
		} else if (!strncmp(a, "max_grace=", 10)) {
			if (seen_grace++) {
				_problem(problems, sizeof(problems),
					 "max_grace= given twice");
				hai.max_grace = 0;
			} else if (_parse_digits(a + 10, strlen(a + 10),
						 HAI_MIN_GRACE, HAI_MAX_GRACE,
						 &v)) {
				_problem(problems, sizeof(problems),
					 "bad '%s' (want %ld-%ld)", a,
					 HAI_MIN_GRACE, HAI_MAX_GRACE);
			} else {
				hai.max_grace = v;
			}
		} else if (!strncmp(a, "allow_auto=", 11)) {
			if (seen_auto++) {
				_problem(problems, sizeof(problems),
					 "allow_auto= given twice");
			} else if (!strcmp(a + 11, "yes")) {
				hai.allow_auto = 1;
			} else if (!strcmp(a + 11, "no")) {
				hai.allow_auto = 0;
			} else {
				_problem(problems, sizeof(problems),
					 "bad '%s' (want yes or no)", a);
			}
		} else if (!strncmp(a, "master_port_base=", 17)) {
			if (_parse_long(a + 17, 1, 65535, &v)) {
				slurm_error("hai: bad plugin argument '%s'; "
					    "using master_port_base=%ld", a,
					    hai.port_base);
				rc = -1;
				continue;
			}
			hai.port_base = v;
		} else if (!strncmp(a, "master_port_span=", 17)) {
			if (_parse_long(a + 17, 1, 65535, &v)) {
				slurm_error("hai: bad plugin argument '%s'; "
					    "using master_port_span=%ld", a,
					    hai.port_span);
				rc = -1;
				continue;
			}
			hai.port_span = v;
		} else {
			slurm_error("hai: unknown plugin argument '%s'", a);
			rc = -1;
		}
	}
	if (!seen_levels)
		_problem(problems, sizeof(problems), "no levels=");
	if (!seen_grace)
		_problem(problems, sizeof(problems), "no max_grace=");
	if (!seen_auto)
		_problem(problems, sizeof(problems), "no allow_auto=");
	if (problems[0]) {
		slurm_error("hai: plugstack.conf gives hai_spank.so no policy "
			    "(%s): --hai-priority and --hai-grace are refused; "
			    "%s", problems, HAI_NO_POLICY);
		hai.nlevels = 0;
		hai.max_grace = 0;
		hai.allow_auto = 0;
		rc = -1;
	} else {
		hai.policy = 1;
	}
	if (hai.port_base + hai.port_span - 1 > 65535) {
		slurm_error("hai: master_port_base=%ld + master_port_span=%ld "
			    "exceeds port 65535; using master_port_span=1",
			    hai.port_base, hai.port_span);
		hai.port_span = 1;
		rc = -1;
	}
	return rc;
}

int slurm_spank_init(spank_t sp, int ac, char **av)
{
	char list[HAI_LIST_LEN];
	int rc, i;

	rc = _parse_args(ac, av);

	if (hai.policy) {
		_level_list(list, sizeof(list));
		snprintf(hai.priority_usage, sizeof(hai.priority_usage),
			 "HAI priority level: %s, a level number%s", list,
			 hai.allow_auto ? ", or AUTO" : "");
		snprintf(hai.grace_usage, sizeof(hai.grace_usage),
			 "seconds a preempted job gets to checkpoint (%ld-%ld)",
			 HAI_MIN_GRACE, hai.max_grace);
	} else {
		snprintf(hai.priority_usage, sizeof(hai.priority_usage),
			 "HAI priority level (unavailable: hai_spank.so has "
			 "no policy in plugstack.conf)");
		snprintf(hai.grace_usage, sizeof(hai.grace_usage),
			 "seconds a preempted job gets to checkpoint "
			 "(unavailable: hai_spank.so has no policy)");
	}
	hai_opts[0].usage = hai.priority_usage;
	hai_opts[1].usage = hai.grace_usage;

	for (i = 0; hai_opts[i].name; i++) {
		spank_err_t err = spank_option_register(sp, &hai_opts[i]);
		if (err != ESPANK_SUCCESS) {
			slurm_error("hai: cannot register --%s: %s",
				    hai_opts[i].name, spank_strerror(err));
			rc = -1;
		}
	}
	return rc;
}

/* sbatch / salloc / srun: pass the options to job_submit.lua. */
int slurm_spank_init_post_opt(spank_t sp, int ac, char **av)
{
	spank_context_t ctx = spank_context();
	spank_err_t err;
	char buf[32];

	(void) ac;
	(void) av;
	if (ctx != S_CTX_LOCAL && ctx != S_CTX_ALLOCATOR)
		return 0;

	if (hai.priority[0]) {
		err = spank_job_control_setenv(sp, "HAI_PRIORITY",
					       hai.priority, 1);
		if (err != ESPANK_SUCCESS) {
			slurm_error("hai: cannot pass --hai-priority to the "
				    "controller: %s", spank_strerror(err));
			return -1;
		}
	}
	if (hai.grace > 0) {
		snprintf(buf, sizeof(buf), "%ld", hai.grace);
		err = spank_job_control_setenv(sp, "HAI_GRACE", buf, 1);
		if (err != ESPANK_SUCCESS) {
			slurm_error("hai: cannot pass --hai-grace to the "
				    "controller: %s", spank_strerror(err));
			return -1;
		}
	}
	return 0;
}

/* ------------------------------------------------------------------------ */
/* master node and address                                                   */

/* First host of a Slurm host list, malloc'ed (free()), or NULL. */
static char *_first_host(const char *nodelist)
{
	hai_hostlist_t hl;
	char *host;

	if (!nodelist || !*nodelist)
		return NULL;
	if (!(hl = slurm_hostlist_create(nodelist)))
		return NULL;
	host = slurm_hostlist_shift(hl);
	slurm_hostlist_destroy(hl);
	return host;
}

static int _is_ipv4(const char *s)
{
	struct in_addr a;

	return s && inet_pton(AF_INET, s, &a) == 1;
}

/* IPv4 text of addr (an IPv4 literal or a host name); 0 on success. */
static int _to_ipv4(const char *addr, char *ip, size_t len)
{
	struct addrinfo hints, *res = NULL;
	int rc;

	if (_is_ipv4(addr)) {
		if (strlen(addr) >= len)
			return -1;
		snprintf(ip, len, "%s", addr);
		return 0;
	}
	memset(&hints, 0, sizeof(hints));
	hints.ai_family = AF_INET;
	hints.ai_socktype = SOCK_STREAM;
	rc = getaddrinfo(addr, NULL, &hints, &res);
	if (rc != 0 || !res) {
		slurm_error("hai: cannot resolve '%s' to IPv4: %s", addr,
			    rc ? gai_strerror(rc) : "no address");
		if (res)
			freeaddrinfo(res);
		return -1;
	}
	rc = inet_ntop(AF_INET,
		       &((struct sockaddr_in *) res->ai_addr)->sin_addr,
		       ip, (socklen_t) len) ? 0 : -1;
	freeaddrinfo(res);
	if (rc)
		slurm_error("hai: cannot format the address of '%s'", addr);
	return rc;
}

/* IPv4 of a node through Slurm's node table (NodeAddr); 0 on success. */
static int _node_ipv4(const char *node, char *ip, size_t len)
{
	node_info_msg_t *msg = NULL;
	const char *addr;
	char *name;
	int rc;

	if (!(name = strdup(node)))
		return -1;
	rc = slurm_load_node_single(&msg, name, SHOW_ALL);
	free(name);
	if (rc != SLURM_SUCCESS || !msg || msg->record_count < 1 ||
	    !msg->node_array) {
		slurm_error("hai: cannot look up node %s in Slurm: %s", node,
			    rc != SLURM_SUCCESS ?
			    slurm_strerror(errno) : "not found");
		if (msg)
			slurm_free_node_info_msg(msg);
		return -1;
	}
	addr = msg->node_array[0].node_addr;
	if (!addr || !*addr)
		addr = node;
	rc = _to_ipv4(addr, ip, len);
	slurm_free_node_info_msg(msg);
	return rc;
}

/* srun: resolve the step's master once and export it to the tasks. */
int slurm_spank_local_user_init(spank_t sp, int ac, char **av)
{
	slurm_step_layout_t *layout;
	slurm_step_id_t id;
	uint32_t jobid = 0, stepid = 0;
	spank_err_t err;
	char ip[INET_ADDRSTRLEN];
	char *master;
	int rc;

	(void) ac;
	(void) av;
	if (spank_context() != S_CTX_LOCAL)
		return 0;

	if ((err = spank_get_item(sp, S_JOB_ID, &jobid)) != ESPANK_SUCCESS ||
	    (err = spank_get_item(sp, S_JOB_STEPID, &stepid)) !=
	    ESPANK_SUCCESS) {
		slurm_error("hai: cannot get the job step id: %s",
			    spank_strerror(err));
		return -1;
	}
	id.job_id = jobid;
	id.step_het_comp = NO_VAL;
	id.step_id = stepid;
	if (!(layout = slurm_job_step_layout_get(&id))) {
		/* Slurm 25.11 creates the step only after this callback:
		 * task_init then looks the master up on the nodes. */
		slurm_debug("hai: no layout of step %u.%u yet (%s); the "
			    "tasks look up the master themselves", jobid,
			    stepid, slurm_strerror(errno));
		return 0;
	}
	master = _first_host(layout->node_list);
	slurm_job_step_layout_free(layout);
	if (!master) {
		slurm_error("hai: step %u.%u has no first node", jobid,
			    stepid);
		return -1;
	}
	rc = _node_ipv4(master, ip, sizeof(ip));
	if (!rc && (setenv("HAI_MASTER_NODE", master, 1) ||
		    setenv("HAI_MASTER_IP", ip, 1))) {
		slurm_error("hai: setenv: %s", strerror(errno));
		rc = -1;
	}
	free(master);
	return rc ? -1 : 0;
}

/* ------------------------------------------------------------------------ */
/* remote: the environment contract                                          */

/*
 * Copy of variable var of the step env, of at most max bytes, into a
 * malloc'ed string (*out). Returns ESPANK_SUCCESS, ESPANK_ENV_NOEXIST (*out
 * NULL), ESPANK_NOSPACE for a longer value, or an error.
 */
static spank_err_t _getenv_dup(spank_t sp, const char *var, size_t max,
			       char **out)
{
	size_t len = max < 256 ? max + 1 : 256;
	char *buf = NULL;
	spank_err_t err;

	*out = NULL;
	for (;;) {
		char *nbuf = realloc(buf, len);
		if (!nbuf) {
			free(buf);
			return ESPANK_ERROR;
		}
		buf = nbuf;
		err = spank_getenv(sp, var, buf, (int) len);
		if (err != ESPANK_NOSPACE || len > max)
			break;
		len = len * 2 > max + 1 ? max + 1 : len * 2;
	}
	if (err == ESPANK_SUCCESS)
		*out = buf;
	else
		free(buf);
	return err;
}

struct hai_contract {
	uint32_t rank, world, restarts;
	long port;
	char *master;			/* malloc'ed */
	char ip[INET_ADDRSTRLEN];
};

/* Set one variable; logs and returns -1 on failure. */
static int _set(spank_t sp, const char *var, const char *val)
{
	spank_err_t err = spank_setenv(sp, var, val, 1);

	if (err != ESPANK_SUCCESS) {
		slurm_error("hai: cannot set %s: %s", var,
			    spank_strerror(err));
		return -1;
	}
	return 0;
}

static int _set_num(spank_t sp, const char *var, long val)
{
	char buf[32];

	snprintf(buf, sizeof(buf), "%ld", val);
	return _set(sp, var, buf);
}

/* Up to HAI_SHOWN_LEN - 4 bytes of s for a log line, each byte outside
 * printable ASCII as '?', "..." after a cut: a value the job set cannot
 * write a line of its own into slurmd's log. */
static const char *_shown(const char *s, char *buf)
{
	size_t i;

	for (i = 0; s && s[i] && i < HAI_SHOWN_LEN - 4; i++)
		buf[i] = (s[i] >= ' ' && s[i] <= '~') ? s[i] : '?';
	buf[i] = '\0';
	if (s && s[i])
		memcpy(buf + i, "...", 4);
	return buf;
}

/*
 * d/e. The step's master node (malloc'ed, *master) and its IPv4 (ip):
 * HAI_MASTER_IP from the env when HAI_MASTER_NODE names this master, else a
 * lookup in Slurm's node table.
 */
static int _master(spank_t sp, uint32_t jobid, uint32_t stepid,
		   char **master, char *ip, size_t len)
{
	char *nodelist = NULL, *env_node = NULL, *env_ip = NULL;
	char shown[HAI_SHOWN_LEN];
	spank_err_t err = ESPANK_ENV_NOEXIST;
	int rc = -1;

	*master = NULL;
	if (stepid != SLURM_BATCH_SCRIPT)
		err = _getenv_dup(sp, "SLURM_STEP_NODELIST",
				  HAI_MAX_NODELIST_LEN, &nodelist);
	if (err == ESPANK_ENV_NOEXIST)
		err = _getenv_dup(sp, "SLURM_JOB_NODELIST",
				  HAI_MAX_NODELIST_LEN, &nodelist);
	if (err != ESPANK_SUCCESS) {
		slurm_error("hai: cannot read the node list of step %u.%u: %s",
			    jobid, stepid, spank_strerror(err));
		goto out;
	}
	if (!(*master = _first_host(nodelist))) {
		slurm_error("hai: bad node list '%s'",
			    _shown(nodelist, shown));
		goto out;
	}
	if (_getenv_dup(sp, "HAI_MASTER_NODE", HAI_MAX_ENV_LEN, &env_node) ==
	    ESPANK_SUCCESS && !strcmp(env_node, *master) &&
	    _getenv_dup(sp, "HAI_MASTER_IP", HAI_MAX_ENV_LEN, &env_ip) ==
	    ESPANK_SUCCESS &&
	    _is_ipv4(env_ip) && strlen(env_ip) < len) {
		snprintf(ip, len, "%s", env_ip);
		rc = 0;
	} else if (_node_ipv4(*master, ip, len) == 0) {
		rc = 0;
	}
out:
	if (rc) {
		free(*master);
		*master = NULL;
	}
	free(nodelist);
	free(env_node);
	free(env_ip);
	return rc;
}

/* Compute the contract (rules b-g of the header); 0 on success. */
static int _compute(spank_t sp, uint32_t jobid, uint32_t stepid,
		    struct hai_contract *c)
{
	char *v = NULL;
	char shown[HAI_SHOWN_LEN];
	spank_err_t err;
	long n;
	int rc = -1;

	if ((err = spank_get_item(sp, S_JOB_NODEID, &c->rank)) !=
	    ESPANK_SUCCESS ||
	    (err = spank_get_item(sp, S_JOB_NNODES, &c->world)) !=
	    ESPANK_SUCCESS ||
	    (err = spank_get_item(sp, S_SLURM_RESTART_COUNT, &c->restarts)) !=
	    ESPANK_SUCCESS) {
		slurm_error("hai: cannot get step info: %s",
			    spank_strerror(err));
		return -1;
	}

	/* c. the batch step reports 0 nodes: it is the job's launcher on
	 *    node 0, so its world is the job's node count */
	if (stepid == SLURM_BATCH_SCRIPT || c->world == 0) {
		err = _getenv_dup(sp, "SLURM_JOB_NUM_NODES", HAI_MAX_ENV_LEN,
				  &v);
		if (err == ESPANK_ENV_NOEXIST)
			err = _getenv_dup(sp, "SLURM_NNODES", HAI_MAX_ENV_LEN,
					  &v);
		if (err != ESPANK_SUCCESS ||
		    _parse_long(v, 1, UINT32_MAX, &n)) {
			slurm_error("hai: cannot get the node count of job "
				    "%u: %s", jobid, err != ESPANK_SUCCESS ?
				    spank_strerror(err) : _shown(v, shown));
			goto out;
		}
		c->world = (uint32_t) n;
		free(v);
		v = NULL;
	}

	/* g. restart count (Slurm 22.05 leaves the item at 0; the task env
	 *    has SLURM_RESTART_COUNT after a requeue) */
	err = _getenv_dup(sp, "SLURM_RESTART_COUNT", HAI_MAX_ENV_LEN, &v);
	if (err == ESPANK_SUCCESS && !_parse_long(v, 0, UINT32_MAX, &n) &&
	    (uint32_t) n > c->restarts)
		c->restarts = (uint32_t) n;
	free(v);
	v = NULL;

	/* f. port */
	err = _getenv_dup(sp, "HAI_MASTER_PORT", HAI_MAX_ENV_LEN, &v);
	if (err == ESPANK_SUCCESS || err == ESPANK_NOSPACE) {
		if (!v || _parse_long(v, 1, 65535, &c->port)) {
			slurm_error("hai: HAI_MASTER_PORT='%s' is not a port "
				    "number", v ? _shown(v, shown) : "(too long)");
			goto out;
		}
	} else if (err == ESPANK_ENV_NOEXIST) {
		c->port = hai.port_base + (long) (jobid % hai.port_span);
	} else {
		slurm_error("hai: cannot read HAI_MASTER_PORT: %s",
			    spank_strerror(err));
		goto out;
	}

	/* d, e. master node and address */
	rc = _master(sp, jobid, stepid, &c->master, c->ip, sizeof(c->ip));
out:
	free(v);
	return rc;
}

/*
 * Common start of the remote callbacks: job and step id, and whether the
 * contract is ours to set (rule a). Returns 1 to go on, 0 to leave the job
 * alone, -1 on error. *inherited: HAI_CONTRACT=spank is already there.
 */
static int _remote_begin(spank_t sp, uint32_t *jobid, uint32_t *stepid,
			 int *inherited)
{
	spank_err_t err;
	char mark[16];

	*inherited = 0;
	if (spank_context() != S_CTX_REMOTE)
		return 0;
	if ((err = spank_get_item(sp, S_JOB_ID, jobid)) != ESPANK_SUCCESS ||
	    (err = spank_get_item(sp, S_JOB_STEPID, stepid)) !=
	    ESPANK_SUCCESS) {
		slurm_error("hai: cannot get the job step id: %s",
			    spank_strerror(err));
		return -1;
	}
	if (*stepid == SLURM_EXTERN_CONT)
		return 0;

	err = spank_getenv(sp, "HAI_CONTRACT", mark, sizeof(mark));
	if (err == ESPANK_SUCCESS && !strcmp(mark, HAI_CONTRACT_MARK)) {
		*inherited = 1;
	} else if (err == ESPANK_SUCCESS || err == ESPANK_NOSPACE) {
		slurm_debug("hai: step %u.%u: HAI_CONTRACT set by the job; "
			    "leaving the contract alone", *jobid, *stepid);
		return 0;
	} else if (err != ESPANK_ENV_NOEXIST) {
		slurm_error("hai: cannot read HAI_CONTRACT: %s",
			    spank_strerror(err));
		return -1;
	}
	return 1;
}

/* slurmstepd, in every task: the contract itself. */
int slurm_spank_task_init(spank_t sp, int ac, char **av)
{
	struct hai_contract c;
	uint32_t jobid = 0, stepid = 0;
	spank_err_t err;
	int inherited, rc;

	(void) ac;
	(void) av;
	if ((rc = _remote_begin(sp, &jobid, &stepid, &inherited)) <= 0)
		return rc;

	memset(&c, 0, sizeof(c));
	rc = _compute(sp, jobid, stepid, &c);
	if (!rc)
		rc = _set_num(sp, "RANK", c.rank) ||
		     _set_num(sp, "NODE_RANK", c.rank) ||
		     _set_num(sp, "WORLD_SIZE", c.world) ||
		     _set(sp, "MASTER_IP", c.ip) ||
		     _set(sp, "MASTER_ADDR", c.ip) ||
		     _set_num(sp, "MASTER_PORT", c.port) ||
		     _set(sp, "HAI_MASTER_NODE", c.master) ||
		     _set(sp, "HAI_MASTER_IP", c.ip) ||
		     _set_num(sp, "HAI_RESTART_COUNT", c.restarts) ||
		     _set(sp, "HAI_CONTRACT", HAI_CONTRACT_MARK);
	if (rc) {
		slurm_error("hai: step %u.%u: HAI environment contract not "
			    "set", jobid, stepid);
		if (inherited &&
		    (err = spank_unsetenv(sp, "HAI_CONTRACT")) !=
		    ESPANK_SUCCESS)
			slurm_error("hai: cannot unset HAI_CONTRACT: %s",
				    spank_strerror(err));
	} else {
		slurm_debug("hai: step %u.%u node %u/%u master %s (%s:%ld) "
			    "restarts %u", jobid, stepid, c.rank, c.world,
			    c.master, c.ip, c.port, c.restarts);
	}
	free(c.master);
	return rc ? -1 : 0;
}
