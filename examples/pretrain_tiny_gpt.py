"""Pretrain a tiny Megatron-core GPT with tensor parallelism on CPU. Knows nothing of CoC.

    torchrun --nproc-per-node 2 examples/pretrain_tiny_gpt.py --steps 30 --json /tmp/run.json

An ordinary (if small) Megatron-core training loop: ``GPTModel`` built from the local layer
spec, tensor-parallel size = world size / context-parallel size (``--context-parallel-size``,
default 1), sequence parallelism on where TP > 1 (``--no-sequence-parallel`` turns it off; off at
TP 1, as Megatron-LM's arguments do), pipeline parallelism 1, gloo on CPU. With context
parallelism each rank keeps its share of the sequence the way Megatron-LM's training loop cuts it (``get_batch_on_this_cp_rank``: 2*CP chunks, CP rank r
keeps r and 2*CP-1-r; the mask's rows too), its loss is the sum of its token losses over the
global token count, and gradients are summed over the context-parallel group (what Megatron's
DDP does over its data-and-context-parallel group). Megatron's local attention refuses CP by
itself; something like coc-inject (``COC_CP_ALGO``) must provide it. Each step draws a batch of synthetic
tokens from a fixed seed (the same batch on every tensor-parallel rank), takes the model's
per-token cross-entropy (a masked mean), back-propagates, all-reduces the gradients of the
sequence-parallel parameters over the tensor-parallel group (what Megatron's
``finalize_model_grads`` does) and the data-parallel mean (what Megatron's DDP does), and steps
``torch.optim.Adam``. The reductions run after the backward, or with ``--overlap-grad-reduce``
during it, each as soon as its gradient is ready (Megatron's DDP with that flag). Dropout is 0, so
two runs give the same losses bit for bit.

Rank 0 prints one line per step and a summary; ``--json PATH`` also writes the losses, the step
times and, per rank, the bytes the attention layers keep for backward there. That figure is
measured in the second step, generically: forward pre/post hooks on every ``DotProductAttention``
module mark "inside an attention", and a ``torch.autograd.graph.saved_tensors_hooks`` pack hook
counts the distinct storages autograd saves meanwhile (whatever computes the attention).

Megatron-core assumes CUDA. The few ``CPU shim`` blocks below let it run on a CPU-only
machine; they are part of this example's platform setup only.
"""

import argparse
import inspect
import json
import statistics
import time

import torch
import torch.distributed as dist

# Megatron is imported before the arguments are parsed, as in Megatron's own pretrain scripts.
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import random as tp_random
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

# CPU shim 1: Megatron allocates sequence-parallel buffers (the all-gather / reduce-scatter
# outputs in tensor_parallel.mappings and .layers, utils.GlobalMemoryBuffer) and the rotary
# embedding's frequencies on `torch.cuda.current_device()`. Without CUDA, point that at the
# CPU. Megatron looks the function up at each call, so setting it here, after the import, works.
if not torch.cuda.is_available():
    torch.cuda.current_device = lambda: torch.device("cpu")


class CpuLayerNorm(torch.nn.LayerNorm):
    """CPU shim 2: a LayerNorm with Megatron's norm interface that supports sequence parallelism.

    The local spec's norm is apex's FusedLayerNorm (a CUDA kernel). Without apex Megatron falls
    back to a plain torch LayerNorm that refuses ``sequence_parallel``, because it does not flag
    its parameters for the gradient all-reduce. This one flags them like FusedLayerNorm does
    (``param.sequence_parallel``), and the training loop all-reduces those gradients.
    """

    def __init__(self, config, hidden_size, eps=1e-5, persist_layer_norm=False,
                 zero_centered_gamma=False, normalization="LayerNorm"):
        assert config.normalization == "LayerNorm", config.normalization
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        for param in (self.weight, self.bias):
            param.sequence_parallel = config.sequence_parallel


