# The two commands of the README:
#   make demo   the main job: an unmodified tiny GPT pretraining script under torchrun (TP=2,
#               sequence parallel, CPU + gloo), CoC off then on via the environment only
#   make test   the full test suite on the newest megatron-core, plus the layer, guard, end-to-end,
#               CP, copies and MoE suites on a middle and the oldest supported release, and the MoE
#               suite on an older one, each in its own venv
# Both create their virtual environments on first use. torch is pinned to the local CPU wheel
# first, so nothing pulls a multi-GB CUDA build from the registry.
#
# megatron-core >= 0.17 declares requires-python >= 3.12 but its wheel runs on 3.11: it is
# installed with --no-deps --ignore-requires-python, then its own requirements (numpy,
# packaging; from 0.18 `import megatron.core` also imports triton). 0.12.x declares a training stack
# (nvidia-modelopt[torch], wandb, zarr, tensorstore, ...; modelopt would pull another torch): it is
# installed with --no-deps too, then the two `import megatron.core` needs (pip then names the rest
# as not installed: nothing the tests or a CoC job import).

PYTHON ?= python3
TORCH ?= torch==2.13.0
MEGATRON_NEWEST ?= 0.19.2
MEGATRON_NEWEST_REQUIRES ?= numpy "packaging>=24.2" triton
# Holistic Trace Analysis' trace loader, for the test that COC_TRACE's folders load in it (newest venv;
# --no-deps: its declared requirements pull jupyterlab, which the loader never imports).
HTA_PACKAGES ?= holistictraceanalysis==0.5.0 pandas==3.1.1 plotly==7.1.0 narwhals==2.29.0 pydot==4.0.1 \
	pyparsing==3.3.3 psutil==7.2.2 pyyaml==6.0.4 python-dateutil==4.0.0 pytz==2026.6 tzdata==2026.6 six==1.17.0
MEGATRON_MIDDLE ?= 0.16.1
MEGATRON_OLDER ?= 0.13.1
MEGATRON_OLDEST ?= 0.12.1
MEGATRON_OLDEST_REQUIRES ?= numpy packaging
VENV ?= .venv
VENV_MIDDLE ?= .venv-megatron-$(MEGATRON_MIDDLE)
VENV_OLDER ?= .venv-megatron-$(MEGATRON_OLDER)
VENV_OLDEST ?= .venv-megatron-$(MEGATRON_OLDEST)
SOURCES := pyproject.toml $(shell find coc_inject sitecustomize -name '*.py' 2>/dev/null)
# What runs on the older releases: the suites that touch Megatron's layers or launch a job.
LAYER_SUITES := tests/linears/test_layers_tp2.py tests/linears/test_layers_tp4.py tests/linears/test_patching.py \
	tests/linears/test_megatron_guards.py tests/linears/test_injection_e2e.py tests/linears/test_tuning.py tests/linears/test_coverage.py \
	tests/linears/test_autocast.py
# Context parallelism on the older releases: the CP=2 GPT cases and the construction errors. TEST_SCOPE=older-release
# skips the cases marked newest_only (tests/scope.py): coc-inject's own logic, tested once on the newest release.
CP_SUITES := tests/context_parallel/test_cp_gpt.py tests/multi_copy/test_multi_copy.py tests/multi_copy/test_sequence_copies.py
# MoE on the older releases: every case but expert biases (0.13 refuses them for MoE). 0.13 to 0.15 run the
# pieces through the dispatcher's stages (0.16+: the layer's), 0.12 through its dispatcher's token_permutation /
# token_unpermutation (there a few of the layer cases, tests/moe/test_moe.py's not_on_oldest, and MindSpeed's
# TP 2 SP x EP 2 job under torchrun with grouped-GEMM experts, its linears chunked: MOE_OLDEST; the
# SequentialMLP job runs when the file is called directly). $(MEGATRON_OLDER) runs this
# suite alone, for the dispatcher-stage path (its linears, CP and copies are 0.16.1's code paths).
# test_moe_grouped.py: the legacy GroupedMLP's pieces (0.12 to 0.16 have it; the newest release skips them, saying why).
# test_moe_ddp.py: the pieces under Megatron's DDP with overlap_grad_reduce (0.12 to 0.15 assert one hook call per parameter).
MOE_SUITES := tests/moe/test_moe.py tests/moe/test_moe_grouped.py tests/moe/test_moe_ddp.py
MOE_OLDEST := 'tests/moe/test_moe_e2e.py::test_tp2_sp_by_ep2_trains_as_off_with_the_moe_layers_in_pieces[grouped]'
# The MoE pieces' settings agreed across ranks on the oldest release too (its dispatcher's expert groups are
# properties over the parallel state; #51 item 3).
AGREEMENT_OLDEST := 'tests/settings/test_wing_agreement.py::test_pieces_auto_beside_1_is_named_on_both_ranks'

