"""The meter's end-of-step MIN over a group (peers.py) reduces on a device the group's backend takes.

Seen on an H100 (the self-test under torchrun, NCCL): the sleep-backed collective's host-clock
record sent a CPU tensor to NCCL's all-reduce, 'No backend type associated with device type cpu'.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist

from coc_inject.measure import peers
from coc_inject.measure.records import Collective


def test_a_device_only_group_reduces_on_its_current_device():
    nccl_like = types.SimpleNamespace(_device_types=[torch.device("cuda")])
    assert peers.reduce_device(nccl_like) == torch.device("cuda")  # no index: the current CUDA device


def test_a_group_bound_to_a_device_reduces_there():
    bound = types.SimpleNamespace(_device_types=[torch.device("cuda")], bound_device_id=torch.device("cuda", 5))
    assert peers.reduce_device(bound) == torch.device("cuda", 5)


def test_without_device_types_the_backend_decides(monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda group: group.backend)
    assert peers.reduce_device(types.SimpleNamespace(backend="gloo")) == torch.device("cpu")
    monkeypatch.setattr(peers, "_accelerator_type", lambda: "cuda")
    assert peers.reduce_device(types.SimpleNamespace(backend="nccl")) == torch.device("cuda")


def test_a_group_with_a_cpu_backend_reduces_on_the_cpu():
    assert peers.reduce_device(types.SimpleNamespace(_device_types=[torch.device("cuda"), torch.device("cpu")])) \
        == torch.device("cpu")  # gloo registers both


def test_separate_hands_the_reduce_the_groups_device(monkeypatch):
    """The MIN's tensor reaches all_reduce on reduce_device's answer (meta here: no CUDA on this machine)."""
    seen = []
    monkeypatch.setattr(peers, "reduce_device", lambda group: torch.device("meta"))

    def all_reduce(tensor, op=None, group=None):
        seen.append((tensor.device.type, group))
        return None
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    group = object()
    record = Collective("linears", "all_reduce", "tp", 16, None, "forward", None, handle=group)
    record.issued, record.done = 1.0, 1.5
    try:
        peers.separate([record])
    except (NotImplementedError, RuntimeError):
        pass  # reading a meta tensor's values back: past the point this test looks at
    assert seen == [("meta", group)]