class AttentionMemory:
    """Bytes kept for backward by the attention cores: distinct storages that autograd saves while
    inside a ``DotProductAttention`` forward (``with memory.counting(): forward``)."""

    def __init__(self, model):
        self.inside = 0
        self.storages = {}
        self.layers = 0
        for module in model.modules():
            if isinstance(module, DotProductAttention):
                module.register_forward_pre_hook(self._enter)
                module.register_forward_hook(self._leave)
                self.layers += 1

    def _enter(self, module, args):
        self.inside += 1

    def _leave(self, module, args, output):
        self.inside -= 1

    def _pack(self, tensor):
        if self.inside:
            storage = tensor.untyped_storage()
            self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    def counting(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--ffn-hidden-size", type=int, default=1024)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--position-embedding-type", choices=("learned_absolute", "rope"),
                        default="learned_absolute")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--context-parallel-size", type=int, default=1)
    parser.add_argument("--num-query-groups", type=int, default=None)
    parser.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false",
                        help="turn sequence parallelism off (it is on by default)")
    parser.add_argument("--num-experts", type=int, default=None,
                        help="MoE: every MLP is a mixture of this many experts (alltoall dispatcher)")
    parser.add_argument("--expert-model-parallel-size", type=int, default=1)
    parser.add_argument("--moe-router-topk", type=int, default=2)
    parser.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                        help="MoE: the experts' TP (Megatron's default: the TP size; 1: EP may span TP ranks)")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=None,
                        help="default: the world size / the context-parallel size; the rest is data parallel")
    parser.add_argument("--moe-grouped-gemm", action="store_true",
                        help="MoE: the legacy GroupedMLP experts (the grouped_gemm extension; megatron-core 0.12 to 0.16)")
    parser.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false",
                        help="no biases in the linears (megatron-core 0.12 and 0.13 refuse them in MoE layers)")
    parser.add_argument("--overlap-grad-reduce", action="store_true",
                        help="reduce each gradient while the backward goes on, as Megatron's DDP does with "
                             "--overlap-grad-reduce (in one fixed order on every rank); default: after the backward")
    parser.add_argument("--json", metavar="PATH", help="rank 0 writes losses and step times here")
    return parser.parse_args()


def build_model(args, tp_size):
    config = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        context_parallel_size=args.context_parallel_size,
        ffn_hidden_size=args.ffn_hidden_size,
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=1,
        sequence_parallel=args.sequence_parallel,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        # Nothing that needs CUDA, apex or Transformer Engine:
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        cross_entropy_loss_fusion=False,
        # No dropout: deterministic runs.
        hidden_dropout=0.0,
        attention_dropout=0.0,
        add_bias_linear=args.add_bias_linear,
        **moe_settings(args),
    )
    layer_spec = get_gpt_layer_local_spec(num_experts=args.num_experts, moe_grouped_gemm=args.moe_grouped_gemm)
    layer_spec.submodules.input_layernorm = CpuLayerNorm
    layer_spec.submodules.pre_mlp_layernorm = CpuLayerNorm
    block_spec = TransformerBlockSubmodules(layer_specs=[layer_spec] * args.num_layers,
                                            layer_norm=CpuLayerNorm)
    return GPTModel(
        config=config,
        transformer_layer_spec=block_spec,
        vocab_size=args.vocab_size,
        max_sequence_length=args.seq_length,
        share_embeddings_and_output_weights=True,
        position_embedding_type=args.position_embedding_type,
    )


def moe_settings(args) -> dict:
    if not args.num_experts:
        return {}
    return dict(num_moe_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
                moe_token_dispatcher_type="alltoall", expert_model_parallel_size=args.expert_model_parallel_size,
                expert_tensor_parallel_size=args.expert_tensor_parallel_size,
                moe_aux_loss_coeff=1e-2, moe_router_load_balancing_type="aux_loss",
                moe_router_pre_softmax=args.moe_router_topk == 1, moe_grouped_gemm=args.moe_grouped_gemm)


def seed_experts(model, args):
    """Each expert's weights from a seed of its global index: CPU initialisation draws the same
    numbers on every rank, which would make every rank's local experts alike."""
    if not args.num_experts:
        return
    local = args.num_experts // args.expert_model_parallel_size
    first = parallel_state.get_expert_model_parallel_rank() * local
    for name, param in model.named_parameters():
        if ".local_experts." in name:
            index = int(name.partition(".local_experts.")[2].partition(".")[0])
        elif name.endswith(("experts.weight1", "experts.weight2")):  # grouped experts: all local experts in one
            index = 0
        else:
            continue
        generator = torch.Generator().manual_seed(args.seed + 7919 * (first + index) + len(name))
        with torch.no_grad():
            param.normal_(0.0, 0.02, generator=generator)