LINK ?= 1gbit
ROUNDS ?= 3

.PHONY: demo demo-link demo-cp demo-copies demo-moe test test-newest test-middle test-older test-oldest bench bench-link bench-startup bench-accounting bench-measure bench-trials bench-cp-memory bench-attention bench-attention-link bench-flash bench-host device-check clean

demo: $(VENV)/.installed
	$(VENV)/bin/python examples/demo.py

# make demo runs its emulated-link part over $(LINK) (root); this one runs it at another rate.
demo-link: $(VENV)/.installed
	$(VENV)/bin/python examples/demo.py --link-rate $(LINK)

# make demo's context-parallel parts alone, the link's CP=2 runs (ring, allgather, auto)
# interleaved over $(ROUNDS) rounds: the ring vs allgather figure of benchmarks/RESULTS.md.
demo-cp: $(VENV)/.installed
	$(VENV)/bin/python examples/demo.py --part cp --cp-rounds $(ROUNDS) --link-rate $(LINK)

# make demo's multi-copy comparison alone: off, COC_PARALLEL_NUM=auto, COC_MULTI_COPY=2, both, and
# COC_MULTI_COPY=auto over the link, interleaved over $(ROUNDS) rounds (the figures of benchmarks/RESULTS.md).
demo-copies: $(VENV)/.installed
	$(VENV)/bin/python examples/demo.py --part copies --copies-rounds $(ROUNDS) --link-rate $(LINK)

# make demo's MoE part alone: off vs COC_MOE_OVERLAP=auto over the link, interleaved over $(ROUNDS) rounds.
demo-moe: $(VENV)/.installed
	$(VENV)/bin/python examples/demo.py --part moe --moe-rounds $(ROUNDS) --link-rate $(LINK)

bench: $(VENV)/.installed
	$(VENV)/bin/coc-inject bench

bench-link: $(VENV)/.installed
	$(VENV)/bin/coc-inject bench --link $(LINK) --out benchmarks/out/link-$(LINK)

# The older releases' suites run side by side (each in its own venv; output kept per suite): much of
# their time is waiting on ranks and launches, and each keeps about 0.6 of a core busy. All three at once:
# 142 s against 163 s two at a time (the third starting when one ended), measured back to back.
test: test-newest
	$(MAKE) --no-print-directory -j3 -Otarget test-middle test-oldest test-older

test-newest: $(VENV)/.installed
	$(VENV)/bin/python -m pytest

test-middle: $(VENV_MIDDLE)/.installed
	TEST_SCOPE=older-release $(VENV_MIDDLE)/bin/python -m pytest $(LAYER_SUITES) $(CP_SUITES) $(MOE_SUITES)

test-older: $(VENV_OLDER)/.installed
	TEST_SCOPE=older-release $(VENV_OLDER)/bin/python -m pytest $(MOE_SUITES)

test-oldest: $(VENV_OLDEST)/.installed
	TEST_SCOPE=older-release $(VENV_OLDEST)/bin/python -m pytest $(LAYER_SUITES) $(CP_SUITES) $(MOE_SUITES) $(MOE_OLDEST) $(AGREEMENT_OLDEST)

