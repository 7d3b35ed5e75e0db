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

# (module under coc_inject/ or a folder ending in "/", enclosing function or "*", call, why it may stay)
ALLOWED = [
    ("selftest/", "*", "*", "coc-inject selftest compares against its truth: no job runs it"),
    ("testbed/cpu.py", "gloo_split_lists.all_to_all_single", "tolist",
     "the test bed's CPU ranks: gloo takes split sizes as lists; never applied in a job"),
    ("timer.py", "synchronize", "synchronize",
     "the timer: auto's timed trials (once per shape, at its first call), the bench, self-test and tune"),
    ("measure/exposure.py", "Exposure.finish", "synchronize",
     "COC_MEASURE's device events at the process's end, once: the last steps' records resolved for the report"),
    ("timer.py", "Timer.__call__", "synchronize", "the bench's timings (device events): no job runs it"),
    ("timer.py", "slowest", "tolist", "the MAX over ranks of timings: auto's once per shape, the bench's"),
    ("pipeline/agreement.py", "ensure_same_config", "tolist",
     "the config fingerprints, once per process group (a dict lookup after)"),
    ("context_parallel/attention.py", "_mask_is_causal", "any", "once per attention mask tensor (then cached)"),
    ("context_parallel/attention.py", "_mask_is_causal", "equal", "once per attention mask tensor (then cached)"),
    ("multi_copy/sequence.py", "mask_kind", "all",
     "once per attention mask tensor (then cached), for a block call planned as sequence copies"),
    ("moe/counts.py", "split", "tolist",
     "per MoE call, on the host tensor Megatron's own device-to-host copy brought and its sync point waited for"),
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
    module, function, call, _ = entry
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
