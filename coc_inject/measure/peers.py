"""Waiting for slower ranks, told apart from communication (host clock).

On the host clock a rank that reaches a collective early waits for its peers to arrive: that wait is
skew (another rank's compute, its descheduling), not what the link cost, and it must not be charged
to the wing that issued the collective. The rank that arrived last saw the collective's own time:
so at a measured step's end, per group, the in-flight times (issue to done) of that step's
collectives on it are MIN-reduced over the group (one all-reduce per group, in the order the groups
first appear: the program order, the same on every rank, since every member issues a group's
collectives in one order). A collective's **peers** time is how much longer than that minimum it was
in flight on this rank (its ``skew``): its communication time loses it, and the part of its waits it
covers is booked as *wait for peers* (``peers``), not as exposed communication.

On a device the events resolve later, at different steps on different ranks, so no collective can
be issued then: the device clock's figures keep any skew (docs/measuring.md).
"""

from __future__ import annotations

from coc_inject.measure.records import NO_GROUP

POINT_TO_POINT = ("send/recv", "send", "recv", "isend", "irecv")


def separate(records: list) -> None:
    """Sets each host-clock record's ``skew`` (seconds) from its group's MIN in-flight time."""
    import torch
    import torch.distributed as dist

    by_group: dict = {}
    for record in records:
        # point-to-point ops involve two ranks of their group, not all: no group-wide reduce can pair them
        if record.marks is None and record.handle is not NO_GROUP and record.op not in POINT_TO_POINT:
            by_group.setdefault(id(record.handle), (record.handle, []))[1].append(record)
    for handle, rows in by_group.values():
        in_flight = torch.tensor([r.finished - r.issued for r in rows], dtype=torch.float64, device="cpu")  # host times
        fastest = in_flight.to(reduce_device(handle), copy=True)  # a copy: the reduce is in place
        dist.all_reduce(fastest, op=dist.ReduceOp.MIN, group=handle)
        for record, mine, least in zip(rows, in_flight.tolist(), fastest.tolist()):
            record.skew = max(0.0, mine - least)


def reduce_device(group):
    """The device whose tensors ``group``'s backend takes: the CPU where it has a CPU backend (gloo),
    else the device it is bound to, else its accelerator's (no index: the current one). Host-clock
    records come from CPU ranks, and also from host-side collectives on a device job's group (the
    self-test's sleep-backed one on NCCL refused a CPU tensor: 'No backend type associated with
    device type cpu', seen on an H100)."""
    import torch
    import torch.distributed as dist

    group = group if group is not None else dist.distributed_c10d._get_default_group()
    types = [torch.device(kind).type for kind in getattr(group, "_device_types", ())]
    if not types:  # a torch without the attribute: gloo alone takes CPU tensors
        types = ["cpu"] if dist.get_backend(group) == "gloo" else [_accelerator_type()]
    if "cpu" in types:
        return torch.device("cpu")
    bound = getattr(group, "bound_device_id", None)  # init_process_group(device_id=...): the group's own device
    # No index: a tensor moved to "cuda" lands on the current CUDA device, as NCCL expects
    return bound if bound is not None else torch.device(types[0])


def _accelerator_type() -> str:
    import torch

    accelerator = getattr(torch, "accelerator", None)
    found = accelerator.current_accelerator() if accelerator is not None else None
    return found.type if found is not None else "cuda"
