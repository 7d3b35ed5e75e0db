"""coc_inject.config: parsing, validation, precedence and the MindSpeed flag drop-in. Pure and fast."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import pickle
import re

import pytest

from coc_inject import config as cfgmod
from coc_inject.config import (
    ENV_REFERENCE,
    FILE_REFERENCE,
    CocConfig,
    ConfigError,
    extract_cp_flags,
    extract_mindspeed_flags,
    load_config,
    unknown_variables,
    validate_all,
)

ALLOWED = {s.name: s.allowed for s in ENV_REFERENCE}
BOOL_VARS = {
    "COC_DISABLE": "disabled",
    "USE_COC_FUSED_KERNEL": "fused",
    "COC_RECOMPUTE_ALL_GATHER": "recompute_all_gather",
    "COC_ENABLE_IN_COLUMN_BACKWARD": "enable_coc_in_column_backward",
    "COC_MATMUL_SOC_FRIENDLY": "matmul_soc_friendly",
}
TRUTHY = ["1", "true", "True", "TRUE", "yes", "Yes", "on", "ON", " on ", "\ttrue\n", "  1"]
FALSY = ["0", "false", "False", "FALSE", "no", "NO", "off", "Off", " off ", "\nfalse\t", "0 "]
FLAGS_ON = {"use_ascend_coc": True, "parallel_num": None, "fused": False}


def error_of(environ, argv_flags=None, cp_flags=None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(environ, argv_flags, cp_flags)
    return info.value


def assert_names(err: ConfigError, variable: str, value: str, allowed: str):
    text = str(err)
    assert "\n" not in text
    assert variable in text and value in text and allowed in text, text


def write_json(tmp_path, obj, name="coc.json") -> str:
    path = tmp_path / name
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj), encoding="utf-8")
    return str(path)


# --- defaults and the reference ------------------------------------------------------


def test_empty_environment_gives_defaults():
    cfg = load_config({})
    assert cfg == CocConfig()
    assert (cfg.parallel_num, cfg.fused, cfg.recompute_all_gather) == (1, False, True)
    assert (cfg.enable_coc_in_column_backward, cfg.matmul_soc_friendly) == (False, True)
    assert (cfg.customized_coc, cfg.k_min, cfg.k_max, cfg.log_level) == ((), 1024, 4096, "info")
    assert (cfg.disabled, cfg.config_file, cfg.mode, cfg.enabled) == (False, None, "off", False)


def test_environ_defaults_to_os_environ(monkeypatch):
    monkeypatch.setenv("COC_PARALLEL_NUM", "3")
    assert load_config().parallel_num == 3
    monkeypatch.setenv("COC_PARALLEL_NUM", "zero")
    assert [e.variable for e in validate_all()] == ["COC_PARALLEL_NUM"]


@pytest.mark.parametrize("name", [*BOOL_VARS, "COC_PARALLEL_NUM", "COC_CUSTOMIZED", "COC_CONFIG", "COC_LOG_LEVEL"])
@pytest.mark.parametrize("blank", ["", "   ", "\t"])
def test_empty_or_blank_is_unset(name, blank):
    assert load_config({name: blank}) == CocConfig()


def test_reference_covers_every_variable_once():
    names = [s.name for s in ENV_REFERENCE]
    assert names == [
        "COC_DISABLE", "COC_PARALLEL_NUM", "USE_COC_FUSED_KERNEL", "COC_RECOMPUTE_ALL_GATHER",
        "COC_ENABLE_IN_COLUMN_BACKWARD", "COC_MATMUL_SOC_FRIENDLY", "COC_CUSTOMIZED", "COC_CONFIG", "COC_LOG_LEVEL",
        "COC_FUSED_BACKEND", "COC_DETERMINISTIC", "COC_ALLOW_UNTESTED_MEGATRON", "COC_REPORT",
        "COC_TUNE_CANDIDATES", "COC_TUNE_CACHE", "COC_CP_ALGO", "COC_CP_WINDOW", "COC_CP_ULYSSES_DEGREE",
        "COC_CP_MASK_TYPE", "COC_ATTN_KERNEL", "COC_FLASH_ATTN", "COC_MULTI_COPY", "COC_MOE_OVERLAP", "COC_MEASURE",
        "COC_MEASURE_EVERY", "COC_MEASURE_WARN", "COC_TRACE", "COC_TRACE_STEPS", "COC_CACHE_DIR",
    ]
    for setting in ENV_REFERENCE + FILE_REFERENCE:
        assert setting.default and setting.allowed and setting.meaning
        with pytest.raises(dataclasses.FrozenInstanceError):
            setting.name = "X"


def test_reference_defaults_match_the_dataclass():
    shown = {s.name: s.default for s in ENV_REFERENCE}
    assert shown["COC_PARALLEL_NUM"] == "1"
    assert shown["COC_RECOMPUTE_ALL_GATHER"] == "true"
    assert shown["COC_MATMUL_SOC_FRIENDLY"] == "true"
    assert shown["USE_COC_FUSED_KERNEL"] == "false"
    assert shown["COC_LOG_LEVEL"] == "info"
    assert {s.name: s.default for s in FILE_REFERENCE}["k_min"] == "1024"


def test_config_file_allowed_lists_every_file_key():
    for setting in FILE_REFERENCE:
        assert setting.name in ALLOWED["COC_CONFIG"]


# --- ConfigError -----------------------------------------------------------------------


def test_config_error_exact_message_and_attributes():
    err = ConfigError("COC_PARALLEL_NUM", "abc", "an integer >= 1 (1 = off)")
    assert str(err) == "COC_PARALLEL_NUM='abc' is invalid: expected an integer >= 1 (1 = off)"
    assert (err.variable, err.value, err.allowed) == ("COC_PARALLEL_NUM", "abc", "an integer >= 1 (1 = off)")
    assert isinstance(err, ValueError)


def test_config_error_is_one_line_even_with_newlines():
    err = ConfigError("COC_CONFIG=/p/x.json: key 'k_min'", "a\nb", "x", message="first\nsecond")
    assert str(err) == "first second"
    assert "\n" not in str(ConfigError("V", "a\nb", "x"))


def test_config_error_survives_pickling():
    err = pickle.loads(pickle.dumps(ConfigError("COC_DISABLE", "maybe", "1/0")))
    assert (err.variable, err.value, err.allowed) == ("COC_DISABLE", "maybe", "1/0")
    assert str(err) == "COC_DISABLE='maybe' is invalid: expected 1/0"


# --- booleans --------------------------------------------------------------------------


@pytest.mark.parametrize("name", BOOL_VARS)
@pytest.mark.parametrize("text", TRUTHY)
def test_bool_truthy(name, text):
    assert getattr(load_config({name: text}), BOOL_VARS[name]) is True


@pytest.mark.parametrize("name", BOOL_VARS)
@pytest.mark.parametrize("text", FALSY)
def test_bool_falsy(name, text):
    assert getattr(load_config({name: text}), BOOL_VARS[name]) is False


@pytest.mark.parametrize("name", BOOL_VARS)
@pytest.mark.parametrize("text", ["2", "maybe", "tru", "y", "n", "enable", "1.0", "-1", "t"])
def test_bool_rejects(name, text):
    err = error_of({name: text})
    assert err.variable == name and err.value == text
    assert str(err) == f"{name}={text!r} is invalid: expected 1/0, true/false, yes/no, on/off (any case)"
    assert err.allowed == ALLOWED[name]


# --- COC_PARALLEL_NUM -------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [("1", 1), ("2", 2), (" 4 ", 4), ("\t8\n", 8), ("16", 16), ("02", 2)])
def test_parallel_num_accepts(text, expected):
    assert load_config({"COC_PARALLEL_NUM": text}).parallel_num == expected


@pytest.mark.parametrize("text", ["2.0", "0", "-1", "abc", "4x", "+2", "2_0", "1e3", "٤", "0x4", "2 2"])
def test_parallel_num_rejects(text):
    err = error_of({"COC_PARALLEL_NUM": text})
    assert str(err) == f"COC_PARALLEL_NUM={text!r} is invalid: expected an integer >= 1 (1 = off), or auto (tuned per shape at run time)"
    assert err.allowed == ALLOWED["COC_PARALLEL_NUM"]


# --- COC_CUSTOMIZED ---------------------------------------------------------------------


def test_customized_parses_whitespace_keys_and_minus_one():
    text = '{"[16384,5120,1920]": 4, " [ 4096 , 1024, 512 ] ": -1, "[8, 8, 8]": 1}'
    cfg = load_config({"COC_CUSTOMIZED": text})
    assert cfg.customized_coc == (((8, 8, 8), 1), ((4096, 1024, 512), -1), ((16384, 5120, 1920), 4))
    hash(cfg)  # hashable with a customized dict
    assert cfg.describe()["customized_coc"] == {"[8, 8, 8]": 1, "[4096, 1024, 512]": -1, "[16384, 5120, 1920]": 4}


def test_customized_empty_object_is_fine():
    assert load_config({"COC_CUSTOMIZED": "{}"}).customized_coc == ()


@pytest.mark.parametrize("text", ["[]", '"x"', "4", "null", '[["[1,2,3]", 2]]'])
def test_customized_rejects_non_object(text):
    err = error_of({"COC_CUSTOMIZED": text})
    assert err.variable == "COC_CUSTOMIZED" and err.value == text
    assert "is not a JSON object" in str(err) and ALLOWED["COC_CUSTOMIZED"] in str(err)


@pytest.mark.parametrize("text", ["{", "{'[1,2,3]': 2}", "{[1,2,3]: 2}", "abc", '{"[1,2,3]": NaN}'])
def test_customized_rejects_bad_json(text):
    err = error_of({"COC_CUSTOMIZED": text})
    assert err.variable == "COC_CUSTOMIZED"
    assert "is not valid JSON" in str(err) and ALLOWED["COC_CUSTOMIZED"] in str(err)


@pytest.mark.parametrize("key", ["[1,2]", "[1,2,3,4]", "[0,2,3]", "[-1,2,3]", "[1.5,2,3]", "[true,2,3]",
                                 "1,2,3", "(1,2,3)", "m,k,n", "[\"1\",2,3]", "{}", ""])
def test_customized_rejects_bad_key(key):
    err = error_of({"COC_CUSTOMIZED": json.dumps({key: 2})})
    assert err.value == key
    assert_names(err, "COC_CUSTOMIZED", repr(key), cfgmod.SHAPE_KEY_ALLOWED)


@pytest.mark.parametrize("value, shown", [(True, "True"), (False, "False"), (2.0, "2.0"), (0, "0"), (-2, "-2"),
                                          ("2", "'2'"), (None, "None"), ([2], "[2]")])
def test_customized_rejects_bad_value(value, shown):
    err = error_of({"COC_CUSTOMIZED": json.dumps({"[1, 2, 3]": value})})
    assert err.value == value
    assert_names(err, "COC_CUSTOMIZED['[1, 2, 3]']", f"={shown}", cfgmod.SHAPE_COUNT_ALLOWED)
    if isinstance(value, bool):
        assert "is a boolean, not an integer" in str(err)


def test_customized_rejects_same_shape_spelled_twice():
    err = error_of({"COC_CUSTOMIZED": '{"[1,2,3]": 2, "[1, 2, 3]": 4}'})
    assert "COC_CUSTOMIZED" in str(err) and "repeats the shape [1, 2, 3]" in str(err)
    err = error_of({"COC_CUSTOMIZED": '{"[1,2,3]": 2, "[1,2,3]": 4}'})
    assert "repeats the key '[1,2,3]'" in str(err)


# --- COC_LOG_LEVEL ----------------------------------------------------------------------


@pytest.mark.parametrize("text, level", [("debug", "debug"), ("INFO", "info"), (" Warning ", "warning"),
                                         ("ERROR", "error")])
def test_log_level_accepts(text, level):
    assert load_config({"COC_LOG_LEVEL": text}).log_level == level


@pytest.mark.parametrize("text", ["verbose", "warn", "critical", "10"])
def test_log_level_rejects(text):
    err = error_of({"COC_LOG_LEVEL": text})
    assert str(err) == f"COC_LOG_LEVEL={text!r} is invalid: expected debug, info, warning, error (any case)"


def test_every_log_level_configures_the_logger():
    import logging

    from coc_inject import log

    for name in cfgmod.LOG_LEVELS:
        log.configure(name)
        assert log.logger.level == getattr(logging, name.upper())
    log.configure("info")


# --- COC_CONFIG -------------------------------------------------------------------------

ORIGIN_CFG = {
    "recompute_all_gather": False,
    "enable_coc_in_column_backward": True,
    "matmul_soc_friendly": False,
    "print_tensor_value_open": True,
    "customized_coc": {"[16384, 5120, 1920]": 8, "[1,1,1]": -1},
    "k_min": 512,
    "k_max": 8192,
}


def test_config_file_origin_format(tmp_path):
    path = write_json(tmp_path, ORIGIN_CFG)
    cfg = load_config({"COC_CONFIG": path})
    assert cfg.config_file == path
    assert (cfg.recompute_all_gather, cfg.enable_coc_in_column_backward, cfg.matmul_soc_friendly) == (False, True, False)
    assert cfg.customized_coc == (((1, 1, 1), -1), ((16384, 5120, 1920), 8))
    assert (cfg.k_min, cfg.k_max) == (512, 8192)
    assert cfg.mode == "chunked"  # a customized count != 1 turns CoC on


def test_config_file_accepts_bool_words_as_strings(tmp_path):
    path = write_json(tmp_path, {"recompute_all_gather": " OFF ", "matmul_soc_friendly": "no",
                                 "enable_coc_in_column_backward": "Yes"})
    cfg = load_config({"COC_CONFIG": path})
    assert (cfg.recompute_all_gather, cfg.matmul_soc_friendly, cfg.enable_coc_in_column_backward) == (False, False, True)


def test_env_overrides_file_key_by_key(tmp_path):
    path = write_json(tmp_path, ORIGIN_CFG)
    cfg = load_config({
        "COC_CONFIG": path,
        "COC_RECOMPUTE_ALL_GATHER": "1",
        "COC_ENABLE_IN_COLUMN_BACKWARD": "0",
    })
    assert cfg.recompute_all_gather is True and cfg.enable_coc_in_column_backward is False
    assert cfg.matmul_soc_friendly is False  # not overridden: file value stays
    assert (cfg.k_min, cfg.k_max) == (512, 8192)


def test_env_customized_replaces_file_dict_entirely(tmp_path):
    path = write_json(tmp_path, ORIGIN_CFG)
    cfg = load_config({"COC_CONFIG": path, "COC_CUSTOMIZED": '{"[2,2,2]": 3}'})
    assert cfg.customized_coc == (((2, 2, 2), 3),)
    assert load_config({"COC_CONFIG": path, "COC_CUSTOMIZED": "{}"}).customized_coc == ()


def test_config_file_unknown_key(tmp_path):
    path = write_json(tmp_path, {"k_min": 1, "parallel_num": 4})
    err = error_of({"COC_CONFIG": path})
    assert err.value == "parallel_num"
    assert_names(err, f"COC_CONFIG={path}", "'parallel_num'", "has an unknown key")
    for key in ("recompute_all_gather", "customized_coc", "k_min", "k_max", "print_tensor_value_open"):
        assert key in str(err)


def test_config_file_missing(tmp_path):
    path = str(tmp_path / "nope.json")
    err = error_of({"COC_CONFIG": path})
    assert err.variable == "COC_CONFIG" and err.value == path
    assert "cannot be read" in str(err) and "No such file" in str(err) and path in str(err)


def test_config_file_is_a_directory(tmp_path):
    err = error_of({"COC_CONFIG": str(tmp_path)})
    assert err.variable == "COC_CONFIG" and "cannot be read" in str(err)


@pytest.mark.parametrize("text", ["{", "{'k_min': 1}", "", '{"k_min": 1,}', '{"k_min": NaN}'])
def test_config_file_bad_json(tmp_path, text):
    path = write_json(tmp_path, text)
    err = error_of({"COC_CONFIG": path})
    assert err.variable == "COC_CONFIG" and err.value == path
    assert "is not valid JSON" in str(err) and path in str(err)


def test_config_file_not_utf8(tmp_path):
    path = tmp_path / "latin.json"
    path.write_bytes(b'{"k_min": "\xff"}')
    assert "is not UTF-8" in str(error_of({"COC_CONFIG": str(path)}))


@pytest.mark.parametrize("text", ["[]", "3", '"x"', "null"])
def test_config_file_not_an_object(tmp_path, text):
    path = write_json(tmp_path, text)
    err = error_of({"COC_CONFIG": path})
    assert "not an object" in str(err) and path in str(err)


def test_config_file_duplicate_key(tmp_path):
    path = write_json(tmp_path, '{"k_min": 1, "k_min": 2}')
    assert "repeats the key 'k_min'" in str(error_of({"COC_CONFIG": path}))


@pytest.mark.parametrize("key, value", [("k_min", 0), ("k_min", "abc"), ("k_max", 1.5), ("k_max", True),
                                        ("recompute_all_gather", 1), ("matmul_soc_friendly", "maybe"),
                                        ("print_tensor_value_open", None), ("customized_coc", "{}"),
                                        ("customized_coc", [])])
def test_config_file_bad_values(tmp_path, key, value):
    path = write_json(tmp_path, {key: value})
    err = error_of({"COC_CONFIG": path})
    assert err.variable == f"COC_CONFIG={path}: key {key!r}"
    assert err.value == value
    assert str(err).startswith(f"COC_CONFIG={path}: key {key!r}={value!r} ")


def test_config_file_bad_customized_entry_names_the_file(tmp_path):
    path = write_json(tmp_path, {"customized_coc": {"[1,2,3]": 0}})
    err = error_of({"COC_CONFIG": path})
    assert_names(err, f"COC_CONFIG={path}: key 'customized_coc'['[1,2,3]']", "=0", cfgmod.SHAPE_COUNT_ALLOWED)


def test_config_file_k_min_above_k_max(tmp_path):
    err = error_of({"COC_CONFIG": write_json(tmp_path, {"k_min": 4096, "k_max": 1024})})
    assert "'k_min', 'k_max'" in str(err) and "4096 > 1024" in str(err) and "k_min <= k_max" in str(err)
    # Against the defaults too: k_max alone below the default k_min.
    err = error_of({"COC_CONFIG": write_json(tmp_path, {"k_max": 10}, "b.json")})
    assert "1024 > 10" in str(err)


def test_config_file_errors_even_when_env_overrides_the_key(tmp_path):
    path = write_json(tmp_path, {"recompute_all_gather": "maybe"})
    err = error_of({"COC_CONFIG": path, "COC_RECOMPUTE_ALL_GATHER": "1"})
    assert "recompute_all_gather" in str(err)


def test_config_file_path_is_stripped(tmp_path):
    path = write_json(tmp_path, {"k_min": 2})
    assert load_config({"COC_CONFIG": f"  {path}\n"}).k_min == 2


# --- mode, enabled, chunks_for -----------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, enabled, mode",
    [
        ({}, False, "off"),
        ({"parallel_num": 1}, False, "off"),
        ({"parallel_num": 2}, True, "chunked"),
        ({"fused": True}, True, "fused"),
        ({"fused": True, "parallel_num": 4}, True, "fused"),  # fused wins over the chunk count
        ({"customized_coc": {(1, 2, 3): 4}}, True, "chunked"),
        ({"customized_coc": {(1, 2, 3): -1}}, True, "chunked"),
        ({"customized_coc": {(1, 2, 3): 1}}, False, "off"),
        ({"parallel_num": 4, "disabled": True}, False, "off"),
        ({"fused": True, "disabled": True}, False, "off"),
        ({"customized_coc": {(1, 2, 3): 4}, "disabled": True}, False, "off"),
    ],
)
def test_enabled_and_mode_truth_table(kwargs, enabled, mode):
    cfg = CocConfig(**kwargs)
    assert cfg.enabled is enabled
    assert cfg.mode == mode


def test_fused_precedence_from_env():
    cfg = load_config({"COC_PARALLEL_NUM": "4", "USE_COC_FUSED_KERNEL": "1"})
    assert cfg.mode == "fused" and cfg.parallel_num == 4


def test_disable_still_validates_everything_else():
    assert load_config({"COC_DISABLE": "1", "COC_PARALLEL_NUM": "8"}).mode == "off"
    err = error_of({"COC_DISABLE": "1", "COC_PARALLEL_NUM": "zero"})
    assert err.variable == "COC_PARALLEL_NUM"


def test_chunks_for():
    cfg = CocConfig(parallel_num=4, customized_coc={(16384, 5120, 1920): 8, (1, 2, 3): -1, (7, 7, 7): 1})
    assert cfg.chunks_for(16384, 5120, 1920) == 8
    assert cfg.chunks_for(1, 2, 3) == -1
    assert cfg.chunks_for(7, 7, 7) == 1
    assert cfg.chunks_for(16384, 1920, 5120) == 4  # exact shape only, order matters
    assert CocConfig().chunks_for(1, 2, 3) == 1
    fused = CocConfig(parallel_num=4, fused=True, customized_coc={(7, 7, 7): 2})
    assert (fused.chunks_for(1, 2, 3), fused.chunks_for(7, 7, 7)) == (-1, 2)  # fused wins unless customized


def test_chunks_for_after_loading_and_replace():
    cfg = load_config({"COC_PARALLEL_NUM": "2", "COC_CUSTOMIZED": '{"[4, 5, 6]": 3}'})
    assert (cfg.chunks_for(4, 5, 6), cfg.chunks_for(4, 5, 7)) == (3, 2)
    other = dataclasses.replace(cfg, customized_coc={(4, 5, 7): 6})
    assert (other.chunks_for(4, 5, 6), other.chunks_for(4, 5, 7)) == (2, 6)


# --- the dataclass itself ---------------------------------------------------------------


def test_frozen():
    cfg = CocConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.parallel_num = 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.fused = True


def test_customized_normalised_to_sorted_tuple_and_hashable():
    a = CocConfig(customized_coc={(9, 9, 9): 2, (1, 2, 3): 4})
    b = CocConfig(customized_coc=[([1, 2, 3], 4), ((9, 9, 9), 2)])
    assert a.customized_coc == (((1, 2, 3), 4), ((9, 9, 9), 2))
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1


@pytest.mark.parametrize("kwargs, field", [
    ({"parallel_num": 0}, "parallel_num"),
    ({"parallel_num": True}, "parallel_num"),
    ({"k_min": 0}, "k_min"),
    ({"k_min": 5000}, "k_min"),
    ({"log_level": "loud"}, "log_level"),
    ({"customized_coc": {(1, 2): 2}}, "customized_coc"),
    ({"customized_coc": {(1, 2, 3): 0}}, "customized_coc"),
    ({"customized_coc": [((1, 2, 3), 2), ((1, 2, 3), 4)]}, "customized_coc"),
])
def test_direct_construction_is_validated(kwargs, field):
    with pytest.raises(ConfigError) as info:
        CocConfig(**kwargs)
    assert info.value.variable.startswith(f"CocConfig.{field}")


def test_pickle_round_trip_keeps_chunks_for():
    cfg = CocConfig(parallel_num=2, customized_coc={(1, 2, 3): 5})
    clone = pickle.loads(pickle.dumps(cfg))
    assert clone == cfg and clone.chunks_for(1, 2, 3) == 5


def test_describe_is_plain_json():
    cfg = CocConfig(parallel_num=2, customized_coc={(1, 2, 3): 5}, config_file="/x.json")
    shown = cfg.describe()
    assert json.loads(json.dumps(shown)) == shown
    assert shown["customized_coc"] == {"[1, 2, 3]": 5}
    assert shown["mode"] == "chunked" and shown["parallel_num"] == 2 and shown["config_file"] == "/x.json"
    fields = {f.name for f in dataclasses.fields(CocConfig)}
    # every field, COC_CP_ALGO's once: as cp_algorithm, the algorithm that applies (#54: not cp_algo beside it)
    assert fields - {"cp_algo"} <= set(shown) and "cp_algorithm" in shown and "cp_algo" not in shown


# --- fingerprint ------------------------------------------------------------------------


def test_fingerprint_stable_known_value():
    # A constant, so a change to the canonical form (which would make old and new ranks
    # disagree) shows up here rather than as a hang.
    fp = CocConfig().fingerprint()
    assert fp == CocConfig().fingerprint()
    assert 0 <= fp < 2**63
    assert fp == 7856760368497566602
    assert CocConfig(parallel_num=4).fingerprint() == 5170091518170849905


def test_fingerprint_sensitive_to_agreed_fields():
    base = CocConfig()
    changed = [
        CocConfig(parallel_num=2), CocConfig(fused=True), CocConfig(recompute_all_gather=False),
        CocConfig(enable_coc_in_column_backward=True), CocConfig(matmul_soc_friendly=False),
        CocConfig(customized_coc={(1, 2, 3): 2}), CocConfig(customized_coc={(1, 2, 3): 3}),
        CocConfig(k_min=512), CocConfig(k_max=8192),
    ]
    prints = {c.fingerprint() for c in changed}
    assert base.fingerprint() not in prints
    assert len(prints) == len(changed)


def test_fingerprint_ignores_local_fields():
    base = CocConfig(parallel_num=2).fingerprint()
    assert CocConfig(parallel_num=2, log_level="debug").fingerprint() == base
    assert CocConfig(parallel_num=2, config_file="/a.json").fingerprint() == base
    assert CocConfig(parallel_num=2, disabled=True).fingerprint() == base


def test_fingerprint_independent_of_customized_order():
    a = load_config({"COC_CUSTOMIZED": '{"[1,2,3]": 2, "[4,5,6]": 3}'})
    b = load_config({"COC_CUSTOMIZED": '{"[4, 5, 6]": 3, "[1, 2, 3]": 2}'})
    assert a.fingerprint() == b.fingerprint()


# --- MindSpeed flags --------------------------------------------------------------------


def test_extract_no_flags_returns_copy():
    argv = ["pretrain_gpt.py", "--tensor-model-parallel-size", "8"]
    flags, rest = extract_mindspeed_flags(argv)
    assert flags == {"use_ascend_coc": False, "parallel_num": None, "fused": False}
    assert rest == argv and rest is not argv


@pytest.mark.parametrize("argv, flags, rest", [
    (["a.py", "--use-ascend-coc", "--coc-parallel-num", "4", "--lr", "1e-4"],
     {"use_ascend_coc": True, "parallel_num": 4, "fused": False}, ["a.py", "--lr", "1e-4"]),
    (["--coc-parallel-num=2", "x", "--use-ascend-coc"],
     {"use_ascend_coc": True, "parallel_num": 2, "fused": False}, ["x"]),
    (["--use-ascend-coc", "--coc-fused-kernel", "--seq-length", "4096"],
     {"use_ascend_coc": True, "parallel_num": None, "fused": True}, ["--seq-length", "4096"]),
    (["--use-ascend-coc"], {"use_ascend_coc": True, "parallel_num": None, "fused": False}, []),
    (["--use-ascend-coc", "--coc-parallel-num", "4", "--coc-parallel-num=4"],
     {"use_ascend_coc": True, "parallel_num": 4, "fused": False}, []),
])
def test_extract_recognises(argv, flags, rest):
    before = list(argv)
    assert extract_mindspeed_flags(argv) == (flags, rest)
    assert argv == before  # input not mutated


def test_extract_leaves_other_tokens_alone():
    argv = ["--coc-parallel-numbers", "3", "--use-ascend-coc-x", "--coc-fused", "-coc-parallel-num", "2",
            "--data-path", "--use-ascend-coc"]
    flags, rest = extract_mindspeed_flags(argv)
    assert flags["use_ascend_coc"] is True and flags["parallel_num"] is None
    assert rest == argv[:-1]


def test_extract_stops_at_double_dash():
    argv = ["--use-ascend-coc", "--", "--coc-parallel-num", "4", "--coc-fused-kernel"]
    flags, rest = extract_mindspeed_flags(argv)
    assert flags == {"use_ascend_coc": True, "parallel_num": None, "fused": False}
    assert rest == ["--", "--coc-parallel-num", "4", "--coc-fused-kernel"]


@pytest.mark.parametrize("argv, value", [
    (["--use-ascend-coc", "--coc-parallel-num"], None),
    (["--use-ascend-coc", "--coc-parallel-num", "abc"], "abc"),
    (["--use-ascend-coc", "--coc-parallel-num", "0"], "0"),
    (["--use-ascend-coc", "--coc-parallel-num="], ""),
    (["--use-ascend-coc", "--coc-parallel-num=2.5"], "2.5"),
    (["--use-ascend-coc", "--coc-parallel-num", "--lr"], "--lr"),
])
def test_extract_bad_number(argv, value):
    with pytest.raises(ConfigError) as info:
        extract_mindspeed_flags(argv)
    err = info.value
    assert err.variable == "--coc-parallel-num" and err.value == value
    assert "--coc-parallel-num" in str(err) and ALLOWED["COC_PARALLEL_NUM"] in str(err)


def test_extract_conflicting_repeat():
    with pytest.raises(ConfigError, match="given twice"):
        extract_mindspeed_flags(["--use-ascend-coc", "--coc-parallel-num", "2", "--coc-parallel-num=4"])


@pytest.mark.parametrize("argv, flag", [
    (["--coc-parallel-num", "4"], "--coc-parallel-num"),
    (["--coc-fused-kernel"], "--coc-fused-kernel"),
])
def test_extract_requires_use_ascend_coc(argv, flag):
    with pytest.raises(ConfigError) as info:
        extract_mindspeed_flags(argv)
    assert info.value.variable == flag
    assert "--use-ascend-coc" in str(info.value) and "MindSpeed" in str(info.value)


# --- flags merged with the environment --------------------------------------------------


def test_flag_parallel_num_applies_when_env_unset():
    assert load_config({}, {**FLAGS_ON, "parallel_num": 4}).parallel_num == 4
    assert load_config({"COC_PARALLEL_NUM": ""}, {**FLAGS_ON, "parallel_num": 4}).parallel_num == 4


def test_flag_parallel_num_ignored_without_use_ascend_coc_is_an_error():
    errors = validate_all({}, {"use_ascend_coc": False, "parallel_num": 4, "fused": True})
    assert [e.variable for e in errors] == ["--coc-parallel-num", "--coc-fused-kernel"]


def test_flag_and_env_agreeing_is_fine():
    assert load_config({"COC_PARALLEL_NUM": " 4"}, {**FLAGS_ON, "parallel_num": 4}).parallel_num == 4
    assert load_config({"USE_COC_FUSED_KERNEL": "yes"}, {**FLAGS_ON, "fused": True}).fused is True


def test_flag_and_env_disagreeing_parallel_num():
    err = error_of({"COC_PARALLEL_NUM": "2"}, {**FLAGS_ON, "parallel_num": 4})
    assert err.variable == "--coc-parallel-num / COC_PARALLEL_NUM"
    assert str(err).startswith("--coc-parallel-num 4 disagrees with COC_PARALLEL_NUM=2")


def test_flag_fused_applies_when_env_unset_and_errors_when_env_false():
    assert load_config({}, {**FLAGS_ON, "fused": True}).mode == "fused"
    err = error_of({"USE_COC_FUSED_KERNEL": "off"}, {**FLAGS_ON, "fused": True})
    assert err.variable == "--coc-fused-kernel / USE_COC_FUSED_KERNEL"
    assert "--coc-fused-kernel disagrees with USE_COC_FUSED_KERNEL=off" in str(err)


def test_env_fused_without_flag_is_fine():
    assert load_config({"USE_COC_FUSED_KERNEL": "1"}, dict(FLAGS_ON)).fused is True


def test_flag_with_bad_parallel_num_value():
    err = error_of({}, {**FLAGS_ON, "parallel_num": 0})
    assert err.variable == "--coc-parallel-num"


def test_flag_parallel_num_auto_is_a_count_like_the_variable():
    # It was refused by the merge with a message showing the stored -2 and naming auto as allowed.
    flags, _ = extract_mindspeed_flags(["--use-ascend-coc", "--coc-parallel-num", "auto"])
    assert load_config({}, flags).parallel_num == cfgmod.AUTO


@pytest.mark.parametrize("extract, flag", [(extract_mindspeed_flags, "--coc-parallel-num"),
                                           (extract_cp_flags, "--cp-window-size")])
def test_both_flag_groups_treat_double_dash_alike(extract, flag):
    # One scanner for both groups: a bare -- ends the flags and stays, with all that follows; a flag
    # that takes a value takes the next token, -- too (then its parser names the flag).
    flags, rest = extract(["--use-ascend-coc", "x", "--", flag, "4"])
    assert rest[-4:] == ["x", "--", flag, "4"]
    assert all(value in (None, False) for key, value in flags.items() if key != "use_ascend_coc")
    with pytest.raises(ConfigError) as info:
        extract(["--use-ascend-coc", flag, "--", "4"])
    assert (info.value.variable, info.value.value) == (flag, "--")


def test_extract_then_load_round_trip():
    flags, rest = extract_mindspeed_flags(["train.py", "--use-ascend-coc", "--coc-parallel-num=8"])
    cfg = load_config({}, flags)
    assert (cfg.parallel_num, cfg.mode, rest) == (8, "chunked", ["train.py"])


# --- validate_all -----------------------------------------------------------------------


def test_validate_all_collects_every_error_in_order(tmp_path):
    path = write_json(tmp_path, {"k_min": 0, "bogus": 1})
    environ = {
        "COC_LOG_LEVEL": "loud",
        "COC_CONFIG": path,
        "COC_CUSTOMIZED": "[]",
        "COC_MATMUL_SOC_FRIENDLY": "x",
        "USE_COC_FUSED_KERNEL": "maybe",
        "COC_PARALLEL_NUM": "0",
        "COC_DISABLE": "nah",
    }
    errors = validate_all(environ, {**FLAGS_ON, "parallel_num": 3})
    assert [e.variable for e in errors] == [
        "COC_DISABLE", "COC_PARALLEL_NUM", "USE_COC_FUSED_KERNEL", "COC_MATMUL_SOC_FRIENDLY", "COC_CUSTOMIZED",
        f"COC_CONFIG={path}: key 'k_min'", f"COC_CONFIG={path}", "COC_LOG_LEVEL",
    ]
    assert all(isinstance(e, ConfigError) for e in errors)
    # load_config raises the first of them.
    assert error_of(environ).variable == "COC_DISABLE"


def test_validate_all_empty_when_valid(tmp_path):
    environ = {"COC_PARALLEL_NUM": "4", "COC_CONFIG": write_json(tmp_path, ORIGIN_CFG), "COC_LOG_LEVEL": "debug"}
    assert validate_all(environ, {**FLAGS_ON, "parallel_num": 4}) == []


# --- helpers ----------------------------------------------------------------------------


def test_every_variable_the_project_names_is_a_row():
    # Messages, docs and code spell variable names in prose; a renamed or removed row must not leave
    # them stale. Not settings: the typo in an example, bench/selftest's device, a fake's attribute.
    from coc_inject.settings import table

    root = pathlib.Path(cfgmod.__file__).parent.parent
    paths = [*root.joinpath("coc_inject").rglob("*.py"), *root.joinpath("sitecustomize").glob("*.py"),
             root / "README.md", *root.joinpath("docs").glob("*.md"), *root.joinpath("env").glob("*.sh")]
    named = {name for path in paths for name in re.findall(r"\b(?:USE_)?COC_[A-Z0-9_]*[A-Z0-9]\b", path.read_text())}
    others = {"COC_PARALLEL_NUMS", "COC_BENCH_DEVICE", "COC_SELFTEST_DEVICE", "COC_PREFIXES", "COC_FAKE_DEVICE_TYPE"}
    assert named - others == set(table.VARIABLES)


def test_unknown_variables_spots_typos():
    environ = {"COC_PARALLEL_NUMS": "4", "COC_PARALLEL_NUM": "4", "USE_COC_FUSED": "1", "PATH": "/bin"}
    assert unknown_variables(environ) == ["COC_PARALLEL_NUMS", "USE_COC_FUSED"]


def test_module_source_stays_lean_and_never_evals():
    text = open(cfgmod.__file__, encoding="utf-8").read()
    for heavy in ("torch", "megatron", "wrapt", "logging"):
        assert f"import {heavy}" not in text
    assert "eval(" not in text
    for path in pathlib.Path(cfgmod.__file__).parent.joinpath("settings").glob("*.py"):  # the table and its helpers
        text = path.read_text(encoding="utf-8")
        assert not any(f"import {heavy}" in text for heavy in ("torch", "megatron", "wrapt", "logging")), path
        assert "eval(" not in text, path


def test_each_setting_is_one_row():
    from coc_inject.settings import rules, table

    assert [f.name for f in dataclasses.fields(CocConfig)] == [row.field for row in table.FIELDS]
    for name in ("variable", "field", "file_key", "flag"):
        spelled = [getattr(row, name) for row in table.SETTINGS if getattr(row, name) is not None]
        assert len(spelled) == len(set(spelled)), name
    assert [s.name for s in ENV_REFERENCE] == list(table.VARIABLES)
    assert table.variable_for("cp_window") == "COC_CP_WINDOW"
    for row in table.SETTINGS:
        assert row.needs is None or row.needs in rules.SWITCHED_ON
        assert row.kind is not None or row.field is None  # only a variable read elsewhere has no kind


@pytest.mark.parametrize("text,expected", [("atb", "atb"), (" ATB ", "atb"), ("Chunked", "chunked"), ("auto", "auto")])
def test_fused_backend_choices(text, expected):
    assert load_config({"COC_FUSED_BACKEND": text}).fused_backend == expected


def test_fused_backend_rejects_unknown_names():
    err = error_of({"COC_FUSED_BACKEND": "mc3"})
    assert str(err) == "COC_FUSED_BACKEND='mc3' is invalid: expected auto, chunked, atb, mc2, symm_mem (any case)"


def test_deterministic_flag_and_fingerprint():
    assert load_config({"COC_DETERMINISTIC": "yes"}).deterministic is True
    # Ranks must agree on the backend and determinism; defaults keep their old fingerprint.
    assert CocConfig(deterministic=True).fingerprint() != CocConfig().fingerprint()
    assert CocConfig(fused_backend="chunked").fingerprint() != CocConfig().fingerprint()


def test_config_backend_choices_match_the_registry():
    registry = pytest.importorskip("coc_inject.linears.fused.registry")
    assert cfgmod.FUSED_BACKENDS == registry.CHOICES


# --- COC_PARALLEL_NUM=auto and its tuning settings ------------------------------------------


def test_auto_chunk_count_everywhere_a_count_is_accepted():
    from coc_inject.config import AUTO

    config = load_config({"COC_PARALLEL_NUM": " Auto ", "COC_CUSTOMIZED": '{"[8, 4, 4]": "auto", "[2, 2, 2]": 4}'})
    assert config.parallel_num == AUTO and config.enabled and config.mode == "chunked"
    assert config.chunks_for(8, 4, 4) == AUTO and config.chunks_for(2, 2, 2) == 4 and config.chunks_for(1, 1, 1) == AUTO
    assert config.describe()["parallel_num"] == "auto"
    assert config.describe()["customized_coc"] == {"[2, 2, 2]": 4, "[8, 4, 4]": "auto"}
    only_one_shape = load_config({"COC_CUSTOMIZED": '{"[8, 4, 4]": "AUTO"}'})
    assert only_one_shape.enabled and only_one_shape.parallel_num == 1


@pytest.mark.parametrize("value", [-2, 0, "autotune", ""])
def test_customized_rejects_what_is_not_a_count_or_auto(value):
    err = error_of({"COC_CUSTOMIZED": json.dumps({"[8, 4, 4]": value})})
    assert err.variable == "COC_CUSTOMIZED['[8, 4, 4]']" and err.value == value


def test_auto_and_fixed_counts_have_different_fingerprints():
    from coc_inject.config import AUTO

    assert CocConfig(parallel_num=AUTO).fingerprint() != CocConfig(parallel_num=4).fingerprint()
    assert CocConfig(parallel_num=AUTO).fingerprint() != CocConfig(parallel_num=AUTO, tune_candidates=(2, 4)).fingerprint()


@pytest.mark.parametrize("text,expected", [("2,4,8", (2, 4, 8)), ("8, 2", (2, 8)), ("16", (16,))])
def test_tune_candidates(text, expected):
    assert load_config({"COC_PARALLEL_NUM": "auto", "COC_TUNE_CANDIDATES": text}).tune_candidates == expected


@pytest.mark.parametrize("text", ["1,2", "2,2", ",", "2,x", "4;8", "0"])
def test_tune_candidates_rejects(text):
    err = error_of({"COC_TUNE_CANDIDATES": text})
    assert err.variable == "COC_TUNE_CANDIDATES" and "distinct integers >= 2" in str(err)


def test_tune_cache_default_off_and_bad_values():
    assert load_config({"HOME": "/home/u"}).tune_cache == "/home/u/.cache/coc-inject/tune.json"
    assert load_config({"XDG_CACHE_HOME": "/c", "HOME": "/home/u"}).tune_cache == "/c/coc-inject/tune.json"
    assert load_config({"COC_TUNE_CACHE": "off", "HOME": "/h"}).tune_cache is None
    assert load_config({"COC_TUNE_CACHE": "/t/tune.json"}).tune_cache == "/t/tune.json"
    err = error_of({"COC_TUNE_CACHE": "relative/tune.json"})
    assert err.variable == "COC_TUNE_CACHE" and "absolute file path, or off" in str(err)


# --- context parallelism ---------------------------------------------------------------


@pytest.mark.parametrize("text,want", [("ring", "ring"), ("Megatron_CP_Algo", "ring"), ("ulysses_cp_algo", "ulysses"),
                                       ("hybrid_cp_algo", "hybrid"), ("all_gather", "allgather"),
                                       (" allgather ", "allgather"), ("megatron", "megatron")])
def test_cp_algo_names(text, want):
    config = load_config({"COC_CP_ALGO": text})
    assert config.cp_algorithm == want and config.armed and not config.enabled


def test_cp_follows_megatron_when_coc_is_on_and_is_off_otherwise():
    assert load_config({"COC_PARALLEL_NUM": "4"}).cp_algorithm == "megatron"
    assert load_config({}).cp_algorithm is None and not load_config({}).armed
    assert load_config({"COC_CP_ALGO": "ring", "COC_DISABLE": "1"}).cp_algorithm is None


@pytest.mark.parametrize("environ,variable,allowed", [
    ({"COC_CP_ALGO": "zigzag"}, "COC_CP_ALGO", "ring, ulysses, hybrid, allgather"),
    ({"COC_CP_ALGO": "ring", "COC_CP_WINDOW": "0"}, "COC_CP_WINDOW", "an integer >= 1"),
    ({"COC_CP_ALGO": "hybrid", "COC_CP_ULYSSES_DEGREE": "1"}, "COC_CP_ULYSSES_DEGREE", "an integer >= 2"),
    ({"COC_CP_ALGO": "ring", "COC_CP_MASK_TYPE": "padding"}, "COC_CP_MASK_TYPE", "causal or general"),
    ({"COC_CP_WINDOW": "2"}, "COC_CP_WINDOW", "COC_CP_ALGO"),
])
def test_cp_errors_name_variable_value_and_allowed(environ, variable, allowed):
    error = error_of(environ)
    assert error.variable == variable and allowed in str(error) and environ[variable] in str(error)


def test_cp_flags_are_taken_out_of_argv():
    argv = ["train.py", "--context-parallel-algo", "megatron_cp_algo", "--cp-window-size=2", "--lr", "1",
            "--use-cp-send-recv-overlap", "--attention-mask-type", "causal", "--ulysses-degree-in-cp", "2", "--",
            "--cp-window-size", "4"]
    flags, rest = extract_cp_flags(argv)
    assert flags == {"cp_algo": "ring", "cp_window": 2, "cp_mask_type": "causal", "cp_ulysses_degree": 2}
    assert rest == ["train.py", "--lr", "1", "--", "--cp-window-size", "4"]
    config = load_config({}, cp_flags=flags)
    assert (config.cp_algorithm, config.cp_window, config.cp_ulysses_degree) == ("ring", 2, 2)


def test_cp_flag_disagreeing_with_its_variable_is_an_error():
    flags, _ = extract_cp_flags(["--context-parallel-algo", "ulysses_cp_algo"])
    error = error_of({"COC_CP_ALGO": "ring"}, cp_flags=flags)
    assert "--context-parallel-algo ulysses disagrees with COC_CP_ALGO=ring" in str(error)
    assert load_config({"COC_CP_ALGO": "ulysses"}, cp_flags=flags).cp_algorithm == "ulysses"
    with pytest.raises(ConfigError, match="--cp-window-size"):
        extract_cp_flags(["--cp-window-size", "x"])


def test_cp_settings_enter_the_fingerprint_only_when_cp_is_on():
    base = load_config({"COC_PARALLEL_NUM": "4"})
    assert base.fingerprint() != load_config({"COC_PARALLEL_NUM": "4", "COC_CP_ALGO": "ring"}).fingerprint()
    ring = load_config({"COC_CP_ALGO": "ring"})
    assert ring.fingerprint() != load_config({"COC_CP_ALGO": "ring", "COC_CP_WINDOW": "2"}).fingerprint()
    assert load_config({}).fingerprint() == CocConfig().fingerprint()


# -- the attention kernel (COC_ATTN_KERNEL) and fused attention at CP = 1 (COC_FLASH_ATTN) ------------


def test_attention_kernel_and_flash_attention_settings():
    config = load_config({"COC_FLASH_ATTN": "1", "COC_ATTN_KERNEL": "Reference"})
    assert (config.flash_attn, config.attn_kernel, config.attention_armed, config.armed) == (True, "reference",
                                                                                            True, True)
    assert config.cp_algorithm is None and not config.enabled  # the linears and CP stay off
    assert load_config({"COC_CP_ALGO": "ring", "COC_ATTN_KERNEL": "fused"}).attn_kernel == "fused"
    assert load_config({"COC_PARALLEL_NUM": "2", "COC_ATTN_KERNEL": "fused"}).attn_kernel == "fused"
    # MindSpeed's flags switch attention on too (they are merged after the variables).
    assert load_config({"COC_ATTN_KERNEL": "fused"}, cp_flags={"cp_algo": "ring"}).attn_kernel == "fused"
    assert load_config({"COC_ATTN_KERNEL": "fused"},
                       argv_flags={"use_ascend_coc": True, "parallel_num": 2}).attn_kernel == "fused"
    assert CocConfig().attn_kernel == "auto" and not CocConfig().flash_attn and not CocConfig().attention_armed
    assert not load_config({"COC_FLASH_ATTN": "1", "COC_DISABLE": "1"}).armed
    # Agreed across ranks only when set: default configurations keep their fingerprint.
    assert CocConfig().fingerprint() == CocConfig(attn_kernel="auto", flash_attn=False).fingerprint()
    assert CocConfig(flash_attn=True).fingerprint() != CocConfig().fingerprint()
    assert CocConfig(cp_algo="ring", attn_kernel="reference").fingerprint() != CocConfig(cp_algo="ring").fingerprint()


@pytest.mark.parametrize("environ,variable,allowed", [
    ({"COC_FLASH_ATTN": "1", "COC_ATTN_KERNEL": "flash"}, "COC_ATTN_KERNEL", "auto, fused or reference"),
    ({"COC_FLASH_ATTN": "maybe"}, "COC_FLASH_ATTN", "1/0, true/false"),
    ({"COC_ATTN_KERNEL": "fused"}, "COC_ATTN_KERNEL", "COC_CP_ALGO or COC_FLASH_ATTN=1 set too"),
])
def test_attention_kernel_errors_name_the_variable(environ, variable, allowed):
    (error,) = validate_all(environ)
    assert error.variable == variable and allowed in str(error) and repr(environ[variable]) in str(error)
    with pytest.raises(ConfigError):
        CocConfig(attn_kernel="flash")


@pytest.mark.parametrize("text,want", [("2", 2), ("4", 4), (" auto ", cfgmod.AUTO), ("1", 1)])
def test_multi_copy_counts_and_auto(text, want):
    config = load_config({"COC_MULTI_COPY": text})
    assert config.multi_copy == want
    assert config.armed == (want != 1) and config.multi_copy_armed == (want != 1)
    assert not config.enabled and config.cp_algorithm is None  # copies alone leave the linears and attention be


@pytest.mark.parametrize("text", ["0", "-1", "two", "2.5", ""])
def test_multi_copy_bad_values_name_the_variable_and_what_is_allowed(text):
    if not text:
        assert load_config({"COC_MULTI_COPY": text}).multi_copy == 1  # blank: unset
        return
    with pytest.raises(ConfigError) as error:
        load_config({"COC_MULTI_COPY": text})
    assert str(error.value).startswith(f"COC_MULTI_COPY={text!r} is invalid: expected 1 (off), an integer n >= 2")
    assert "auto" in str(error.value)


def test_multi_copy_is_agreed_across_ranks_when_set():
    assert load_config({"COC_MULTI_COPY": "2"}).fingerprint() != load_config({}).fingerprint()
    assert load_config({"COC_MULTI_COPY": "1"}).fingerprint() == load_config({}).fingerprint()


@pytest.mark.parametrize("text,want", [("1", "1"), ("on", "1"), (" AUTO ", "auto"), ("0", "0"), ("off", "0"), ("", "0")])
def test_moe_overlap_values(text, want):
    config = load_config({"COC_MOE_OVERLAP": text})
    assert config.moe_overlap == want
    assert config.armed == (want != "0") and config.moe_armed == (want != "0")
    assert not config.enabled and config.cp_algorithm is None and not config.multi_copy_armed  # MoE alone
    assert load_config({"COC_MOE_OVERLAP": text, "COC_DISABLE": "1"}).moe_armed is False


@pytest.mark.parametrize("text", ["2", "pieces", "-1"])
def test_moe_overlap_bad_values_name_the_variable_and_what_is_allowed(text):
    with pytest.raises(ConfigError) as error:
        load_config({"COC_MOE_OVERLAP": text})
    assert str(error.value).startswith(f"COC_MOE_OVERLAP={text!r} is invalid: expected 0 (off), 1 (pieces) or auto")


def test_mindspeed_moe_overlap_flag_reads_as_1_and_leaves_argv():
    flags, rest = extract_cp_flags(["train.py", "--moe-alltoall-overlap-comm", "--num-experts", "4"])
    assert rest == ["train.py", "--num-experts", "4"]
    assert load_config({}, cp_flags=flags).moe_overlap == "1"
    assert load_config({"COC_MOE_OVERLAP": "1"}, cp_flags=flags).moe_overlap == "1"
    assert "disagrees with COC_MOE_OVERLAP=auto" in str(error_of({"COC_MOE_OVERLAP": "auto"}, cp_flags=flags))
    assert load_config({"COC_MOE_OVERLAP": "auto"}).fingerprint() != load_config({}).fingerprint()


def test_deterministic_exports_the_backends_variables_and_nothing_else_does():
    assert load_config({"COC_PARALLEL_NUM": "4"}).exported_environment() == {}
    on = load_config({"COC_PARALLEL_NUM": "4", "COC_DETERMINISTIC": "1"})
    assert on.exported_environment() == {"LCCL_DETERMINISTIC": "1", "HCCL_DETERMINISTIC": "true"}
