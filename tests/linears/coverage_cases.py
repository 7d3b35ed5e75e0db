"""Worker functions for tests/linears/test_coverage.py: a small model of real megatron-core layers
(TP 2) trained one step with coc-inject installed; returns what coc-inject said and reported."""

from __future__ import annotations

import io
import logging

import torch

from layer_cases import build_layer, make_input


_MEGATRON_ROW_FORWARD = []


def other_patch(self, *args, **kwargs):
    """A foreign patcher's forward (as MindSpeed's adaptor or a user's monkey-patch would be):
    it calls Megatron's own forward."""
    return _MEGATRON_ROW_FORWARD[0](self, *args, **kwargs)


class Block(torch.nn.Module):
    def __init__(self, sequence_parallel, te_layers=()):
        super().__init__()
        self.linear_fc1 = build_layer("column", sequence_parallel=sequence_parallel, bias=True,
                                      skip_bias_add=False, dtype="float32", hidden=32, ffn=64)
        self.linear_fc2 = build_layer("row", sequence_parallel=sequence_parallel, bias=True,
                                      skip_bias_add=False, dtype="float32", hidden=32, ffn=64)
        self.te = torch.nn.ModuleList(te_layers)

    def forward(self, x):
        hidden, _ = self.linear_fc1(x)
        out, _ = self.linear_fc2(torch.nn.functional.gelu(hidden))
        return out


def one_step(*, sequence_parallel=True, te=False, replace_row_forward=False, config_options=None, steps=1):
    """Build Model(decoder.layers.0 = Block), install CoC, train ``steps`` steps; returns the log
    lines at INFO and above and the coverage report."""
    from coc_inject import job, log
    from coc_inject.linears import install as linears
    from coc_inject.config import CocConfig
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    linears.uninstall()
    te_layers = []
    if te:
        from fakes import te_layers as fake

        classes = fake.register()
        te_layers = [classes["TEColumnParallelLinear"](32, 16), classes["TEColumnParallelLinear"](32, 16),
                     classes["TELayerNormColumnParallelLinear"](32, 16), classes["TERowParallelLinear"](16, 32)]
    model = torch.nn.Module()
    model.decoder = torch.nn.Module()
    model.decoder.layers = torch.nn.ModuleList([Block(sequence_parallel, te_layers)])
    wrapped = torch.nn.Module()
    wrapped.module = model  # like DDP's .module: dropped from the names
    block = model.decoder.layers[0]
    x = make_input("column", block.linear_fc1, sequence_parallel=sequence_parallel, seq=16, batch=2,
                   dtype="float32")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setLevel(logging.INFO)
    log.configure("info")
    log.logger.addHandler(handler)
    assert linears.install(CocConfig(**{"parallel_num": 2, **(config_options or {})}))
    try:
        if replace_row_forward:
            _MEGATRON_ROW_FORWARD[:] = [job.current().patches.original(RowParallelLinear, "forward")]
            RowParallelLinear.forward = other_patch
        coverage = linears.engine().coverage
        for _ in range(steps):
            optimizer.zero_grad()
            block(x).pow(2).mean().backward()
            optimizer.step()
        report = coverage.report()
        summary_lines = coverage.summary_line(), coverage.warnings()
    finally:
        linears.uninstall()  # leaves the foreign patch in place (coc_inject.patches): that patcher undoes its own
        if replace_row_forward:
            RowParallelLinear.forward = _MEGATRON_ROW_FORWARD[0]
        log.logger.removeHandler(handler)
    return {"log": stream.getvalue().splitlines(), "report": report, "summary": summary_lines}
