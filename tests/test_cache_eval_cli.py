"""``gateway cache-eval``: per tier and setting, precision, recall and false-hit rate of
labelled pairs, as a table or JSON; the shipped tiers make no false hit on the adversarial
pairs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.cache.evaluate import DEFAULT_SETTING
from gateway.cli import main

DATA = Path(__file__).parent.parent / "gateway" / "data"


def test_json_report_has_every_setting_and_no_false_hit_by_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["cache-eval", str(DATA / "adversarial_pairs.tsv"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["pairs"] > 200 and report["default"] == DEFAULT_SETTING
    rows = {row["setting"]: row for row in report["rows"]}
    assert {"exact", "simhash<=0", "simhash<=3+guard", "guard-only"} <= set(rows)
    default = rows[DEFAULT_SETTING]
    assert default["false_hits"] == 0 and default["false_hit_rate"] == 0.0
    assert default["precision"] == 1.0 and default["recall"] > 0.9
    for row in rows.values():
        counts = row["true_hits"] + row["false_hits"] + row["misses"] + row["true_rejects"]
        assert counts == report["pairs"]


def test_table_report_for_several_files(capsys: pytest.CaptureFixture[str]) -> None:
    files = [str(DATA / "adversarial_pairs.tsv"), str(DATA / "question_pairs.tsv")]
    assert main(["cache-eval", *files]) == 0
    out = capsys.readouterr().out
    assert out.count("precision") == 2 and "question_pairs.tsv" in out
    assert f"* {DEFAULT_SETTING}" in out


def test_a_malformed_file_is_an_error_naming_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.tsv"
    bad.write_text("label\tfirst\tsecond\n1\ta\tb\nnot a pair\n")
    assert main(["cache-eval", str(bad)]) == 1
    assert "bad.tsv:3" in capsys.readouterr().err
