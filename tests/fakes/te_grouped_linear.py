"""Stand-ins for Megatron's Transformer Engine grouped linears (``TEColumnParallelGroupedLinear`` /
``TERowParallelGroupedLinear``, megatron-core's wrappers of TE's ``GroupedLinear``): the ``linear_fc1`` /
``linear_fc2`` that ``TEGroupedMLP`` builds, so that Megatron's own ``TEGroupedMLP`` builds and runs on
the CPU by its interface.

Transformer Engine cannot be installed here (CUDA only). What the stand-ins keep of the wrappers' contract
(megatron/core/extensions/transformer_engine.py, TE's ``GroupedLinear``): the constructor's arguments
(``num_gemms, input_size, output_size``, keyword ``config, init_method, bias, skip_bias_add, is_expert``,
the rest taken and ignored); expert linears partitioned explicitly by Megatron over the expert
tensor-parallel group with no communication inside (column: the output, row: the input); one weight per
GEMM, ``weight{i}`` of ``[output, input]``; ``forward(x, m_splits)`` with ``m_splits`` a list of Python
ints, one per GEMM, summing to the rows of ``x`` (TE splits by them on the host), returning ``(output,
None)``: per GEMM ``rows_i @ weight_i^T``, concatenated. Checked on each call; no bias (refused at
construction). Verified against these stand-ins only, never against Transformer Engine.
"""

from __future__ import annotations

import torch

TE_MODULE = "megatron.core.extensions.transformer_engine"
calls: list = []  # (class name, m_splits) of every forward


class _GroupedLinear(torch.nn.Module):
    parallel_mode = None

    def __init__(self, num_gemms: int, input_size: int, output_size: int, *, config, init_method, bias: bool,
                 skip_bias_add: bool, is_expert: bool = False, **ignored):
        from megatron.core import parallel_state

        super().__init__()
        if bias:
            raise NotImplementedError("the grouped-linear stand-in has no bias (tests run add_bias_linear=False)")
        tp = parallel_state.get_expert_tensor_parallel_world_size() if is_expert else 1
        if self.parallel_mode == "column":
            output_size //= tp
        else:
            input_size //= tp
        self.num_gemms, self.in_features, self.out_features = num_gemms, input_size, output_size
        for i in range(num_gemms):
            weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
            init_method(weight)
            setattr(self, f"weight{i}", weight)

    def forward(self, x, m_splits):
        if not isinstance(m_splits, (list, tuple)) or not all(isinstance(m, int) for m in m_splits):
            raise TypeError(f"{type(self).__name__}: m_splits must be a list of Python ints, got {type(m_splits)}")
        if len(m_splits) != self.num_gemms:
            raise ValueError(f"{type(self).__name__}: {len(m_splits)} splits for {self.num_gemms} GEMMs")
        if x.dim() != 2 or x.shape[-1] != self.in_features or sum(m_splits) != x.shape[0]:
            raise ValueError(f"{type(self).__name__}: input {tuple(x.shape)} does not match {self.in_features} "
                             f"features and splits summing to {sum(m_splits)}")
        calls.append((type(self).__name__, list(m_splits)))
        parts = [rows @ getattr(self, f"weight{i}").t() for i, rows in enumerate(torch.split(x, list(m_splits)))]
        return (torch.cat(parts) if parts else x.new_empty((0, self.out_features))), None


class TEColumnParallelGroupedLinear(_GroupedLinear):
    parallel_mode = "column"


class TERowParallelGroupedLinear(_GroupedLinear):
    parallel_mode = "row"


for _cls in (TEColumnParallelGroupedLinear, TERowParallelGroupedLinear):
    _cls.__module__ = TE_MODULE  # coc-inject recognises Transformer Engine's classes by their module


def experts_builder():
    """The experts of Megatron's TE spec with ``--moe-grouped-gemm`` (TESpecProvider.grouped_mlp_modules):
    ``TEGroupedMLP`` over the stand-ins (megatron-core 0.17+, where experts are a builder)."""
    from functools import partial

    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP

    return partial(TEGroupedMLP, submodules=GroupedMLPSubmodules(
        linear_fc1=TEColumnParallelGroupedLinear, linear_fc2=TERowParallelGroupedLinear))


def experts_spec():
    """The same experts as megatron-core 0.12 to 0.16 specify them: a ``ModuleSpec`` of ``TEGroupedMLP``
    with ``MLPSubmodules`` (its constructor takes ``model_comm_pgs`` / ``pg_collection``, the stand-ins take
    and ignore what it hands their constructors: ``tp_group``, ``pg_collection``, ``tp_comm_buffer_name``)."""
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import TEGroupedMLP
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec(module=TEGroupedMLP, submodules=MLPSubmodules(
        linear_fc1=TEColumnParallelGroupedLinear, linear_fc2=TERowParallelGroupedLinear))
