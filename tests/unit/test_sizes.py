"""Node counts of fixed and elastic jobs (policy/sizes.py)."""

from __future__ import annotations

import pytest

from slurm_hai.policy.sizes import NodeRange, from_tag


@pytest.mark.parametrize("text,expected", [
    ("2", NodeRange(2, 2, 1)), (3, NodeRange(3, 3, 1)), ("2:4", NodeRange(2, 4, 1)), ("2-4", NodeRange(2, 4, 1)),
    ("2:8:2", NodeRange(2, 8, 2)), ("2-8:2", NodeRange(2, 8, 2)), (" 1:3 ", NodeRange(1, 3, 1)),
    ("4:4:2", NodeRange(4, 4, 1)),
])
def test_every_spelling_reads_as_the_same_range(text, expected):
    assert NodeRange.parse(text) == expected


@pytest.mark.parametrize("text,says", [
    ("", "give a node count N"), ("two", "give a node count N"), ("2:4:", "give a node count N"),
    ("2:4-6", "give a node count N"), ("0", "between 1 and 10000"), ("2:10001", "between 1 and 10000"),
    ("4:2", "MIN is above MAX; write MIN:MAX, e.g. 2:4"), ("2:4:0", "STEP must be at least 1"),
    ("2:5:2", "write 2:4:2 or 2:6:2"),
])
def test_a_bad_range_gets_one_line_that_says_what_to_write(text, says):
    with pytest.raises(ValueError) as e:
        NodeRange.parse(text, "-n")
    assert says in str(e.value) and "\n" not in str(e.value) and str(e.value).startswith("-n ")


def test_sizes_steps_and_the_largest_size_that_fits():
    r = NodeRange.parse("2:8:2")
    assert r.sizes() == [2, 4, 6, 8] and r.elastic
    assert [r.largest_at_most(n) for n in (1, 2, 3, 5, 8, 20)] == [None, 2, 2, 4, 8, 8]
    assert r.allows(6) and not r.allows(5) and not r.allows(10) and not r.allows(0)
    fixed = NodeRange.parse("3")
    assert not fixed.elastic and fixed.sizes() == [3] and fixed.largest_at_most(7) == 3


def test_spellings_for_slurm_for_the_tag_and_for_people():
    r = NodeRange.parse("2-8:2")
    assert (r.slurm(), r.tag(), str(r)) == ("2-8", "2:8:2", "2:8:2")
    assert (NodeRange.parse("2:4").slurm(), str(NodeRange.parse("2:4"))) == ("2-4", "2:4")
    assert (NodeRange.parse("3").slurm(), str(NodeRange.parse("3"))) == ("3", "3")
    assert from_tag(r.tag()) == r and from_tag(None) is None and from_tag("2:x") is None


class ResizingSlurm:
    """What runtime.batch.run_size asks of Slurm: shrink a running job's allocation, read it back."""

    def __init__(self, nodes: list[str]):
        self.nodes, self.shrunk = nodes, []

    def shrink_allocation(self, job_id, n):
        self.shrunk.append((job_id, n))
        self.nodes = self.nodes[:n]

    def job(self, job_id):
        from types import SimpleNamespace
        return SimpleNamespace(node_list=",".join(self.nodes))


def test_a_run_uses_every_node_it_was_given_that_its_step_allows_and_gives_the_rest_back():
    from slurm_hai.runtime.batch import run_size

    env = {"SLURM_JOB_NUM_NODES": "3", "SLURM_NNODES": "3", "SLURM_JOB_NODELIST": "n1,n2,n3", "SLURM_NTASKS": "3",
           "SLURM_NPROCS": "3", "SLURM_TASKS_PER_NODE": "1(x3)", "OTHER": "kept"}
    slurm = ResizingSlurm(["n1", "n2", "n3"])
    assert run_size(slurm, 7, NodeRange.parse("2:4:2"), env) == 2
    assert slurm.shrunk == [(7, 2)]
    assert env == {"SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "n1,n2",
                   "SLURM_NODELIST": "n1,n2", "OTHER": "kept"}
    # an allowed count, a fixed job, a job without a range: used as given, nothing asked of Slurm
    for sizes in (NodeRange.parse("2:4"), NodeRange.parse("3"), None):
        slurm, env = ResizingSlurm(["n1", "n2", "n3"]), {"SLURM_JOB_NUM_NODES": "3"}
        assert run_size(slurm, 7, sizes, env) == 3 and slurm.shrunk == [] and env == {"SLURM_JOB_NUM_NODES": "3"}


def test_a_run_on_another_size_than_the_last_is_recorded_as_a_shrink_or_a_grow():
    from slurm_hai.runtime.batch import size_change

    starts = [{"event": "submit"}, {"event": "start", "run": 0, "size": 4}, {"event": "suspended", "run": 0}]
    assert size_change(starts, 2) == ("shrink", {"from": 4, "to": 2})
    assert size_change(starts + [{"event": "start", "run": 1, "size": 2}], 4) == ("grow", {"from": 2, "to": 4})
    assert size_change(starts, 4) is None
    assert size_change([{"event": "start", "run": 0, "nodes": "n[1-2]"}], 2) is None  # before sizes were recorded
    assert size_change([], 3) is None
