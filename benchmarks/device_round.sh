#!/bin/bash
# One device lease's checks, most wanted first, each under its own time limit (a lent machine has
# minutes, not hours). ROUND=wgrad: #44 item 6's weight gradient (benchmarks/wgrad_device.py).
# ROUND=cp4: the context-parallel cases at 2 and 4 ranks, then the other wings at 4. ROUND=flash:
# COC_FLASH_ATTN=1 on a GPT training step against Megatron's local attention (benchmarks/flash_gpt_device.py).
# ROUND=host: the launch-bound GPT step (8 layers, hidden 1024, seq 1024, bf16, world size 1) off (no bootstrap)
# vs every wing auto, 3 rounds interleaved: first and steady step times, losses (benchmarks/host_gpt.py, #52).
# ROUND=ranks (default): which collectives gloo moves as CUDA tensors, then the self-test's
# multi-rank cases on real kernels with 2 (then 4) ranks sharing the GPU over gloo
# (COC_SELFTEST_DEVICE=cuda-gloo), one wing per run so that one abort loses one wing, then the
# one-rank cases over NCCL. ROUND=lab: `coc-inject lab` on real models' per-rank shapes (docs/lab.md).
# Outputs land in $OUT (the device tool's folder) or benchmarks/out/device.
OUT=${OUT:-benchmarks/out/device}; mkdir -p "$OUT" /tmp/coc-device-site
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/coc-device-site .whl/*.whl
export PYTHONPATH=/tmp/coc-device-site:$PWD PYTHONUNBUFFERED=1
nvidia-smi -L; python3 -c "import torch, megatron.core as m; print('torch', torch.__version__, 'megatron-core', m.__version__)"
failed=0  # any step's failure makes the round's exit status 1 (each step still runs)
step() {
    local limit=$1 rc; shift; echo "=== $* (limit ${limit}s) $(date +%T)"
    # rc 3: the self-test passed what it ran and named what it could not check (one rank: the multi-rank wings)
    timeout "$limit" "$@"; rc=$?; echo "=== rc $rc $(date +%T)"; [ $rc -eq 0 ] || [ $rc -eq 3 ] || failed=1
}
run="python3 -m torch.distributed.run"
shared() {  # shared LIMIT RANKS WINGS NAME: the self-test's WINGS on RANKS ranks sharing the GPU over gloo
    step "$1" env COC_SELFTEST_DEVICE=cuda-gloo $run --nproc-per-node "$2" -m coc_inject.selftest --cases "$3" \
        --json "$OUT/selftest-cuda-gloo-$2-$4.json"
}
if [ "${ROUND:-ranks}" = lab ]; then  # the overlap lab (docs/lab.md): one process, one GPU, NVLink-4 preset, ~5 min
    lab() {  # lab LIMIT NAME ARGS...: one model's wings off and on, rows to $OUT/lab-NAME.json
        local limit=$1 name=$2; shift 2
        step "$limit" python3 -m coc_inject lab --device cuda --preset nvlink4 --json "$OUT/lab-$name.json" "$@"
    }
    # rows are written as they come: a step cut short keeps what it measured
    lab 100 llama3-70b --model llama3-70b --steps 3 --warmup 2      # CoC auto, every wing auto: share of max(C, M)
    lab 55 mixtral-ep8 --model mixtral-8x7b --part 0 --steps 3 --warmup 2
    lab 55 qwen3-like --model qwen3-30b-a3b --steps 3 --warmup 2
    lab 40 llama3-8b-tp8 --model llama3-8b --part 2 --steps 3 --warmup 2
    lab 35 llama3-8b-cp4 --model llama3-8b-cp --steps 3 --warmup 2
    exit $failed
fi
if [ "${ROUND:-ranks}" = wgrad ]; then
    step 90 python3 benchmarks/wgrad_device.py --json "$OUT/wgrad.json"
    exit $failed
fi
if [ "${ROUND:-ranks}" = flash ]; then  # COC_FLASH_ATTN=1 on a whole GPT step against Megatron's local attention
    step 240 python3 benchmarks/flash_gpt_device.py --shapes 2048x1024,4096x1024,8192x1024 --batch 1 --rounds 2 \
        --steps 6 --json "$OUT/flash-gpt.json"
    exit $failed
fi
if [ "${ROUND:-ranks}" = host ]; then  # what the wings cost the host where none has anything to do (issue 52)
    step 150 python3 benchmarks/host_gpt.py --device cuda --layers 8 --hidden 1024 --seq 1024 --batch 1 --rounds 3 \
        --steps 10 --json "$OUT/host-gpt.json"
    exit $failed
fi
if [ "${ROUND:-ranks}" = cp4 ]; then  # the ring-family CP cases (sends staged via host), then the wings at 4 ranks
    for world in 2 4; do shared 75 $world context-parallel context-parallel; done
    shared 120 4 linears,multi-copy,moe wings
    exit $failed
fi
step 40 $run --nproc-per-node 2 benchmarks/gloo_cuda_probe.py
for wing in linears multi-copy moe context-parallel meter; do shared 90 2 $wing $wing; done
shared 60 4 context-parallel context-parallel
step 75 $run --nproc-per-node 1 -m coc_inject.selftest --json "$OUT/selftest-gpu-1.json"
exit $failed