def cpu_moe_shims():
    """CPU shim 5, for MoE: the alltoall dispatcher makes a CUDA side stream for its split counts'
    device-to-host copies (an inert one here), and without that copy hands all_to_all_single its
    split sizes as tensors, which gloo takes only as lists."""
    import contextlib

    class Event:
        def synchronize(self):
            pass

    class Stream:
        def __init__(self, *args, **kwargs):
            pass

        def record_event(self, *args, **kwargs):
            return Event()

        def wait_stream(self, *args, **kwargs):
            pass

        def synchronize(self):  # megatron-core 0.12 waits on the side stream itself
            pass

    torch.cuda.Stream = Stream
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    torch.cuda.current_stream = lambda *args, **kwargs: Stream()
    all_to_all_single = dist.all_to_all_single

    def with_list_splits(output, input, output_split_sizes=None, input_split_sizes=None, *args, **kwargs):
        as_list = lambda sizes: sizes.tolist() if hasattr(sizes, "tolist") else sizes  # noqa: E731
        return all_to_all_single(output, input, as_list(output_split_sizes), as_list(input_split_sizes),
                                 *args, **kwargs)

    dist.all_to_all_single = with_list_splits


class GradReduceInBackward:
    """``--overlap-grad-reduce``: what Megatron's DDP does with that flag, per parameter instead of per
    bucket. A gradient's all-reduce starts as soon as autograd has accumulated it (a post-accumulate
    hook), while the backward goes on; ``finish()`` waits for them and applies the mean's divisor.
    They are issued in one fixed order on every rank (reverse registration, as DDP's buckets): a
    gradient ready early waits for those before it, so same-shaped all-reduces never pair up wrong.
    ``entries``: (parameter, group, divisor), one group per parameter (two reductions of one gradient in
    flight at once would race on it: those stay after the backward)."""

    def __init__(self, entries):
        self.entries = list(reversed(entries))
        self.position = {id(param): index for index, (param, _, _) in enumerate(self.entries)}
        self.ready, self.next, self.handles = [False] * len(self.entries), 0, []
        for param, _, _ in self.entries:
            param.register_post_accumulate_grad_hook(self._accumulated)

    def _accumulated(self, param):
        self.ready[self.position[id(param)]] = True
        while self.next < len(self.entries) and self.ready[self.next]:
            self._issue(self.next)

    def _issue(self, index):
        param, group, _ = self.entries[index]
        self.next = index + 1
        if param.grad is not None:
            self.handles.append(dist.all_reduce(param.grad, group=group, async_op=True))

    def finish(self):
        """After the backward: the rest issued in order (a parameter without a gradient), all waited for."""
        while self.next < len(self.entries):
            self._issue(self.next)
        for handle in self.handles:
            handle.wait()
        for param, _, divisor in self.entries:
            if param.grad is not None and divisor != 1:
                param.grad /= divisor
        self.ready, self.next, self.handles = [False] * len(self.entries), 0, []


def gradient_reductions(model, cp_group, dp_group, tp_group, sp_params):
    """Each parameter's reductions after the backward, in order: (group, divisor) each. The context-parallel
    sum (each rank holds its sequence shard's gradient), the data-parallel mean (an expert's over the ranks
    holding the same expert) and, for the replicated sequence-parallel parameters (layer norms), the
    tensor-parallel sum (what Megatron's ``finalize_model_grads`` does)."""
    sequence_parallel = {id(param) for param in sp_params}
    reductions = []
    for name, param in model.named_parameters():
        if not param.requires_grad:  # no gradient to reduce (and no hook to take)
            continue
        groups = [] if cp_group.size() == 1 else [(cp_group, 1)]
        data = parallel_state.get_expert_data_parallel_group() if ".local_experts." in name else dp_group
        groups += [] if data.size() == 1 else [(data, data.size())]
        groups += [(tp_group, 1)] if id(param) in sequence_parallel else []
        reductions.append((param, groups))
    return reductions


