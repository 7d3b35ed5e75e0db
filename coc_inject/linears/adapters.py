"""Row and Column adapters: Megatron's two linear forwards, as CoC runs them.

With guards.py, the only module that knows Megatron's layer attributes. Each adapter
turns one forward call into what the router plans with (``call``: a :class:`LinearCall`,
whose ``run_coc`` re-does Megatron's forward around CoC's autograd Functions: the scatter of a
non-parallel input, the bias, the output gather) and says why a call must take Megatron's own
path (``guard``). forward.py wraps the layers' forwards with them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from coc_inject.config import CocConfig
from coc_inject.linears.guards import (
    NO_GROUP,
    column_call_guards,
    column_guards,
    column_layer_guards,
    group_argument,
    row_call_guards,
    row_guards,
    row_layer_guards,
    tp_group,
)
from coc_inject.pipeline.functions import (
    AllGatherMatmul,
    FusedAllGatherMatmul,
    FusedKernel,
    FusedMatmulAllReduce,
    FusedMatmulReduceScatter,
    MatmulAllReduce,
    MatmulReduceScatter,
    MatmulWithChunkedGradAllReduce,
)
from coc_inject.pipeline.matmul import MatmulLayout
from coc_inject.pipeline.schedules import Schedule
from coc_inject.routes import LayerCase


@dataclass(frozen=True)
class Case:
    """A layer/mode combination the linears' wing handles, for ``status`` and the docs."""

    layer: str
    mode: str
    forward: str
    backward: str
    schedule: Schedule


CASES = (
    Case("RowParallelLinear", "no SP", "mm + all-reduce, chunked", "local (no comm)", Schedule.COMPUTE_FIRST),
    Case("RowParallelLinear", "SP", "mm + reduce-scatter, chunked", "all-gather + dgrad mm, chunked (comm-first)", Schedule.COMPUTE_FIRST),
    Case("ColumnParallelLinear", "SP", "all-gather + mm, chunked", "dgrad mm + reduce-scatter, chunked; wgrad from re-gathered or kept input", Schedule.COMM_FIRST),
    Case("ColumnParallelLinear", "no SP", "mm (nothing to overlap)", "dgrad mm + all-reduce, chunked (COC_ENABLE_IN_COLUMN_BACKWARD=1)", Schedule.COMPUTE_FIRST),
)


def _rows(input_) -> int:
    return input_.numel() // input_.shape[-1] if input_.dim() else 0


def row_shape(layer, input_) -> tuple:
    """[m, k, n] of a RowParallelLinear call (k: this rank's input columns; None: an attribute the
    layer lacks, the coverage's shape of a call the guards sent to Megatron for it)."""
    return _rows(input_), getattr(layer, "input_size_per_partition", None), getattr(layer, "output_size", None)


def column_shape(layer, input_) -> tuple:
    """[m, k, n] of a ColumnParallelLinear call (m: all rows, gathered under SP)."""
    group = tp_group(layer) if getattr(layer, "sequence_parallel", False) else None
    tp = group.size() if group is not None and group is not NO_GROUP else 1
    return _rows(input_) * tp, getattr(layer, "input_size", None), getattr(layer, "output_size_per_partition", None)


@dataclass
class LinearCall:
    """One Row or Column forward call, as the router (router.py) plans it."""

    layer: object
    case: LayerCase
    shape: tuple  # [m, k, n]
    coc_input: torch.Tensor  # what CoC multiplies (Row: after Megatron's scatter of a non-parallel input)
    megatron_input: torch.Tensor  # what Megatron's own forward takes
    weight: torch.Tensor
    rows: int  # the row count its chunks split (per rank under SP)
    fused_op: str | None  # the op a fused kernel would run; None: this forward has no communication to fuse
    run_coc: Callable  # (input, chunk count or FusedKernel) -> the forward's (output, bias): CoC's path
    run_megatron: Callable  # (input) -> the forward's (output, bias): Megatron's path (the tuner's trials)
    group: object = None  # the layer's tensor-parallel group (guards.tp_group), read once per call


