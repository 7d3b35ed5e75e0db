"""A plain Megatron-core tensor-parallel MLP step, run with torchrun. Knows nothing of CoC.

    torchrun --nproc-per-node 2 examples/tp_mlp.py --out /tmp/run.pt

Column(hidden -> ffn) -> gelu -> Row(ffn -> hidden), one forward + backward on CPU + gloo.
It saves the output, the input gradient and every parameter gradient of each rank to
``--out`` (with ``_rank<r>`` appended), plus how many collectives each direction issued --
the numbers `make demo` and the tests compare between a run with CoC off and one with it on.
"""

import argparse
import collections
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
               "reduce_scatter_tensor", "reduce_scatter_single")


def count_collectives(counts, phase):
    """Count torch.distributed collective calls per phase (plain diagnostics, any backend)."""
    for name in COLLECTIVES:
        function = getattr(dist, name, None)
        if function is None:
            continue

        def counted(*args, _function=function, _name=name, **kwargs):
            counts[phase[0]][_name] += 1
            return _function(*args, **kwargs)

        setattr(dist, name, counted)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-length", type=int, default=13)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--ffn-hidden-size", type=int, default=256)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    tp = dist.get_world_size()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    config = ModelParallelConfig(tensor_model_parallel_size=tp, use_cpu_initialization=True,
                                 params_dtype=torch.float32, gradient_accumulation_fusion=False)
    torch.manual_seed(0)
    init = torch.nn.init.xavier_normal_
    fc1 = ColumnParallelLinear(args.hidden_size, args.ffn_hidden_size, config=config, init_method=init,
                               bias=True, gather_output=False)
    fc2 = RowParallelLinear(args.ffn_hidden_size, args.hidden_size, config=config, init_method=init,
                            bias=True, input_is_parallel=True, skip_bias_add=False)
    x = torch.randn(args.seq_length, args.micro_batch_size, args.hidden_size, requires_grad=True)

    counts, phase = collections.defaultdict(collections.Counter), ["forward"]
    count_collectives(counts, phase)
    hidden, _ = fc1(x)
    output, _ = fc2(torch.nn.functional.gelu(hidden))
    phase[0] = "backward"
    output.backward(torch.ones_like(output))

    rank = dist.get_rank()
    result = {"output": output.detach(), "input_grad": x.grad,
              "forward_collectives": dict(counts["forward"]), "backward_collectives": dict(counts["backward"])}
    for prefix, layer in (("fc1", fc1), ("fc2", fc2)):
        for name, param in layer.named_parameters():
            result[f"{prefix}.{name}.grad"] = param.grad
    root, ext = os.path.splitext(args.out)
    torch.save(result, f"{root}_rank{rank}{ext or '.pt'}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
