"""Waiting for slower ranks, told apart from communication (host clock).

On the host clock a rank that reaches a collective early waits for its peers to arrive: that wait is
skew (another rank's compute, its descheduling), not what the link cost, and it must not be charged
to the wing that issued the collective. The rank that arrived last saw the collective's own time:
so at a measured step's end, per group, the in-flight times (issue to done) of that step's
collectives on it are MIN-reduced over the group. A collective's **peers** time is how much longer
than that minimum it was in flight on this rank (its ``skew``): its communication time loses it, and
the part of its waits it covers is booked as *wait for peers* (``peers``), not as exposed communication.

That reduce pairs the i-th record of a group on every member, so it runs only where every member
recorded the same collectives: each group's count and operations (a CRC of their sequence) are
compared first, in one small MIN-reduce of a fixed size. A group whose members differ is **not
comparable** (returned, said and reported by the caller: its waits stay exposed) rather than reduced
wrongly or hung on. A member must join a group's comparison even where it recorded nothing there: the
groups of collectives it issued inside auto's trials (kept apart, never in the sums: ``kept_apart``)
are compared too. The groups go in one order on every rank, sorted by their ranks and name, never the
order a rank met them (a trial can change that on one rank only).

On a device the events resolve later, at different steps on different ranks, so no collective can
be issued then: the device clock's figures keep any skew (docs/measuring.md).
"""

from __future__ import annotations

import zlib

from coc_inject.measure.records import NO_GROUP

POINT_TO_POINT = ("send/recv", "send", "recv", "isend", "irecv")


def separate(records: list, kept_apart: dict | None = None) -> list:
    """Sets each host-clock record's ``skew`` (seconds) from its group's MIN in-flight time, where its
    group's members recorded the same collectives. ``kept_apart``: id(group) -> (group, collectives issued
    inside auto's trials on it). Returns the groups that are not comparable: ``(group, (fewest, most)
    records among the members, this rank's records, this rank's kept apart)``."""
    import torch
    import torch.distributed as dist

    by_group: dict = {}
    for record in records:
        # point-to-point ops involve two ranks of their group, not all: no group-wide reduce can pair them
        if record.marks is None and record.handle is not NO_GROUP and record.op not in POINT_TO_POINT:
            by_group.setdefault(id(record.handle), (record.handle, []))[1].append(record)
    for key, (handle, _) in (kept_apart or {}).items():
        by_group.setdefault(key, (handle, []))
    not_comparable = []
    for handle, rows in sorted(by_group.values(), key=lambda entry: _order(entry[0])):
        device = reduce_device(handle)
        count, operations = len(rows), zlib.crc32(";".join(r.op for r in rows).encode())
        signature = torch.tensor([count, -count, operations, -operations], dtype=torch.int64).to(device)
        dist.all_reduce(signature, op=dist.ReduceOp.MIN, group=handle)
        fewest, most_negated, lowest, highest_negated = signature.tolist()
        if fewest != -most_negated or lowest != -highest_negated:
            trial = (kept_apart or {}).get(id(handle), (handle, 0))[1]
            not_comparable.append((handle, (fewest, -most_negated), count, trial))
            continue
        if not rows:
            continue
        in_flight = torch.tensor([r.finished - r.issued for r in rows], dtype=torch.float64, device="cpu")  # host times
        fastest = in_flight.to(device, copy=True)  # a copy: the reduce is in place
        dist.all_reduce(fastest, op=dist.ReduceOp.MIN, group=handle)
        for record, mine, least in zip(rows, in_flight.tolist(), fastest.tolist()):
            record.skew = max(0.0, mine - least)
    return not_comparable


def _order(group) -> tuple:
    """A group's place in the order every rank compares its groups in: its global ranks, then its name
    (two groups of the same ranks, e.g. TP and TP x CP at CP 1); the world's all ranks."""
    import torch.distributed as dist

    try:
        ranks = tuple(range(dist.get_world_size())) if group is None else tuple(dist.get_process_group_ranks(group))
    except Exception:  # noqa: BLE001 - a stand-in group (tests): alone, its place does not matter
        ranks = ()
    return ranks, str(getattr(group, "group_name", "") or "")


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
