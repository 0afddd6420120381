# slurm-hai: the README's two commands.
#   make demo   set up everything (packages, venv, local Slurm cluster) and run the demo
#   make test   set up everything and run the whole test suite, cluster tests included
#   SLURM_SOURCES=DIR make test   also the slurm_boundary cluster tests on every slurm-*.tar.gz in DIR
#               (each built once and cached; tests/each_slurm.py)
#   make test-sites   the slurm_boundary cluster tests on the distributions' Slurm releases
#               (SITE_SLURM_SOURCES, default ../shared/vendor-sites: 23.11.4 of Ubuntu 24.04,
#               24.11.5 of Debian 13), each built once; outside CI's time budget
#   make test-debian  Debian's suite alone: the unit tests and the cluster tests on Debian's Slurm
#   make test-netns   the network fault tests alone (make test runs them beside Debian's suite), on the netns layout
#   make test-docker  the requeue tests on a cluster of Docker containers (make test runs them last; contrib/slurm-docker)
#   make lint   ruff over the tree, mypy over slurm_hai/ (make test runs it first)
#   make dist   a wheel and an sdist in dist/, for a site: pip install dist/slurm_hai-*.whl
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
VENV ?= .venv
PY := $(VENV)/bin/python
# Debian's interpreter: jobs run as other users, who must be able to execute the venv's
# Python (an interpreter under /root, e.g. pyenv's, is not reachable for them).
BASE_PYTHON ?= /usr/bin/python3
PYTEST_ARGS ?=
SLURM_SOURCES ?=
SITE_SLURM_SOURCES ?= ../shared/vendor-sites

.PHONY: demo test test-debian test-each-slurm test-netns test-docker test-sites lint test-tools setup venv cluster cluster-down bench docs dist clean

demo: setup
	$(PY) examples/demo.py

# With SLURM_SOURCES, the other Slurm versions (and pyslurm) build in the background at idle
# CPU priority while Debian's suite runs; each_slurm.py then waits for what is still building.
# Debian's suite and the network fault tests run at once (their clusters are apart, and a
# cluster test leaves the two cores idle about half its time: `perf record -a`, stop 63),
# each one's output printed whole when it is done; then the other versions' runs, at once.
test: setup test-tools lint
ifneq ($(SLURM_SOURCES),)
	$(PY) tests/each_slurm.py --build-in-background $(SLURM_SOURCES)
endif
	$(MAKE) -j2 --output-sync=target test-debian test-netns
ifneq ($(SLURM_SOURCES),)
	$(MAKE) test-each-slurm
endif
	$(MAKE) test-docker

# Debian's suite: the unit tests and the cluster tests on Debian's Slurm (22.05), netns ones apart.
test-debian: setup test-tools
	$(PY) -m pytest $(PYTEST_ARGS)

test-each-slurm: setup
	$(PY) tests/each_slurm.py $(SLURM_SOURCES) $(PYTEST_ARGS)

# The network faults (tests marked netns) on the local cluster's netns layout, its nodes tracking
# jobs by cgroup as the default layout's do: every node and slurmctld in a network namespace of
# its own (contrib/localcluster/README.md), in a state directory, ports and job ids of its own;
# brought down after, namespaces and bridge included.
NETNS_CLUSTER := HAI_CLUSTER_NETNS=1 HAI_CLUSTER_DIR=/var/lib/slurm-hai/netns-22.05 HAI_CLUSTER_PORT_BASE=16700 \
	HAI_CLUSTER_FIRST_JOB_ID=5000000
test-netns: setup test-tools
	rc=0; $(NETNS_CLUSTER) $(PY) -m pytest -m netns tests/cluster $(PYTEST_ARGS) || rc=$$?; \
	$(NETNS_CLUSTER) contrib/localcluster/down; exit $$rc

# The Docker cluster (contrib/slurm-docker/README.md): a controller and 2 compute containers of
# Debian's Slurm, their images built here from Debian's archive (kept, rebuilt when an input
# changes); `up` installs docker.io and mmdebstrap and starts dockerd if need be. The tests of
# tests/docker on it (a plain pytest leaves them out), then down.
test-docker: venv
	rc=0; contrib/slurm-docker/up && $(PY) -m pytest tests/docker $(PYTEST_ARGS) || rc=$$?; \
	contrib/slurm-docker/down; exit $$rc

test-sites: setup
	$(PY) tests/each_slurm.py $(SITE_SLURM_SOURCES) $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

setup: venv cluster

venv: $(VENV)/.installed

# torch is pinned and installed first: an unpinned torch would pull several GB of CUDA wheels.
# The package's bytecode is compiled here, as pip does for a wheel: an editable install leaves
# it to the first import, and a user who may not write the tree compiles it again at every
# command (hai status: 0.165 s without it, 0.093 s with it; docs/results-archive.md, issue 57).
$(VENV)/.installed: pyproject.toml
	@test -x $(BASE_PYTHON) && $(BASE_PYTHON) -c 'import ensurepip, venv' 2>/dev/null || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3 python3-venv python3-dev)
	@test -x $(PY) || $(BASE_PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[torch,metrics,transformers,lightning,elastic,dev]'
	$(PY) -m compileall -q slurm_hai >/dev/null
	@touch $@

# What only the tests use: a real Prometheus (scrapes the daemon's metrics), a headless
# browser (opens the timeline page), nftables and iptables (the network fault tests drop and
# delay packets).
# Debian's packages; installed once.
TEST_TOOLS := prometheus chromium fonts-liberation nftables iptables
test-tools:
	@dpkg -s $(TEST_TOOLS) >/dev/null 2>&1 || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(TEST_TOOLS))

cluster: venv
	contrib/localcluster/up

cluster-down:
	contrib/localcluster/down

bench: setup
	$(PY) benchmarks/checkpoint_bench.py
	$(PY) benchmarks/suspend_bench.py
	$(PY) benchmarks/policy_bench.py
	$(PY) benchmarks/cluster_bench.py

# docs/reference.md from the commands' own --help (tests/unit/test_docs.py checks it is current)
docs: venv
	$(PY) -m slurm_hai.cli.reference > docs/reference.md

# The wheel holds the templates, the SPANK plugin's sources (hai-admin spank install), the
# docs (with policy.example.toml), the Grafana dashboard and the slurm-docker contrib (hai-admin files; the systemd units: hai-admin units).
# Built in a small venv of its own (no torch): build and hatchling from PyPI.
DIST_VENV := build/dist-venv
dist:
	@test -x $(DIST_VENV)/bin/python || $(BASE_PYTHON) -m venv $(DIST_VENV)
	$(DIST_VENV)/bin/python -m pip install -q 'build>=1.0' 'hatchling>=1.18'
	rm -rf dist
	$(DIST_VENV)/bin/python -m build --no-isolation --outdir dist .

clean:
	rm -rf $(VENV) build dist *.egg-info