def synthetic_batch(args, step, data_rank=0):
    """Token sequences from a fixed random bigram table (90% follow it, 10% random tokens).

    Seeded by (seed, step, data-parallel rank), so every rank of a model replica draws the same
    batch; the table makes the data learnable, so the loss falls below log(vocab).
    """
    table = torch.randperm(args.vocab_size, generator=torch.Generator().manual_seed(args.seed))
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step + 7_919 * data_rank)
    b, s = args.micro_batch_size, args.seq_length
    tokens = torch.empty(b, s + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(args.vocab_size, (b,), generator=gen)
    noise = torch.randint(args.vocab_size, (b, s), generator=gen)
    follow = torch.rand(b, s, generator=gen) < 0.9
    for t in range(s):
        tokens[:, t + 1] = torch.where(follow[:, t], table[tokens[:, t]], noise[:, t])
    loss_mask = torch.ones(b, s)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), loss_mask


def on_this_cp_rank(tensor, dim, cp_size, cp_rank):
    """Megatron-LM's get_batch_on_this_cp_rank layout along ``dim`` (2*CP chunks; r and 2*CP-1-r)."""
    if cp_size == 1:
        return tensor
    chunks = tensor.unflatten(dim, (2 * cp_size, -1))
    kept = chunks.index_select(dim, torch.tensor([cp_rank, 2 * cp_size - 1 - cp_rank]))
    return kept.flatten(dim, dim + 1)


def cpu_pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
    """CPU shim 4: Megatron's rotary embedding under CP builds its index with pin_memory().cuda()."""
    return on_this_cp_rank(pos_emb, seq_dim, cp_group.size(), cp_group.rank())


