"""Cases for test_agreement.py, run on gloo ranks (tests/dist_harness.py)."""

import datetime


def peer_never_joins(timeout_s: float = 3.0):
    """Rank 0 checks its settings over the TP group while rank 1 (coc-inject off there) issues Megatron's
    all-reduce on that group: rank 0's check must time out naming rank 1, and neither rank's
    collective may pair with the check's traffic (rank 1's all-reduce then sums rank 0's own)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from coc_inject.config import CocConfig
    from coc_inject.pipeline import agreement

    group = parallel_state.get_tensor_model_parallel_group()
    rank = dist.get_rank()
    said = None
    held = agreement.AGREEMENT_TIMEOUT, agreement.KEY_PREFIX
    # a prefix of its own: rank 0's unanswered key must not meet a later case's check
    agreement.AGREEMENT_TIMEOUT = datetime.timedelta(seconds=timeout_s)
    agreement.KEY_PREFIX = "coc-inject/agreement-never-joins"
    try:
        if rank == 0:
            try:
                agreement.ensure_same_config(group, CocConfig(parallel_num=2))
            except agreement.ConfigMismatchError as error:
                said = str(error)
        value = torch.full((4,), float(rank + 1))
        dist.all_reduce(value, group=group)
    finally:
        agreement.AGREEMENT_TIMEOUT, agreement.KEY_PREFIX = held
        agreement.forget()
    return {"said": said, "sum": value.tolist()}


def agree(parallel_num_by_rank, rounds: int = 2):
    """Every rank checks its settings over the TP group ``rounds`` times (forgetting in between, as a
    job that makes its groups again): the messages, None where the check passed."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from coc_inject.config import CocConfig
    from coc_inject.pipeline import agreement

    group = parallel_state.get_tensor_model_parallel_group()
    out = []
    for _ in range(rounds):
        try:
            agreement.ensure_same_config(group, CocConfig(parallel_num=parallel_num_by_rank[dist.get_rank()]))
            out.append(None)
        except agreement.ConfigMismatchError as error:
            out.append(str(error))
        agreement.forget()
    return out
