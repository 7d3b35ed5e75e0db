"""Configs that subclass Megatron's (Megatron-Bridge's providers, NeMo 2's GPTConfig; tests/settings/bridge_like.py):
their own fields are classified by construction (coc_inject/allowlist/subclasses.py), so every wing's allow-list
takes a provider as it takes Megatron's TransformerConfig with the same settings; one that overrides what
Megatron's layers call on a config is refused, named; a redeclared Megatron field keeps Megatron's default.
Before, every wing stepped aside naming the first provider field set off its default (seq_length=...).
A multi-rank run of a provider-configured MoE GPT: tests/moe/test_moe.py."""

import dataclasses
import pathlib
import re

import pytest

from coc_inject.allowlist import check
from tests.settings import bridge_like
from tests.settings.test_allowlist import small_config

WINGS = (check.LINEARS, check.CONTEXT_PARALLEL, check.MULTI_COPY, check.SEQUENCE_COPIES, check.MOE)
# what each wing's allow-list is asked, as its guard asks it (training, a column linear)
CONTEXT = dict(training=True, kind="column")


def provider(cls=bridge_like.GPTProviderLike, **settings):
    return small_config(cls, **{**bridge_like.PROVIDER_SETTINGS, "position_embedding_type": "rope", **settings})


def test_every_wings_allow_list_takes_a_bridge_like_provider_as_megatrons_config():
    config = provider()
    assert config.seq_length == 16 and config.position_embedding_type == "rope"  # off their defaults
    for wing in WINGS:
        assert check.refusal(small_config(), wing, **CONTEXT) is None, wing  # the same settings on Megatron's class
        assert check.refusal(config, wing, **CONTEXT) is None, (wing, check.refusal(config, wing, **CONTEXT))


def test_a_provider_field_megatron_reads_is_still_classified_by_its_row():
    """yarn_* are subclass fields Megatron's attention reads (subclasses.ROPE): checked, supported."""
    fields = [("yarn_rotary_scaling_factor", float, 1.0), ("yarn_mscale", float, 1.0)]
    yarn = dataclasses.make_dataclass("YarnProvider", fields, bases=(bridge_like.GPTProviderLike,))
    config = provider(yarn, yarn_rotary_scaling_factor=40.0, yarn_mscale=0.707)
    for wing in WINGS:
        assert check.refusal(config, wing, **CONTEXT) is None
        assert check.classification(wing, "yarn_mscale").verdict == "supported"


@pytest.mark.parametrize("cls,named", [(bridge_like.PerLayerProvider, "PerLayerProvider.get_config_for_layer()"),
                                       (bridge_like.PropertyProvider, "PropertyProvider.hidden_dropout (a property")])
def test_a_subclass_overriding_what_megatrons_layers_call_is_refused_naming_it(cls, named):
    config = provider(cls, hidden_dropout=0.0)
    for wing in WINGS:
        reason = check.refusal(config, wing, **CONTEXT)
        assert reason is not None and named in reason and "overrides what Megatron's layers call" in reason, reason
        assert check.WINGS[wing].label in reason


def test_a_redeclared_megatron_field_is_checked_against_megatrons_default():
    """RedeclaredDefault's default cpu_offloading=True is refused by the CP attention and the MoE pieces although
    it is the subclass's default (before, a value equal to the subclass's default passed as off)."""
    config = provider(bridge_like.RedeclaredDefault)
    for wing in (check.CONTEXT_PARALLEL, check.MOE):
        reason = check.refusal(config, wing, **CONTEXT)
        assert reason is not None and reason.startswith("cpu_offloading=True is refused by"), reason


def test_the_copy_protocol_is_not_refused():
    """Bridge overrides __deepcopy__ (subclasses.py: the copy is the config of the layer built from it)."""
    import copy

    from coc_inject.allowlist import subclasses

    config = provider()
    assert "__deepcopy__" in vars(bridge_like.GPTProviderLike)
    assert copy.deepcopy(config).seq_length == 16
    assert subclasses.overridden(type(config), subclasses.megatron_fields(type(config))) is None


# getattr(<...config...>, "name"...) / hasattr(...): a name Megatron's code reads off a config object
_READ = re.compile(r"""\b(?:getattr|hasattr)\(\s*([\w.]*config\w*)\s*,\s*['"](\w+)['"]""")


def test_every_name_megatrons_sources_read_off_a_config_without_declaring_it_is_listed():
    """A subclass field goes unchecked only where Megatron never reads it: the installed megatron-core's
    sources are scanned for getattr / hasattr of a literal name on a config; the names no Megatron config
    class declares must be subclasses.READ_UNDECLARED (each with a row)."""
    import megatron.core

    from coc_inject.allowlist import subclasses

    root = pathlib.Path(megatron.core.__file__).parent
    declared = set()
    for module in ("transformer.transformer_config", "transformer.heterogeneous.heterogeneous_config"):
        try:
            found = __import__(f"megatron.core.{module}", fromlist=["*"])
        except ImportError:  # 0.12 has the heterogeneous config; a release without it has nothing to declare
            continue
        for value in vars(found).values():
            if isinstance(value, type) and dataclasses.is_dataclass(value):
                declared |= {field.name for field in dataclasses.fields(value)}
    read = {}
    for path in root.rglob("*.py"):
        for match in _READ.finditer(path.read_text(errors="ignore")):
            if match.group(2) not in declared:
                read.setdefault(match.group(2), path.relative_to(root).as_posix())
    assert {n: p for n, p in read.items() if n not in subclasses.READ_UNDECLARED} == {}
    for name in subclasses.READ_UNDECLARED:
        assert all(check.classification(wing, name) is not None for wing in WINGS), name


def test_coc_injects_own_set_counter_is_not_taken_for_a_subclass_override():
    """verdicts.watch puts a counting __setattr__ on a config class a verdict read: that is coc-inject's own,
    not the class overriding what Megatron's layers call (before, every wing compiled after it refused the
    class: 'TransformerConfig overrides ... (TransformerConfig.__setattr__())'); a subclass's own
    __setattr__ is still named through the counter that wraps it."""
    import types

    from coc_inject import verdicts

    own = dataclasses.make_dataclass("OwnSetattrProvider", [], bases=(bridge_like.GPTProviderLike,),
                                     namespace={"__setattr__": lambda self, name, value: object.__setattr__(
                                         self, name, value)})
    installation = types.SimpleNamespace(undo=[])
    plain = dataclasses.make_dataclass("WatchedProvider", [], bases=(bridge_like.GPTProviderLike,))
    try:
        assert verdicts.watch(installation, plain) and verdicts.watch(installation, own)
        for wing in WINGS:
            assert check.refusal(provider(plain), wing, **CONTEXT) is None, wing
            reason = check.refusal(provider(own), wing, **CONTEXT)
            assert reason is not None and "OwnSetattrProvider.__setattr__()" in reason, reason
    finally:
        for undo in reversed(installation.undo):
            undo()