class RowAdapter:
    """RowParallelLinear.forward(input_): mm + all-reduce, or mm + reduce-scatter under SP."""

    name = "RowParallelLinear"
    shape = staticmethod(row_shape)

    def __init__(self, config: CocConfig):
        self.layout = MatmulLayout.from_config(config)

    def guard(self, layer, input_, args, kwargs):
        return row_guards(layer, input_, args, kwargs)

    def layer_guard(self, layer):
        return row_layer_guards(layer)

    def call_guard(self, layer, input_, args, kwargs):
        return row_call_guards(layer, input_, args, kwargs)

    def call(self, original, layer, input_, args, kwargs) -> LinearCall:
        from megatron.core.tensor_parallel.mappings import scatter_to_tensor_model_parallel_region

        group, sequence_parallel = tp_group(layer), layer.sequence_parallel
        input_parallel = (
            input_ if layer.input_is_parallel
            else scatter_to_tensor_model_parallel_region(input_, **group_argument(layer))
        )
        rows = _rows(input_parallel) // group.size() if sequence_parallel else _rows(input_parallel)
        return LinearCall(
            layer, LayerCase.of(row=True, sequence_parallel=sequence_parallel), row_shape(layer, input_),
            input_parallel, input_, layer.weight, rows,
            "matmul_reduce_scatter" if sequence_parallel else "matmul_all_reduce",
            lambda x, kernel: self._forward(layer, x, kernel), lambda x: original(layer, x), group)

    def _forward(self, layer, input_parallel, kernel):
        output = self._output(layer, input_parallel, kernel, tp_group(layer))
        if layer.skip_bias_add:
            return output, layer.bias
        return (output + layer.bias if layer.bias is not None else output), None

    def _output(self, layer, input_parallel, kernel, group):
        arguments = (layer.weight, kernel, group, layer.gradient_accumulation_fusion, self.layout)
        if isinstance(kernel, FusedKernel):
            function = FusedMatmulReduceScatter if layer.sequence_parallel else FusedMatmulAllReduce
            rows = input_parallel.shape[0] // group.size() if layer.sequence_parallel else input_parallel.shape[0]
            x2d = input_parallel.reshape(-1, input_parallel.shape[-1])
            # 2-D through the Function, reshaped outside it: an ordinary view Megatron may edit in place.
            return function.apply(x2d, *arguments).view(rows, *input_parallel.shape[1:-1], -1)
        function = MatmulReduceScatter if layer.sequence_parallel else MatmulAllReduce
        return function.apply(input_parallel, *arguments)


def _column_arguments(weight=None, runtime_gather_output=None, *args, **kwargs):
    """ColumnParallelLinear.forward's arguments after ``input_``, bound as Megatron names them."""
    return weight, runtime_gather_output, args, kwargs


class ColumnAdapter:
    """ColumnParallelLinear.forward(input_, weight=None, runtime_gather_output=None): all-gather + mm
    under SP; otherwise mm with a chunked backward all-reduce."""

    name = "ColumnParallelLinear"
    shape = staticmethod(column_shape)

    def __init__(self, config: CocConfig):
        self.config = config
        self.layout = MatmulLayout.from_config(config)

    def guard(self, layer, input_, args, kwargs):
        weight, _, rest, rest_kwargs = _column_arguments(*args, **kwargs)
        # The caller's ``weight`` argument is passed on unchanged when the guard says Megatron's path.
        return column_guards(self.config, layer, input_, weight, rest, rest_kwargs)

    def layer_guard(self, layer):
        return column_layer_guards(self.config, layer)

    def call_guard(self, layer, input_, args, kwargs):
        weight, _, rest, rest_kwargs = _column_arguments(*args, **kwargs)
        return column_call_guards(layer, input_, weight, rest, rest_kwargs)

    def call(self, original, layer, input_, args, kwargs) -> LinearCall:
        weight, runtime_gather_output, _, _ = _column_arguments(*args, **kwargs)
        matrix = layer.weight if weight is None else weight
        sequence_parallel = layer.sequence_parallel
        return LinearCall(
            layer, LayerCase.of(row=False, sequence_parallel=sequence_parallel), column_shape(layer, input_),
            input_, input_, matrix, _rows(input_), "all_gather_matmul" if sequence_parallel else None,
            lambda x, kernel: self._finish(layer, self._output(layer, x, matrix, kernel), runtime_gather_output),
            lambda x: original(layer, x, weight, runtime_gather_output), tp_group(layer))

    def _output(self, layer, input_, matrix, kernel):
        group = tp_group(layer)
        if layer.sequence_parallel:
            arguments = (matrix, kernel, group, layer.gradient_accumulation_fusion, self.layout,
                         self.config.recompute_all_gather)
            if isinstance(kernel, FusedKernel):
                x2d = input_.reshape(-1, input_.shape[-1])
                output_parallel, _ = FusedAllGatherMatmul.apply(x2d, *arguments)
                return output_parallel.view(input_.shape[0] * group.size(), *input_.shape[1:-1], -1)
            output_parallel, _ = AllGatherMatmul.apply(input_, *arguments)
            return output_parallel
        return MatmulWithChunkedGradAllReduce.apply(
            input_, matrix, kernel, group, layer.gradient_accumulation_fusion, self.layout
        )

    @staticmethod
    def _finish(layer, output_parallel, runtime_gather_output):
        """Bias and the output gather, as Megatron's forward does them."""
        if not layer.skip_bias_add and layer.bias is not None:
            output_parallel = output_parallel + layer.bias
        gather_output = layer.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather_output and getattr(layer, "use_inference_optimized_all_gather", False) and not layer.training:
            # megatron-core >= 0.18 (transformer_impl="inference_optimized"): its NVLS all-gather.
            from megatron.core.tensor_parallel.inference_layers import (
                inference_all_gather_from_tensor_model_parallel_region,
            )

            output = inference_all_gather_from_tensor_model_parallel_region(output_parallel, layer.tp_group,
                                                                            layer.config)
        elif gather_output:
            from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

            output = gather_from_tensor_model_parallel_region(output_parallel, **group_argument(layer))
        else:
            output = output_parallel
        return output, (layer.bias if layer.skip_bias_add else None)


ADAPTERS = {adapter.name: adapter for adapter in (RowAdapter, ColumnAdapter)}