def main():
    args = parse_args()

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    cp_size = args.context_parallel_size
    if world_size % cp_size:
        raise SystemExit(f"--context-parallel-size {cp_size} must divide the world size {world_size}")
    tp_size = args.tensor_model_parallel_size or world_size // cp_size
    if world_size % (tp_size * cp_size):
        raise SystemExit(f"TP {tp_size} x CP {cp_size} must divide the world size {world_size}")
    if tp_size == 1:  # as Megatron-LM's arguments do: no sequence parallelism without tensor parallelism
        args.sequence_parallel = False
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size, context_parallel_size=cp_size,
                                             pipeline_model_parallel_size=1,
                                             expert_model_parallel_size=args.expert_model_parallel_size,
                                             expert_tensor_parallel_size=args.expert_tensor_parallel_size)
    if args.num_experts:
        cpu_moe_shims()
    dp_group, data_rank = parallel_state.get_data_parallel_group(), parallel_state.get_data_parallel_rank()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    cp_group, cp_rank = parallel_state.get_context_parallel_group(), parallel_state.get_context_parallel_rank()
    if cp_size > 1:
        from megatron.core.models.common.embeddings import rotary_pos_embedding

        rotary_pos_embedding.get_pos_emb_on_this_cp_rank = cpu_pos_emb_on_this_cp_rank
    if args.seq_length % (2 * cp_size * (tp_size if args.sequence_parallel else 1)):
        raise SystemExit(f"--seq-length {args.seq_length} must be divisible by 2 x CP {cp_size}"
                         + (f" x TP {tp_size} (sequence parallel)" if args.sequence_parallel else ""))

    # Seeding: the same torch seed on every rank, so the CPU-initialised master weights (of which
    # each rank keeps its own shard) agree. Megatron's model_parallel_cuda_manual_seed seeds CUDA
    # generators.
    # CPU shim 3: Megatron forks its "CUDA RNG tracker" around the sequence-parallel part of the
    # transformer block (and around dropout); the regular tracker reads and sets CUDA generator
    # state. The tracker only matters for dropout, which is 0 here, so use Megatron's no-op
    # tracker (fork() is a nullcontext).
    torch.manual_seed(args.seed)
    if "force_reset" in inspect.signature(tp_random.initialize_rng_tracker).parameters:
        tp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    else:  # megatron-core 0.12: no force_reset, and nothing initialised it yet in this process
        tp_random.initialize_rng_tracker(inference_rng_tracker=True)

    model = build_model(args, tp_size)
    seed_experts(model, args)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    sp_params = [p for p in model.parameters() if getattr(p, "sequence_parallel", False)]
    reductions = gradient_reductions(model, cp_group, dp_group, tp_group, sp_params)
    in_backward = None
    if args.overlap_grad_reduce:
        in_backward = GradReduceInBackward([(param, *groups[0]) for param, groups in reductions if len(groups) == 1])
        reductions = [(param, groups) for param, groups in reductions if len(groups) > 1]
    attention_memory = AttentionMemory(model)
    # Counted in step 2, not step 1: whatever runs only at a first call (warm-up, trials) is no
    # part of what a training step keeps.
    memory_step = min(2, args.steps)

    s = args.seq_length
    position_ids = torch.arange(s).unsqueeze(0).expand(args.micro_batch_size, s)
    attention_mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)  # True = masked

    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        moe = (f", MoE {args.num_experts} experts top-{args.moe_router_topk} EP {args.expert_model_parallel_size}"
               if args.num_experts else "")
        print(f"tiny GPT{moe}: TP {tp_size}, CP {cp_size}, sequence parallel {args.sequence_parallel}, "
              f"{args.num_layers} layers, hidden {args.hidden_size}, seq {s}, micro batch "
              f"{args.micro_batch_size}, vocab {args.vocab_size}, {n_params} parameters per rank",
              flush=True)

    losses, step_times = [], []
    run_start = time.perf_counter()
    for step in range(1, args.steps + 1):
        tokens, labels, loss_mask = synthetic_batch(args, step, data_rank)
        tokens_in_batch = loss_mask.sum()
        tokens, labels, loss_mask, positions = (on_this_cp_rank(t, 1, cp_size, cp_rank)
                                                for t in (tokens, labels, loss_mask, position_ids))
        mask = on_this_cp_rank(attention_mask, 2, cp_size, cp_rank)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        if step == memory_step:  # the attention's saved bytes, counted in one step
            with attention_memory.counting():
                per_token_loss = model(tokens, positions, mask, labels=labels)
        else:
            per_token_loss = model(tokens, positions, mask, labels=labels)  # [b, s / CP]
        loss = (per_token_loss * loss_mask).sum() / tokens_in_batch
        loss.backward()
        if in_backward is not None:
            in_backward.finish()
        for param, groups in reductions:  # gradient_reductions: those not reduced during the backward
            for group, divisor in groups:
                if param.grad is not None:
                    dist.all_reduce(param.grad, group=group)
                    if divisor != 1:
                        param.grad /= divisor
        optimizer.step()
        step_times.append(time.perf_counter() - start)
        loss = loss.detach()
        if cp_size > 1:
            dist.all_reduce(loss, group=cp_group)
        if dp_group.size() > 1:  # the replicas' mean loss
            dist.all_reduce(loss, group=dp_group)
            loss /= dp_group.size()
        losses.append(loss.item())
        if rank == 0:
            print(f"step {step:>2} | loss {losses[-1]:.9f} | step time "
                  f"{step_times[-1] * 1e3:.1f} ms", flush=True)
    wall = time.perf_counter() - run_start
    saved = [None] * world_size
    dist.all_gather_object(saved, attention_memory.bytes)

    if rank == 0:
        later = step_times[1:] or step_times
        print(f"done: {args.steps} steps | loss {losses[0]:.6f} -> {losses[-1]:.6f} | "
              f"median step time {statistics.median(later) * 1e3:.1f} ms (after step 1) | "
              f"loop {wall:.2f} s", flush=True)
        per_rank = ", ".join(f"rank {r} {b / 2**20:.2f} MiB" for r, b in enumerate(saved))
        print(f"attention memory kept for backward ({attention_memory.layers} DotProductAttention layers, "
              f"step {memory_step}): {per_rank}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"losses": losses, "step_times": step_times, "world_size": world_size,
                           "tensor_parallel": tp_size, "context_parallel": cp_size,
                           "sequence_parallel": args.sequence_parallel,
                           "attention_layers": attention_memory.layers, "attention_saved_bytes": saved,
                           "args": vars(args)},
                          f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
