/* hai_front.c: `hai` and `hai-submit` for a login node's users, as a program of 1 ms.
 *
 * Built and installed by `hai-admin front install --bin-dir DIR` (DIR/hai and DIR/hai-submit),
 * which names the installation's Python and its console scripts (-DHAI_PYTHON, -DHAI_SCRIPTS).
 * It asks the host's warm-start service (`hai-admin warm-start --preload slurm_hai.cli.preload`,
 * root) to run `python -m slurm_hai.cli hai|hai-submit ARGS...` in a child forked from it, as
 * the Python front does (slurm_hai/cli/front.py, slurm_hai/runtime/warm.py: the wire, what the
 * child takes over), without starting Python for it: Python's start and the client's imports
 * were 0.02-0.03 s of each command's CPU, three times a whole `scontrol show job`.
 *
 * The wire (runtime/warm.py): one request, a 4-byte big-endian length and that many bytes of
 * JSON {"python", "argv", "env", "cwd", "umask"}, with descriptors 0, 1 and 2 alongside
 * (SCM_RIGHTS); then replies of one JSON line each: {"pid": N} and later {"status": WAITSTATUS},
 * or {"refused": WHY}.
 *
 * Where it cannot start warm (HAI_WARM=0, no service, one not run by root, a refusal, no
 * working directory), it runs the Python command
 * (HAI_SCRIPTS/hai or /hai-submit) in this process, saying nothing more. Signals it gets are
 * relayed to the child and its process group; it ends as the child did.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef HAI_PYTHON
#error "build with -DHAI_PYTHON='\"/path/to/python\"' (hai-admin front build does)"
#endif
#ifndef HAI_SCRIPTS
#error "build with -DHAI_SCRIPTS='\"/dir/of/the/python/hai\"' (hai-admin front build does)"
#endif
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_send_signal
#define SYS_pidfd_send_signal 424
#endif

#define DEFAULT_SOCKET "/dev/shm/slurm-hai-warm.sock"
#define MAX_REQUEST (8u << 20) /* the service's own limit */

extern char **environ;

/* The signals relayed to the child (runtime/warm.py RELAYED). */
static const int relayed[] = {SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGCONT, SIGALRM, SIGXCPU};
#define N_RELAYED (sizeof relayed / sizeof relayed[0])
static int signal_pipe[2] = {-1, -1};
static struct sigaction before[N_RELAYED];
static int caught[N_RELAYED];

static const char *command;
static char **command_argv;

/* ---- the Python command, in this process */

static void restore_signals(void)
{
	for (size_t i = 0; i < N_RELAYED; i++)
		if (caught[i])
			sigaction(relayed[i], &before[i], NULL);
}

static void __attribute__((noreturn)) run_here(void)
{
	char path[4096];

	restore_signals();
	snprintf(path, sizeof path, "%s/%s", HAI_SCRIPTS, command);
	command_argv[0] = path;
	execv(path, command_argv);
	fprintf(stderr, "%s: cannot run %s: %s (reinstall slurm-hai, then hai-admin front install)\n", command, path,
		strerror(errno));
	exit(127);
}

/* ---- the request's JSON */

struct buf {
	char *data;
	size_t len, cap;
};

static void put(struct buf *b, const char *s, size_t n)
{
	if (b->len + n + 1 > b->cap) {
		size_t cap = b->cap ? b->cap : 4096;
		while (b->len + n + 1 > cap)
			cap *= 2;
		char *data = realloc(b->data, cap);
		if (data == NULL)
			run_here();
		b->data = data;
		b->cap = cap;
	}
	memcpy(b->data + b->len, s, n);
	b->len += n;
	b->data[b->len] = '\0';
}

static void puts_(struct buf *b, const char *s) { put(b, s, strlen(s)); }

/* Length of the UTF-8 sequence at s (1-4), or 0 if it is not one. */
static size_t utf8_sequence(const unsigned char *s)
{
	size_t n;
	uint32_t c;

	if (s[0] < 0x80)
		return 1;
	if ((s[0] & 0xe0) == 0xc0) {
		n = 2;
		c = s[0] & 0x1f;
	} else if ((s[0] & 0xf0) == 0xe0) {
		n = 3;
		c = s[0] & 0x0f;
	} else if ((s[0] & 0xf8) == 0xf0) {
		n = 4;
		c = s[0] & 0x07;
	} else {
		return 0;
	}
	for (size_t i = 1; i < n; i++) {
		if ((s[i] & 0xc0) != 0x80)
			return 0;
		c = c << 6 | (s[i] & 0x3f);
	}
	if ((n == 2 && c < 0x80) || (n == 3 && c < 0x800) || (n == 4 && (c < 0x10000 || c > 0x10ffff)) ||
	    (c >= 0xd800 && c <= 0xdfff))
		return 0;
	return n;
}

/* s as a JSON string. A byte that is not part of UTF-8 is sent as Python reads it from its
 * environment and arguments (surrogateescape: U+DC80-U+DCFF), and the child has it back. */
