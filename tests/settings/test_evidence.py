"""The evidence behind the allow-list's rows (coc_inject/allowlist/evidence.py, issue 51).

test_field_off_default is generated from the rows: for every row that says supported or irrelevant whose
field has a value valid on the CPU, the wing's smallest real case (a TransformerBlock at TP 2 with SP; a
block of MoE layers at TP 2 x EP 2) is built with the field off its default and run with the wing off and
on: the wing runs and matches Megatron, or steps aside naming the field where its row refuses the value.
All the fields of a case run in one call of a module-scoped pool (one config per field, one process).
"""

import json

import pytest

from coc_inject.allowlist import check, evidence
from coc_inject.allowlist.rows import SUPPORTED
from tests.scope import newest_only

TESTED = evidence.tested()
TOLERANCE = {"float32": 1e-4, "low": 3e-2}  # bf16 / autocast fields: one bf16 rounding apart
LOW_PRECISION = {"bf16", "params_dtype", "enable_autocast", "fp16"}
# Rows whose claim the generated test shows false, fixed on other branches (issue 51 items 1 and 2): the lead
# removes an entry when its fix is merged (strict: an entry that passes fails, so it cannot be forgotten).
# Rows the generated test found false, each fixed since (issue 51 items 1 and 2); a new one goes here, strict.
KNOWN_FALSE: dict = {}

# Differences found here and not yet told apart (harness or defect): reported to the lead, not a verdict.
NOT_TOLD_APART: dict = {}


@pytest.fixture(scope="module")
def results():
    from tests.dist_harness import RankPool

    pool = RankPool(2, timeout=300)
    try:
        found = {}
        for case in ("dense", "moe", "pair", "cp"):  # cp last: it installs the CP wing's shims
            fields = sorted({name for _, name, where in TESTED if where == case})
            # a field known to leave state behind (issue 51 item 2: the copies' MoE meetings) runs last
            fields.sort(key=lambda name: any(name == known for _, known in KNOWN_FALSE))
            per_rank = pool.run(f"tests.settings.evidence_cases:{case}_fields", fields=fields)
            found[case] = per_rank
        yield found
    finally:
        pool.close()


def _params():
    for wing, name, case in TESTED:
        marks = [newest_only]
        if (wing, name) in KNOWN_FALSE:
            marks.append(pytest.mark.xfail(strict=True, reason=KNOWN_FALSE[(wing, name)]))
        if (wing, name) in NOT_TOLD_APART:
            marks.append(pytest.mark.xfail(strict=False, reason=NOT_TOLD_APART[(wing, name)]))
        yield pytest.param(wing, name, case, id=f"{wing}-{name}", marks=marks)


@pytest.mark.parametrize("wing,name,case", list(_params()))
def test_field_off_default(results, wing, name, case):
    """The wing with ``name`` off its default against Megatron: exact where it runs, and where it steps
    aside the reason names a field (this one where the row limits the values)."""
    per_rank = [rank[name] for rank in results[case]]
    for rank, got in enumerate(per_rank):
        assert "megatron" not in got, f"Megatron itself failed with {name} on rank {rank} (not valid on the " \
                                      f"CPU: give it a CANNOT_TEST reason):\n{got['megatron']}"
        outcome = got[wing]
        if "refused" in outcome:  # CP 2 has no Megatron path: a refusal is an error naming the field
            assert name in outcome["refused"] and "error naming it" in check.classification(wing, name).why, \
                (wing, name, outcome)
            continue
        assert "error" not in outcome, f"{wing} with {name}={evidence.CPU_VALUES[name]} on rank {rank}:\n" \
                                       f"{outcome['error']}"
        ran = outcome.get("ran", "")
        row = check.classification(check.MOE if wing == "moe" else wing, name)
        if ran.startswith("no "):  # stepped aside: only for a refused value, naming the field
            limits = row.verdict != SUPPORTED or row.allows is not None
            assert limits or f"{name}=" not in ran, (wing, name, ran)
            assert "=" in ran, f"{wing} stepped aside without naming a setting: {ran}"
            assert outcome["distance"] == 0.0 or outcome["distance"] < TOLERANCE["float32"], (wing, name, outcome)
            continue
        low = name in LOW_PRECISION
        assert outcome["distance"] < TOLERANCE["low" if low else "float32"], \
            f"{wing} with {name}={evidence.CPU_VALUES[name]} differs from Megatron on rank {rank}: {outcome}"


def test_every_row_that_says_supported_or_irrelevant_has_evidence_or_says_why_not():
    """The generator's list (python -m coc_inject.allowlist.evidence): each entry with its reason; a refused
    row needs none (the wing steps aside)."""
    for wing, spec in check.WINGS.items():
        for name, row in spec.rows.items():
            found = evidence.of(wing, name)
            assert found is not None and found[1], (wing, name)
            assert evidence.needs_evidence(row) == (found[0] != "refused"), (wing, name)
    assert all(len(why) > 20 for _, _, why in evidence.gaps())


def test_every_evidence_test_named_exists():
    ids = {f"{wing}-{name}" for wing, name, _ in TESTED}
    for wing, spec in check.WINGS.items():
        for name in spec.rows:
            found = evidence.of(wing, name)
            if found and found[0] == "test":
                assert found[1].startswith(evidence.TEST + "[") and found[1][len(evidence.TEST) + 1:-1] in ids


def test_the_citations_hold_for_the_installed_release():
    """Each cited line of the installed release reads the field, and no line outside the config's files reads
    a cited field but the cited ones (a new read, in a new release, drops the citation: test it instead)."""
    import pathlib

    import megatron.core

    release = megatron.core.__version__.split("+")[0]  # a checkout says 0.19.2+<commit>
    reads = json.loads(evidence.READS.read_text())
    if release not in evidence.RELEASES:
        pytest.skip(f"megatron-core {release}: no citations recorded")
    source = pathlib.Path(megatron.core.__file__).parent
    now = evidence.reads_in(source, sorted(reads))
    for name, per_release in reads.items():
        assert now[name] == per_release[release], name
        for line in now[name]:
            assert not line.startswith(evidence.MEETS), (name, line)
