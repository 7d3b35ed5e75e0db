"""A LayerNorm with Megatron's norm interface that supports sequence parallelism on the CPU.

The local spec's norm is apex's FusedLayerNorm (a CUDA kernel); without apex Megatron falls back
to a torch LayerNorm that refuses ``sequence_parallel`` because it does not flag its parameters
for the gradient all-reduce. This one flags them as FusedLayerNorm does. For bench and tests.
"""

import torch


class CpuLayerNorm(torch.nn.LayerNorm):
    def __init__(self, config, hidden_size, eps=1e-5, persist_layer_norm=False, zero_centered_gamma=False,
                 normalization="LayerNorm"):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        for param in (self.weight, self.bias):
            param.sequence_parallel = config.sequence_parallel