static void put_string(struct buf *b, const char *s, size_t n)
{
	char esc[8];

	puts_(b, "\"");
	for (size_t i = 0; i < n;) {
		unsigned char c = (unsigned char)s[i];
		if (c == '"' || c == '\\') {
			esc[0] = '\\';
			esc[1] = (char)c;
			put(b, esc, 2);
			i++;
		} else if (c < 0x20 || c == 0x7f) {
			snprintf(esc, sizeof esc, "\\u%04x", c);
			put(b, esc, 6);
			i++;
		} else {
			size_t len = utf8_sequence((const unsigned char *)s + i);
			if (len == 0 || i + len > n) {
				snprintf(esc, sizeof esc, "\\udc%02x", c);
				put(b, esc, 6);
				len = 1;
			} else {
				put(b, s + i, len);
			}
			i += len;
		}
	}
	puts_(b, "\"");
}

static void request(struct buf *b, int argc, char **argv)
{
	char cwd[8192];
	mode_t mask = umask(0);

	umask(mask);
	if (getcwd(cwd, sizeof cwd) == NULL)
		run_here();
	puts_(b, "{\"python\": ");
	put_string(b, HAI_PYTHON, strlen(HAI_PYTHON));
	puts_(b, ", \"argv\": [\"-m\", \"slurm_hai.cli\", ");
	put_string(b, command, strlen(command));
	for (int i = 1; i < argc; i++) {
		puts_(b, ", ");
		put_string(b, argv[i], strlen(argv[i]));
	}
	puts_(b, "], \"env\": {");
	int first = 1;
	for (char **e = environ; *e; e++) {
		const char *eq = strchr(*e, '=');
		if (eq == NULL || eq == *e)
			continue;
		if (!first)
			puts_(b, ", ");
		first = 0;
		put_string(b, *e, (size_t)(eq - *e));
		puts_(b, ": ");
		put_string(b, eq + 1, strlen(eq + 1));
	}
	puts_(b, "}, \"cwd\": ");
	put_string(b, cwd, strlen(cwd));
	char tail[64];
	snprintf(tail, sizeof tail, ", \"umask\": %u}", (unsigned)mask);
	puts_(b, tail);
}

/* ---- the service */

static int connect_service(void)
{
	const char *path = getenv("HAI_COMMANDS_SOCKET");
	struct sockaddr_un addr = {.sun_family = AF_UNIX};
	struct ucred cred;
	socklen_t len = sizeof cred;

	if (path == NULL || *path == '\0')
		path = getenv("HAI_WARM_SOCKET");
	if (path == NULL || *path == '\0')
		path = DEFAULT_SOCKET;
	if (strlen(path) >= sizeof addr.sun_path)
		return -1;
	strcpy(addr.sun_path, path);
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return -1;
	if (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0 ||
	    getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || cred.uid != 0) {
		close(fd);
		return -1;
	}
	return fd;
}

static int send_request(int fd, const struct buf *body)
{
	uint32_t size = htonl((uint32_t)body->len);
	char control[CMSG_SPACE(3 * sizeof(int))];
	struct iovec iov[2] = {{&size, sizeof size}, {body->data, body->len}};
	struct msghdr msg = {.msg_iov = iov, .msg_iovlen = 2, .msg_control = control,
			     .msg_controllen = sizeof control};
	struct cmsghdr *cmsg = CMSG_FIRSTHDR(&msg);
	int fds[3] = {0, 1, 2};

	memset(control, 0, sizeof control);
	cmsg->cmsg_level = SOL_SOCKET;
	cmsg->cmsg_type = SCM_RIGHTS;
	cmsg->cmsg_len = CMSG_LEN(sizeof fds);
	memcpy(CMSG_DATA(cmsg), fds, sizeof fds);
	ssize_t sent = sendmsg(fd, &msg, MSG_NOSIGNAL);
	if (sent <= 0)
		return -1;
	size_t total = sizeof size + body->len, done = (size_t)sent;
	while (done < total) { /* the rest of a large request, without the descriptors */
		const char *from = done < sizeof size ? (const char *)&size + done : body->data + (done - sizeof size);
		size_t left = done < sizeof size ? sizeof size - done : total - done;
		ssize_t n = send(fd, from, left, MSG_NOSIGNAL);
		if (n <= 0) {
			if (n < 0 && errno == EINTR)
				continue;
			return -1;
		}
		done += (size_t)n;
	}
	return 0;
}

/* ---- signals: each relayed one is written to a pipe, read by the loop below */

static void on_signal(int sig)
{
	int saved = errno;
	unsigned char c = (unsigned char)sig;
	ssize_t ignored = write(signal_pipe[1], &c, 1);
	(void)ignored;
	errno = saved;
}

/* Catch every relayed signal this process does not ignore; one that comes before the child
 * is known waits in the pipe for it. */
