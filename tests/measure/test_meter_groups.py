"""COC_MEASURE's groups on 2 gloo ranks (#51 item 4): a collective is booked on the group the caller gave,
wherever it put it (Megatron's distributed optimizer passes it third: ``all_gather(recv, send, group)``),
and the end-of-step exchange never reduces over ranks that recorded other collectives: a collective one
rank issued inside auto's trials (kept apart) and the other outside them leaves the group "not comparable",
said and reported, instead of a MIN-reduce of unequal lengths (gloo: an error or a hang).

The worker functions live here too; the pool's timeout bounds a hang (the test then fails)."""

from __future__ import annotations

import pytest

from dist_harness import RankPool

HERE = "tests.measure.test_meter_groups"


@pytest.fixture(scope="module")
def pool():
    pool = RankPool(2, timeout=120)  # startup too: slow on a loaded machine
    yield pool
    pool.close()


def measured_steps(positional: bool = False, trial_on_rank: int | None = None, steps: int = 2) -> dict:
    """``steps`` measured steps of one forward (the meter tells a step by it), collectives over Megatron's
    tensor-parallel group (the world's two ranks, another group object) and an optimizer step. Each step: an
    all-gather with the group given ``positional``-ly or by keyword; in the first step on ``trial_on_rank``
    an all-reduce inside a trial, issued on the other rank outside one (the same collective: they pair);
    then an all-reduce by keyword. The report's collectives per step, what is not comparable, the lines said."""
    import logging

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from coc_inject import job, log, trial
    from coc_inject.config import CocConfig
    from coc_inject.measure import install

    group = parallel_state.get_tensor_model_parallel_group()
    log.reset_once()  # the not-comparable line is said once per group name
    log.configure("info")
    exposure = install.install(CocConfig(measure=(1, None)))
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    log.logger.addHandler(handler)
    try:
        module = torch.nn.Linear(2, 2)
        optimizer = torch.optim.SGD(module.parameters(), lr=0.0)
        for step in range(steps):
            module(torch.zeros(1, 2))
            send = torch.full((4,), float(dist.get_rank()))
            gathered = [torch.empty(4) for _ in range(dist.get_world_size())]
            if positional:
                dist.all_gather(gathered, send, group)
            else:
                dist.all_gather(gathered, send, group=group)
            if step == 0 and trial_on_rank is not None:
                if dist.get_rank() == trial_on_rank:
                    with trial.isolated([module]):
                        dist.all_reduce(torch.ones(8), group=group)
                else:
                    dist.all_reduce(torch.ones(8), group=group)
            dist.all_reduce(torch.ones(8), group=group)
            optimizer.step()
        exposure.finish()
        report = exposure.report()
    finally:
        log.logger.removeHandler(handler)
        job.uninstall()
    return {"per_step": [sorted(row["wings"]) for row in report["per_step"]],
            "collectives": {kind: row["collectives"] for kind, row in report["total"]["collectives"].items()},
            "not_comparable": report.get("not_comparable", []), "said": said,
            "gathered": [t.tolist() for t in gathered]}


def test_a_positional_group_is_booked_on_that_group(pool):
    for rank, result in enumerate(pool.run(f"{HERE}:measured_steps", positional=True)):
        assert result["collectives"] == {"tp all_gather": 2, "tp all_reduce": 2}, (rank, result["collectives"])
        assert result["not_comparable"] == [], result
        assert result["gathered"] == [[0.0] * 4, [1.0] * 4]


def test_a_collective_inside_a_trial_on_one_rank_only_is_reported_not_reduced(pool):
    results = pool.run(f"{HERE}:measured_steps", trial_on_rank=0)
    in_trial, outside = results
    # rank 0's all-reduce inside its trial is kept apart; rank 1's, outside one, is booked
    assert in_trial["collectives"] == {"tp all_gather": 2, "tp all_reduce": 2}, in_trial["collectives"]
    assert outside["collectives"] == {"tp all_gather": 2, "tp all_reduce": 3}, outside["collectives"]
    for rank, result in enumerate(results):
        entries = result["not_comparable"]
        assert [(e["step"], e["group"], e["ranks"], e["members_recorded"]) for e in entries] == [(1, "tp", [0, 1], [2, 3])], \
            (rank, entries)
        assert entries[0]["in_trials"] == (1 if rank == 0 else 0), entries
        assert any("not comparable" in line and "group tp" in line for line in result["said"]), result["said"]