bench-startup: $(VENV)/.installed
	$(VENV)/bin/python -m coc_inject.bench.startup

bench-accounting: $(VENV)/.installed
	$(VENV)/bin/python benchmarks/accounting.py

# COC_MEASURE's cost on the whole GPT step over the emulated link (with and without the meter, interleaved
# over $(ROUNDS) rounds) and its exposed time of the off step against off - the compute-only twin (root).
bench-measure: $(VENV)/.installed
	$(VENV)/bin/python benchmarks/measure_cost.py --rounds $(ROUNDS)

# Each wing's auto trials: step 1's extra time and the ranks' extra peak memory against the same job
# without trials (2 CPU ranks, loopback, a fresh tune cache; about 2 min here).
bench-trials: $(VENV)/.installed
	$(VENV)/bin/python benchmarks/trials_cost.py --json benchmarks/results/trials-cost.json

# The attention kernels against what a user runs instead: block kernel fused vs reference, ring CP=2
# vs scaled_dot_product_attention in one process (seq 4096, 8192; fp32, bf16), peak memory growth.
bench-flash: $(VENV)/.installed
	$(VENV)/bin/python -m coc_inject.bench.cases.flash --out benchmarks/results/flash

# What coc-inject costs the host (issue 52): per wrapped call whose wing steps aside (CPU time beyond Megatron's
# call, the wrapper alone, Python calls added), then the GPT training step's Python calls per step and first /
# steady step times, off vs each wing on auto and every wing auto, at TP 1 and TP 2 (benchmarks/results/host).
HOST_GPT := --device cpu --calls --layers 8 --hidden 64 --seq 64 --heads 4 --vocab 512 --steps 20 --rounds 2 \
	--variants "linears auto,copies auto,moe auto,cp auto,every wing auto"
bench-host: $(VENV)/.installed
	mkdir -p benchmarks/results/host
	$(VENV)/bin/python benchmarks/host_calls.py --json benchmarks/results/host/calls.json
	$(VENV)/bin/python benchmarks/host_gpt.py $(HOST_GPT) --json benchmarks/results/host/gpt-tp1.json
	$(VENV)/bin/python benchmarks/host_gpt.py $(HOST_GPT) --tp 2 --variants "linears auto,copies auto,every wing auto" --json benchmarks/results/host/gpt-tp2.json

bench-cp-memory: $(VENV)/.installed
	$(VENV)/bin/python benchmarks/cp_memory.py

# Context-parallel core attention, every algorithm (CP=2 and 4 on loopback; CP=2 over the link).
bench-attention: $(VENV)/.installed
	$(VENV)/bin/coc-inject bench --cases attention --reps 30 --out benchmarks/out/attention-loopback

bench-attention-link: $(VENV)/.installed
	$(VENV)/bin/coc-inject bench --cases attention --link $(LINK) --reps 30 --out benchmarks/out/attention-link-$(LINK)

# On a machine with GPUs (a lent device machine, or yours): what `make test` cannot check here. The
# machine's own python3 and CUDA torch; megatron-core (and anything else missing) from wheels put in
# .whl/ where it has no network. The self-test under torchrun on every GPU (one GPU: the attention
# kernels and the fused backends; the multi-rank wings say why not), then every wing on 2 CPU ranks of
# the same machine. The JSON files (device, versions, every case) land in $(DEVICE_OUT).
DEVICE_PYTHON ?= python3
DEVICE_OUT ?= benchmarks/out/device
GPUS ?= $(shell nvidia-smi -L 2>/dev/null | wc -l)
DEVICE_SITE ?= /tmp/coc-device-site

