"""A part's heal over its process group (slurm_hai/runtime/heal.py): what one part sends,
another receives, into its own tensors where it has them. The group here pairs sends and
receives in one process; tests/unit/test_parts_training.py heals over torchft's gloo group."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest
import torch

from slurm_hai.runtime.heal import HealError, PeerHeal, check_state

WAIT = timedelta(seconds=5)


class Done:
    def wait(self, timeout=None) -> bool:
        return True


class Wire:
    """Two ends of a process group: rank 0 sends, rank 1 receives, matched by tag."""

    def __init__(self) -> None:
        self.sent: dict[int, bytes] = {}
        self.bytes_sent = 0

    def send(self, tensors, dst, tag):
        assert dst == 1
        self.sent[tag] = tensors[0].numpy().tobytes()
        self.bytes_sent += tensors[0].numel()
        return Done()

    def recv(self, tensors, src, tag):
        assert src == 0
        into = tensors[0]
        into.copy_(torch.frombuffer(bytearray(self.sent.pop(tag)), dtype=into.dtype).view(into.shape))
        return Done()


def model_state(seed: int, stepped: bool) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2, dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if stepped:  # momentum buffers exist from the first step on
        model(torch.randn(4, 3, dtype=torch.float64)).sum().backward()
        opt.step()
    return {"user": {"default": {"model": model.state_dict(), "opt": opt.state_dict(),
                                 "rng": torch.get_rng_state(), "seen": 12, "loss": math.pi, "tag": "a",
                                 "flags": (True, None), "empty": torch.empty(0), "t": torch.ones(2, 3).t()}},
            "torchft": {"step": 7, "batches_committed": 21}}


def test_a_heal_copies_the_peers_state_into_the_parts_own_tensors():
    theirs, mine = model_state(1, stepped=True), model_state(2, stepped=False)
    own_weight = mine["user"]["default"]["model"]["weight"]
    wire = Wire()
    PeerHeal(wire, lambda: None).send_checkpoint([1], 7, theirs, WAIT)
    got = PeerHeal(wire, lambda: mine).recv_checkpoint(0, "process group", 7, WAIT)
    assert not wire.sent  # every message taken
    want, have = theirs["user"]["default"], got["user"]["default"]
    assert have["model"]["weight"] is own_weight  # in place: no new tensor for what the part has
    assert torch.equal(own_weight, want["model"]["weight"]) and torch.equal(have["model"]["bias"], want["model"]["bias"])
    # the optimizer's momentum, which the healing part has not made yet, comes new
    assert set(have["opt"]["state"]) == {0, 1}
    assert all(torch.equal(have["opt"]["state"][k]["momentum_buffer"], want["opt"]["state"][k]["momentum_buffer"])
               for k in (0, 1))
    assert have["opt"]["param_groups"] == want["opt"]["param_groups"]
    assert torch.equal(have["rng"], want["rng"]) and have["t"].shape == (3, 2) and torch.equal(have["t"], want["t"])
    assert (have["seen"], have["loss"], have["tag"], have["flags"]) == (12, math.pi, "a", (True, None))
    assert got["torchft"] == {"step": 7, "batches_committed": 21}
    # the tensors' bytes, once each, and a header of a few KiB (its length: 8 bytes)
    tensor_bytes = sum(t.numel() * t.element_size() for t in _tensors(theirs))
    assert 0 < wire.bytes_sent - tensor_bytes - 8 < 8192


def _tensors(state):
    from torch.utils._pytree import tree_flatten

    return [leaf for leaf in tree_flatten(state)[0] if isinstance(leaf, torch.Tensor)]


def test_a_heal_of_another_step_fails():
    wire = Wire()
    PeerHeal(wire, lambda: None).send_checkpoint([1], 8, model_state(1, True), WAIT)
    with pytest.raises(HealError, match="^the peer sent step 8, the quorum's is 7$"):
        PeerHeal(wire, lambda: model_state(2, False)).recv_checkpoint(0, "process group", 7, WAIT)


@pytest.mark.parametrize("leaf, where", [(b"raw", "['x']"), (object(), "['x']")])
def test_a_state_the_heal_cannot_carry_is_said_in_one_line(leaf, where):
    with pytest.raises(HealError) as e:
        check_state({"w": torch.ones(1), "x": leaf})
    assert str(e.value).startswith(f"the part's state holds a {type(leaf).__name__} at {where}: a part heals")
    assert "\n" not in str(e.value)
    check_state({"w": torch.ones(1), "n": [1, 2.5, "s", None, True]})  # what it carries
