# The two commands of the README:
#   make demo   the main job: an unmodified tiny GPT pretraining script under torchrun (TP=2,
#               sequence parallel, CPU + gloo), CoC off then on via the environment only
#   make test   the full test suite (newest megatron-core), plus the layer suites against the
#               oldest supported megatron-core in a second venv
# Both create their virtual environments on first use. torch is pinned to the local CPU wheel
# first, so nothing pulls a multi-GB CUDA build from the registry.

PYTHON ?= python3
TORCH ?= torch==2.13.0
MEGATRON_NEWEST ?= megatron-core==0.16.1
MEGATRON_OLDEST ?= megatron-core==0.13.1
VENV ?= .venv
VENV_OLDEST ?= .venv-megatron-oldest
SOURCES := pyproject.toml $(shell find coc_inject sitecustomize -name '*.py' 2>/dev/null)
LAYER_SUITES := tests/test_layers_tp2.py tests/test_layers_tp4.py tests/test_patching.py

LINK ?= 1gbit

.PHONY: demo demo-link test test-newest test-oldest bench bench-link bench-startup clean

demo: $(VENV)/.installed
	$(VENV)/bin/python examples/demo.py

# Root only: the same job over an emulated $(LINK) link between the two ranks.
demo-link: $(VENV)/.installed
	$(VENV)/bin/python examples/demo.py --link $(LINK)

bench: $(VENV)/.installed
	$(VENV)/bin/coc-inject bench

bench-link: $(VENV)/.installed
	$(VENV)/bin/coc-inject bench --link $(LINK) --out benchmarks/out/link-$(LINK)

test: test-newest test-oldest

test-newest: $(VENV)/.installed
	$(VENV)/bin/python -m pytest

test-oldest: $(VENV_OLDEST)/.installed
	$(VENV_OLDEST)/bin/python -m pytest $(LAYER_SUITES)

bench-startup: $(VENV)/.installed
	$(VENV)/bin/python -m coc_inject.bench.startup

# venv + pinned torch + megatron-core + this package (a regular, non-editable install:
# setuptools' editable finder would add ~20 ms to every interpreter start in the venv).
define make_venv
	test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install -q --disable-pip-version-check $(TORCH)
	$(1)/bin/python -m pip install -q --disable-pip-version-check $(2) ".[test,bench]"
	rm -rf build coc_inject.egg-info
	touch $(1)/.installed
endef

$(VENV)/.installed: $(SOURCES)
	$(call make_venv,$(VENV),$(MEGATRON_NEWEST))

$(VENV_OLDEST)/.installed: $(SOURCES)
	$(call make_venv,$(VENV_OLDEST),$(MEGATRON_OLDEST))

clean:
	rm -rf $(VENV) $(VENV_OLDEST) build coc_inject.egg-info .pytest_cache
