"""The package's host synchronisations, each on an explicit list with its reason (issue 33, item 3).

A ``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``, a data-dependent shape (``nonzero``,
``unique``, ``masked_select``), a tensor truth value (``.any()`` / ``.all()`` / ``torch.equal``) or a
device ``synchronize`` stops the host until the device has caught up: on a GPU, per layer call, it
undoes the overlap the package exists for. None may run per call unless it reads what Megatron
already brought to the host. A new one fails here until it is listed with why it is off the
per-call path (or free there)."""

import pytest

from tests.settings.package_calls import calls, method_name, torch_function

SYNC_METHODS = {"item", "tolist", "cpu", "numpy", "synchronize", "any", "all", "nonzero", "unique", "masked_select"}
SYNC_FUNCTIONS = {"equal", "allclose", "nonzero", "unique", "masked_select"}

# How often each listed read runs in a training job (issue 41, item 6): a reason must say which, and
# none may be PER_CALL -- a read once per layer or block call undoes the overlap on a GPU. A mask
# tensor is fresh each micro-batch in Megatron-LM, so PER_MASK is allowed only where Megatron itself
# applies the mask (masks.megatron_ignores_mask: its fused causal softmax leaves it unread, and so do we).
NOT_IN_A_JOB = "never in a training job"
PER_PROCESS = "once per process"
PER_GROUP = "once per process group"
PER_SHAPE = "once per call shape"
PER_MASK = "once per mask tensor"
HOST_TENSOR = "per call, of a host tensor: no device read"
PER_CALL = "per call"
PER_MEASURED_STEP = "once per measured step, at its end, of a host tensor (COC_MEASURE on CPU ranks)"
FREQUENCIES = (NOT_IN_A_JOB, PER_PROCESS, PER_GROUP, PER_SHAPE, PER_MASK, HOST_TENSOR, PER_MEASURED_STEP, PER_CALL)

# (module under coc_inject/ or a folder ending in "/", enclosing function or "*", call, frequency, why)
ALLOWED = [
    ("selftest/", "*", "*", NOT_IN_A_JOB, "coc-inject selftest compares against its truth"),
    ("lab/", "*", "*", NOT_IN_A_JOB, "coc-inject lab times whole steps in its own process (a step's end, its loss, "
             "the link model's calibration): never inside a user's job"),
    ("testbed/cpu.py", "gloo_split_lists.all_to_all_single", "tolist", NOT_IN_A_JOB,
     "the test bed's CPU ranks: gloo takes split sizes as lists"),
    ("testbed/grouped_gemm.py", "*", "*", NOT_IN_A_JOB,
     "the test bed's CPU stand-in of the grouped_gemm kernel (tests, the bench's CPU ranks): its batch sizes are a "
     "host tensor by the kernel's contract"),
    ("timer.py", "synchronize", "synchronize", PER_SHAPE,
     "the timer: auto's timed trials (at a shape's first call), the bench, self-test and tune"),
    ("measure/exposure.py", "Exposure.finish", "synchronize", PER_PROCESS,
     "COC_MEASURE's device events at the process's end: the last steps' records resolved for the report"),
    ("timer.py", "Timer.__call__", "synchronize", NOT_IN_A_JOB, "the bench's timings (device events)"),
    ("timer.py", "slowest", "tolist", PER_SHAPE, "the MAX over ranks of timings: auto's, the bench's"),
    ("context_parallel/masks.py", "_read", "tolist", PER_MASK,
     "an attention mask Megatron's softmax applies (fp32, no fusion, > 4096 keys, a non-causal layer): "
     "classified in one read, cached by the tensor's identity and version; never where Megatron ignores it"),
    ("context_parallel/masks.py", "classify", "*", PER_MASK,
     "device reductions (.all / .any), no read: the one read of their flags is _read's"),
    ("measure/peers.py", "separate", "tolist", PER_MEASURED_STEP,
     "the host clock's in-flight times and their MIN over the group: CPU tensors, no device read"),
    ("moe/counts.py", "split", "tolist", HOST_TENSOR,
     "the host tensor Megatron's own device-to-host copy brought and its sync point waited for"),
    ("moe/permutation_stages.py", "_megatron_middle", "tolist", HOST_TENSOR,
     "megatron-core 0.12's own line (auto's baseline): output_splits_tp, a numpy array Megatron's device-to-host "
     "copy brought"),
]

def _sync_sites() -> list:
    found = []
    for site in calls():
        function, method = torch_function(site.call), method_name(site.call)
        if function in SYNC_FUNCTIONS:
            found.append((site, function))
        elif function is None and method in SYNC_METHODS:
            found.append((site, method))
    return found


def _allows(entry, site, name) -> bool:
    module, function, call, _, _ = entry
    in_module = site.module.startswith(module) if module.endswith("/") else site.module == module
    return in_module and function in ("*", site.function) and call in ("*", name)


def test_every_host_sync_in_the_package_is_listed_with_its_reason():
    unlisted = [f"{site.where()}: {name}" for site, name in _sync_sites()
                if not any(_allows(entry, site, name) for entry in ALLOWED)]
    assert not unlisted, ("host synchronisations not on the allow-list (on a per-call path: reuse what Megatron "
                          "synchronised, or list it in ALLOWED with why it is off that path):\n" + "\n".join(unlisted))


@pytest.mark.parametrize("entry", ALLOWED, ids=[f"{e[0]}:{e[1]}:{e[2]}" for e in ALLOWED])
def test_every_listed_sync_still_exists(entry):
    assert any(_allows(entry, site, name) for site, name in _sync_sites()), f"stale entry, remove it: {entry}"


def test_every_listed_sync_states_how_often_and_none_runs_per_call():
    unknown = [entry for entry in ALLOWED if entry[3] not in FREQUENCIES]
    assert not unknown, f"an entry's frequency is not one of {FREQUENCIES}: {unknown}"
    per_call = [entry for entry in ALLOWED if entry[3] == PER_CALL]
    assert not per_call, ("a host read per layer or block call (on a GPU it stops the host each call): keep it "
                          f"off that path, or read what Megatron already brought to the host: {per_call}")


def test_two_masks_at_one_address_get_their_own_verdicts():
    """Issue 41, item 5: Megatron-LM makes a fresh mask each micro-batch and the allocator reuses the
    address; the verdict is the tensor's, never its address's."""
    import torch

    from coc_inject.context_parallel import attention, masks
    from coc_inject.context_parallel.attention import LayerCP, Variant

    seq = 8
    causal = torch.ones(1, 1, seq, seq, dtype=torch.bool).triu(1)
    buffer = causal.clone()
    first = torch.empty(0, dtype=torch.bool).set_(buffer.untyped_storage(), 0, buffer.shape, buffer.stride())
    plan = LayerCP(1, None, (Variant("local"),), None)
    assert attention._mask_is_causal(plan, first, (0,), seq) is True
    second = torch.empty(0, dtype=torch.bool).set_(buffer.untyped_storage(), 0, buffer.shape, buffer.stride())
    with torch.no_grad():
        buffer.untyped_storage().copy_(torch.zeros_like(buffer).untyped_storage())  # second: hides nothing
    assert second.data_ptr() == first.data_ptr() and second._version == first._version
    assert attention._mask_is_causal(plan, second, (0,), seq) is False
    assert masks.classify(second, (0,), seq, seq) == masks.NONE