static void catch_signals(void)
{
	struct sigaction sa = {.sa_handler = on_signal, .sa_flags = SA_RESTART};

	sigemptyset(&sa.sa_mask);
	if (pipe2(signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0)
		run_here();
	for (size_t i = 0; i < N_RELAYED; i++) {
		if (sigaction(relayed[i], NULL, &before[i]) != 0 || before[i].sa_handler == SIG_IGN)
			continue;
		caught[i] = sigaction(relayed[i], &sa, NULL) == 0;
	}
}

static void relay(int pidfd, pid_t pid)
{
	unsigned char sigs[64];
	ssize_t n;

	while ((n = read(signal_pipe[0], sigs, sizeof sigs)) > 0) {
		for (ssize_t i = 0; i < n; i++) {
			if (pidfd < 0 || syscall(SYS_pidfd_send_signal, pidfd, (int)sigs[i], NULL, 0) != 0)
				continue; /* ended: its status is on its way */
			killpg(pid, sigs[i]); /* the group it leads: the command's own processes */
		}
	}
}

/* ---- the replies: one JSON line each */

struct reader {
	int fd;
	char data[8192];
	size_t len;
};

/* The next line into line (NUL-terminated, without its newline): 1, or 0 at the end. Signals
 * are relayed while it waits (pidfd < 0: kept for later). */
static int next_line(struct reader *r, char *line, size_t size, int pidfd, pid_t pid)
{
	for (;;) {
		char *nl = memchr(r->data, '\n', r->len);
		if (nl != NULL) {
			size_t n = (size_t)(nl - r->data);
			if (n >= size)
				n = size - 1;
			memcpy(line, r->data, n);
			line[n] = '\0';
			r->len -= (size_t)(nl + 1 - r->data);
			memmove(r->data, nl + 1, r->len);
			return 1;
		}
		if (r->len == sizeof r->data)
			return 0; /* not a reply of the service */
		struct pollfd fds[2] = {{r->fd, POLLIN, 0}, {signal_pipe[0], POLLIN, 0}};
		if (poll(fds, pidfd >= 0 ? 2 : 1, -1) < 0) {
			if (errno == EINTR)
				continue;
			return 0;
		}
		if (fds[1].revents & POLLIN)
			relay(pidfd, pid);
		if (fds[0].revents) {
			ssize_t n = read(r->fd, r->data + r->len, sizeof r->data - r->len);
			if (n < 0 && errno == EINTR)
				continue;
			if (n <= 0)
				return 0;
			r->len += (size_t)n;
		}
	}
}

/* The integer after "key": in a reply line, into *value: 1 if there is one. */
static int field(const char *line, const char *key, long *value)
{
	char quoted[32];
	snprintf(quoted, sizeof quoted, "\"%s\":", key);
	const char *at = strstr(line, quoted);
	if (at == NULL)
		return 0;
	char *end;
	errno = 0;
	*value = strtol(at + strlen(quoted), &end, 10);
	return errno == 0 && end != at + strlen(quoted);
}

static void __attribute__((noreturn)) end_as(int status)
{
	if (WIFSIGNALED(status)) {
		int sig = WTERMSIG(status);
		sigset_t set;
		if (sig != SIGKILL && sig != SIGSTOP)
			signal(sig, SIG_DFL);
		sigemptyset(&set);
		sigaddset(&set, sig);
		sigprocmask(SIG_UNBLOCK, &set, NULL);
		kill(getpid(), sig);
		exit(128 + sig); /* not reached for a deadly signal */
	}
	exit(WIFEXITED(status) ? WEXITSTATUS(status) : 1);
}

int main(int argc, char **argv)
{
	const char *name = strrchr(argv[0], '/');
	name = name ? name + 1 : argv[0];
	if (strcmp(name, "hai") != 0 && strcmp(name, "hai-submit") != 0) {
		fprintf(stderr, "%s: this program runs as hai or hai-submit (its name): install it with "
				"hai-admin front install\n", name);
		return 2;
	}
	command = name;
	command_argv = argv;
	const char *off = getenv("HAI_WARM");
	if (off != NULL && strcmp(off, "0") == 0)
		run_here();

	struct buf body = {0};
	request(&body, argc, argv);
	if (body.len > MAX_REQUEST)
		run_here();
	catch_signals(); /* from before the request: a signal that comes while the child starts waits for it */
	int sock = connect_service();
	if (sock < 0 || send_request(sock, &body) != 0)
		run_here();
	free(body.data);

	struct reader r = {.fd = sock};
	char line[8192];
	long value;
	if (!next_line(&r, line, sizeof line, -1, 0) || !field(line, "pid", &value) || value <= 0) {
		close(sock);
		run_here(); /* refused, or not the service's answer */
	}
	pid_t pid = (pid_t)value;
	int pidfd = (int)syscall(SYS_pidfd_open, pid, 0); /* < 0: it ended already, its status is on its way */
	relay(pidfd, pid);
	while (next_line(&r, line, sizeof line, pidfd, pid)) {
		if (field(line, "status", &value))
			end_as((int)value);
	}
	/* the service went away: the child's end is unknown */
	if (pidfd >= 0) {
		struct pollfd child = {pidfd, POLLIN, 0};
		while (poll(&child, 1, -1) < 0 && errno == EINTR)
			relay(pidfd, pid);
	}
	fprintf(stderr, "slurm-hai: the warm-start service went away; the command's exit status is unknown\n");
	return 1;
}
