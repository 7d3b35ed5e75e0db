"""Every tensor the package builds names its device (issue 33, item 2).

NCCL and HCCL refuse a CPU tensor; a tensor built with ``torch.tensor(...)``, ``torch.zeros(...)``
etc. and no ``device=`` is on the CPU, and the CPU tests here (gloo) never notice when it reaches a
collective. So the package builds none without naming its device -- ``device=`` or an immediate
``.to(<device>)`` -- except the few below, each CPU by design and said why. ``new_*`` / ``*_like``
follow their source tensor's device and are not factories here."""

import ast

from tests.settings.package_calls import calls, matches, method_name, torch_function

FACTORIES = {"tensor", "as_tensor", "zeros", "empty", "ones", "full", "arange", "eye", "linspace",
             "randn", "rand", "randint", "randperm", "empty_strided"}

# (module under coc_inject/, enclosing function or "*", why its tensors are built on the CPU)
CPU_BY_DESIGN = [
    ("multi_copy/autograd_check.py", "_hooks_active",
     "a one-element probe of whether saved-tensor hooks are active (older torch only): no collective runs on it"),
    ("selftest/meter.py", "_schedule", "the tensor a sleep-backed fake collective is given: no collective runs on it"),
    ("testbed/attention.py", "whole_inputs",
     "the whole sequence from a seeded CPU generator, the same on every rank; callers move their share"),
    ("bench/cases/flash.py", "block_kernels", "times the CPU flash kernel against the reference, on the CPU"),
    ("testbed/models.py", "build_block", "the layer bench's block runs on CPU ranks (CpuLayerNorm)"),
    ("lab/world.py", "_cpu_shims", "the lab's CPU mode: Megatron's causal mask on the CPU, as the test bed's ranks"),
    ("selftest/linears.py", "_cases", "a seeded CPU generator's scales, moved by .to(device=...) once multiplied"),
    ("selftest/kernels.py", "_truth", "the float64 truth is computed on the CPU (its inputs moved there first)"),
    ("multi_copy/autograd_check.py", "_run", "the check of torch's autograd runs a tiny graph on the CPU, no collective"),
    ("multi_copy/autograd_check.py", "_run.inner", "the same check's output gradients, on the CPU"),
]


def _device_less_sites() -> list:
    """The factory calls that neither pass ``device=`` nor move their result at once:
    ``torch.randn(...).to(device)`` / ``.to(device=..., dtype=...)`` (a CPU generator's values)."""
    sites = calls()
    moved = {id(site.call.func) for site in sites if method_name(site.call) == "to" and _names_a_device(site.call)}
    return [site for site in sites if torch_function(site.call) in FACTORIES
            and not any(keyword.arg == "device" for keyword in site.call.keywords)
            and not (isinstance(site.parent, ast.Attribute) and id(site.parent) in moved)]


def _names_a_device(to_call: ast.Call) -> bool:
    if any(keyword.arg == "device" for keyword in to_call.keywords):
        return True
    first = to_call.args[0] if to_call.args else None
    return "device" in getattr(first, "id", getattr(first, "attr", ""))


def test_every_tensor_the_package_builds_names_its_device_or_is_cpu_by_design():
    unnamed = _device_less_sites()
    unlisted = [site.where() + f": torch.{torch_function(site.call)}" for site in unnamed
                if not any(matches(site, entry) for entry in CPU_BY_DESIGN)]
    assert not unlisted, ("tensors built without a device (NCCL/HCCL refuse CPU tensors): pass device= (the "
                          "device of the tensors the call works on), or list the site in CPU_BY_DESIGN with why:\n"
                          + "\n".join(unlisted))


def test_every_cpu_by_design_entry_is_still_true():
    unnamed = _device_less_sites()
    stale = [entry for entry in CPU_BY_DESIGN if not any(matches(site, entry) for site in unnamed)]
    assert not stale, f"entries naming no device-less tensor any more (remove them): {stale}"
