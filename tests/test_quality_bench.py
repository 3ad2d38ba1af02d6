"""scripts/quality_bench.py without models: the calibration text is disjoint from the scored
text, and a row this tree's CLI refuses is reported, not run."""

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import quality_bench

from calibrate.data import load_records
from quantize.data.texts import essay_dir


def test_heldout_calibration_is_the_essays_not_scored(tmp_path):
    texts, scored = quality_bench.scored_texts()
    assert sum(map(len, texts)) == quality_bench.SCORE_CHARS
    every = sorted(p.name for p in essay_dir().glob("*.txt"))
    assert scored == every[:len(texts)]
    folder, calib = quality_bench.calibration_dataset("essays-heldout", tmp_path, scored)
    assert calib == every[len(texts):] and not set(calib) & set(scored)
    rows = load_records(folder)  # what quantize calibrate / calibrate.gptq read from --dataset
    assert sorted({r["id"].split(":")[0] for r in rows}) == calib
    assert "".join(r["text"] for r in rows) == "".join((essay_dir() / n).read_bytes().decode("utf-8") for n in calib)


def test_builtin_essays_set_is_refused_when_it_overlaps_the_scored_text(tmp_path):
    _, scored = quality_bench.scored_texts()
    with pytest.raises(SystemExit, match="holds out only the default KL essays.*use essays-heldout"):
        quality_bench.calibration_dataset("essays", tmp_path, scored)


def test_row_arguments_the_cli_refuses_are_reported():
    ns, why = quality_bench.parsed_row_args("--scales no-such-method")
    assert ns is None and "invalid choice: 'no-such-method'" in why
    ns, why = quality_bench.parsed_row_args("--no-such-flag")
    assert ns is None and "unrecognized arguments: --no-such-flag" in why
    ns, why = quality_bench.parsed_row_args(quality_bench.OURS["mse"])
    assert why == "" and ns.scales == "mse" and ns.src == "SRC"
