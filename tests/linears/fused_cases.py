"""Rank-side helpers for the fused-backend tests: the fakes on sys.path, their call logs."""

from __future__ import annotations

import sys
from pathlib import Path

FAKES = str(Path(__file__).resolve().parents[1] / "fakes")


def use_fakes(enabled: bool = True, symm_mem: bool = False):
    """Put the fake torch_atb and torch_npu on sys.path (or take them off), register the fake CPU
    symm_mem kernels if ``symm_mem`` (else remove them); clear their records."""
    from coc_inject.linears.fused import registry

    if FAKES not in sys.path:
        sys.path.insert(0, FAKES)
    import symm_mem_cpu

    if enabled and symm_mem:
        symm_mem_cpu.register()
    else:
        symm_mem_cpu.unregister()
    if not enabled:
        if FAKES in sys.path:
            sys.path.remove(FAKES)
        sys.modules.pop("torch_atb", None)
        sys.modules.pop("torch_npu", None)
    for backend in registry.BACKENDS.values():
        backend._library = None  # look the library up again
    registry.BACKENDS["atb"]._operations.clear()
    if enabled:
        import torch_atb
        import torch_npu

        for records in (torch_atb.CALLS, torch_atb.CREATED, torch_npu.CALLS):
            records.clear()


def fake_calls():
    import symm_mem_cpu
    import torch_atb
    import torch_npu

    return {"calls": list(torch_atb.CALLS), "created": list(torch_atb.CREATED), "mc2": list(torch_npu.CALLS),
            "symm_mem": list(symm_mem_cpu.CALLS)}


def compare_fused(kind, *, sequence_parallel, fake=True, dtype="bfloat16", layer_options=None, symm_mem=False,
                  **options):
    """layer_cases.compare with USE_COC_FUSED_KERNEL=1 (through the fakes when ``fake``)."""
    import layer_cases

    use_fakes(fake, symm_mem)
    options.setdefault("hidden", 64)
    options.setdefault("ffn", 128)
    try:
        result = layer_cases.compare(kind, chunks=1, sequence_parallel=sequence_parallel, dtype=dtype,
                                     enable_coc_in_column_backward=True, layer_options=layer_options,
                                     config_options={"fused": True, **options.pop("config_options", {})},
                                     **options)
        result["fake"] = fake_calls() if fake else None
        return result
    finally:
        use_fakes(False)


def fake_rejects():
    """The fake enforces the contract: each bad parameter set is refused like the real binding."""
    import torch
    import torch.distributed as dist

    use_fakes(True)
    import torch_atb

    def param(**fields):
        p = torch_atb.LinearParallelParam()
        base = dict(trans_weight=True, rank=dist.get_rank(), rank_size=dist.get_world_size(), rank_root=0,
                    backend="lcoc", type=torch_atb.LinearParallelParam.ParallelType.LINEAR_ALL_REDUCE,
                    comm_domain="0")
        base.update(fields)
        for name, value in base.items():
            if value is not None:
                setattr(p, name, value)
        return p

    refused = {}
    for label, fields in {
        "hccl backend": dict(backend="hccl"),
        "trans_weight not set": dict(trans_weight=None),
        "rank_size 3": dict(rank_size=3),
        "wrong rank": dict(rank=(dist.get_rank() + 1) % dist.get_world_size()),
        "domain not numeric": dict(comm_domain="tp0"),
        "keep_intermediate with all-reduce": dict(keep_intermediate=True),
    }.items():
        try:
            torch_atb.Operation(param(**fields))
            refused[label] = None
        except RuntimeError as error:
            refused[label] = str(error)
    op = torch_atb.Operation(param())
    x, w = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(6, 8, dtype=torch.bfloat16)
    for label, tensors in {"fp32": [x.float(), w.float()], "k mismatch": [x, w[:, :4]],
                           "three inputs": [x, w, w]}.items():
        try:
            op.forward(tensors)
            refused[label] = None
        except RuntimeError as error:
            refused[label] = str(error)
    use_fakes(False)
    return refused


def ops_through(backend, check, **kwargs):
    """ops_cases.<check> with ``backend=`` and the fakes installed; adds the fakes' call records."""
    import ops_cases

    use_fakes(True, symm_mem=backend == "symm_mem")
    try:
        result = getattr(ops_cases, check)(backend=backend, **kwargs)
        result["fake"] = fake_calls()
        return result
    finally:
        use_fakes(False)
