"""Run by test_coverage_tree.py in a bootstrapped process (sitecustomize on PYTHONPATH, COC_* set): a GPT
(in a wrapper, or beside a standalone layer), one training step; prints what the first-step summary
saw, whether it touched the heap, and what a pass over the heap sees now."""

import gc
import inspect
import json
import os
import sys

import torch

mode = sys.argv[2]
holder = torch.nn.Module()  # built before Megatron's import: given the model later (its name's prefix)
holder.chunks = torch.nn.ModuleList()

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo", rank=0, world_size=1)
torch.cuda.current_device = lambda: torch.device("cpu")
from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.tensor_parallel import ColumnParallelLinear  # noqa: E402
from megatron.core.tensor_parallel import random as tp_random  # noqa: E402
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from coc_inject import job  # noqa: E402
from coc_inject.testbed.cpu import CpuLayerNorm  # noqa: E402

parallel_state.initialize_model_parallel(1, 1)
reset = {"force_reset": True} if "force_reset" in inspect.signature(tp_random.initialize_rng_tracker).parameters else {}
tp_random.initialize_rng_tracker(inference_rng_tracker=True, **reset)  # 0.12.1 has no force_reset
spec = get_gpt_layer_local_spec()
spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = CpuLayerNorm
spec = TransformerBlockSubmodules(layer_specs=[spec] * 2, layer_norm=CpuLayerNorm)
config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                           gradient_accumulation_fusion=False, hidden_dropout=0.0, attention_dropout=0.0)
model = GPTModel(config, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=16)
if mode == "early wrapper":  # the tracker saw ``chunks`` given the model, never ``holder`` given ``chunks``
    holder.chunks.append(model)
else:
    holder = torch.nn.ModuleList([model])  # built since: every edge seen
if mode == "standalone":  # a layer never called, outside the model's tree: the tracker cannot rule out garbage
    extra = ColumnParallelLinear(32, 32, config=config, init_method=torch.nn.init.zeros_, bias=False)
optimizer = torch.optim.Adam(holder.parameters(), lr=1e-4)
tokens = torch.randint(0, 64, (1, 17))
walked = []
get_objects, collect = gc.get_objects, gc.collect
gc.get_objects = lambda *a, **k: walked.append("get_objects") or get_objects(*a, **k)
gc.collect = lambda *a, **k: walked.append("collect") or collect(*a, **k)
mask = torch.triu(torch.ones(1, 1, 16, 16, dtype=torch.bool), diagonal=1)
loss = model(tokens[:, :-1], torch.arange(16).unsqueeze(0), mask, labels=tokens[:, 1:]).float().mean()
loss.backward()
optimizer.step()  # the first-step summary
gc.get_objects, gc.collect = get_objects, collect
coverage = job.current().coverage
seen = {"walked": walked, "tracker": job.current().tracker is not None,
        "names": sorted(record.name for record in coverage.job.records.values()),
        "local": coverage.model.local_layers, "foreign": coverage.model.foreign_layers}
coverage.model.local_layers = 0
coverage.inspect_model(walk=True)
heap = {"names": sorted(record.name for record in coverage.job.records.values()),
        "local": coverage.model.local_layers}
print("RESULT " + json.dumps({"seen": seen, "heap": heap}))
dist.destroy_process_group()