device-check:
	mkdir -p $(DEVICE_OUT) $(DEVICE_SITE)
	if ls .whl/*.whl >/dev/null 2>&1; then $(DEVICE_PYTHON) -m pip install -q --no-index --no-deps --no-compile \
		--upgrade --target $(DEVICE_SITE) .whl/*.whl; fi
	test "$(GPUS)" -ge 1 || { echo "device-check: no GPU found (nvidia-smi -L); GPUS=N to say how many"; exit 2; }
	PYTHONPATH=$(DEVICE_SITE):$(CURDIR) $(DEVICE_PYTHON) -m torch.distributed.run --nproc-per-node $(GPUS) \
		-m coc_inject.selftest --json $(DEVICE_OUT)/selftest-gpu.json || test $$? -eq 3  # 3: one GPU, one rank
	PYTHONPATH=$(DEVICE_SITE):$(CURDIR) $(DEVICE_PYTHON) benchmarks/device_timer.py
	PYTHONPATH=$(DEVICE_SITE):$(CURDIR) $(DEVICE_PYTHON) benchmarks/wgrad_device.py --json $(DEVICE_OUT)/wgrad.json
	PYTHONPATH=$(DEVICE_SITE):$(CURDIR) $(DEVICE_PYTHON) -m coc_inject selftest --json $(DEVICE_OUT)/selftest-cpu.json

# venv + pinned torch + megatron-core ($(2): pip arguments that install it; $(3): its
# requirements when $(2) skips them; $(4): test-only packages installed without their requirements) + this package (a regular, non-editable install:
# setuptools' editable finder would add ~20 ms to every interpreter start in the venv; built with
# the venv's own setuptools, no isolated build environment made for it each time).
# This package does not depend on megatron-core (only its [megatron] extra does), so installing
# it never changes the megatron-core installed here first.
define make_venv
	test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install -q --disable-pip-version-check $(TORCH)
	$(1)/bin/python -m pip install -q --disable-pip-version-check $(2)
	$(if $(3),$(1)/bin/python -m pip install -q --disable-pip-version-check $(3))
	$(if $(4),$(1)/bin/python -m pip install -q --disable-pip-version-check --no-deps $(4))
	flock $(INSTALL_LOCK) sh -c '$(1)/bin/python -m pip install -q --disable-pip-version-check --no-build-isolation ".[test,bench]" && rm -rf build coc_inject.egg-info'
	touch $(1)/.installed
endef
# The older releases' venvs are made in parallel; each builds this package in ./build and then removes
# it: one at a time, or one's clean-up pulls the other's build from under it.
INSTALL_LOCK := $(VENV)/.install.lock

$(VENV)/.installed: $(SOURCES)
	$(call make_venv,$(VENV),--no-deps --ignore-requires-python megatron-core==$(MEGATRON_NEWEST),$(MEGATRON_NEWEST_REQUIRES),$(HTA_PACKAGES))

# The older releases' venvs start as a hard-linked copy of $(VENV)'s packages (the same torch wheel:
# linking takes seconds, installing it again ~25 s each) without megatron-core, this package and the
# newest release's own requirements; pip then installs the older megatron-core with its requirements
# ($(3): those requirements where $(2) skips them).
define make_older_venv
	test -x $(1)/bin/python || { $(PYTHON) -m venv $(1) \
		&& cp -al --remove-destination $(VENV)/lib/. $(1)/lib/ \
		&& $(1)/bin/python -m pip uninstall -q -y --disable-pip-version-check megatron-core coc-inject \
			$(MEGATRON_NEWEST_REQUIRES); }
	$(call make_venv,$(1),$(2),$(3))
endef

$(VENV_MIDDLE)/.installed: $(VENV)/.installed $(SOURCES)
	$(call make_older_venv,$(VENV_MIDDLE),megatron-core==$(MEGATRON_MIDDLE))

$(VENV_OLDER)/.installed: $(VENV)/.installed $(SOURCES)
	$(call make_older_venv,$(VENV_OLDER),megatron-core==$(MEGATRON_OLDER))

$(VENV_OLDEST)/.installed: $(VENV)/.installed $(SOURCES)
	$(call make_older_venv,$(VENV_OLDEST),--no-deps megatron-core==$(MEGATRON_OLDEST),$(MEGATRON_OLDEST_REQUIRES))

clean:
	rm -rf $(VENV) $(VENV_MIDDLE) $(VENV_OLDER) $(VENV_OLDEST) build coc_inject.egg-info .pytest_cache
