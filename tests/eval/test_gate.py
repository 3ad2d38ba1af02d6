"""Gate checks against the versioned thresholds."""

import pytest

from eval.gate import DEFAULT_THRESHOLDS, gate_checks, gate_passed, load_thresholds
from eval.report import gate_lines, render_markdown


def test_thresholds_file_is_versioned():
    t = load_thresholds()
    assert t["version"] == 1 and t["_file"] == str(DEFAULT_THRESHOLDS) and len(t["_sha256"]) == 64
    assert t["kl"]["max_mean_kl"] > 0 and t["gsm8k"]["strict_severity"] == "warn"


def test_bad_thresholds_file(tmp_path):
    (tmp_path / "t.toml").write_text("[kl]\nmax_mean_kl = 1\n")
    with pytest.raises(ValueError, match="version"):
        load_thresholds(tmp_path / "t.toml")


def _paired(base, test, n, se):
    return {"n": n, "base_acc": base, "test_acc": test, "delta": test - base, "only_base": 0,
            "only_test": 0, "se": se, "ci95": [0, 0]}


def test_checks_and_verdict():
    t = load_thresholds()
    lim = t["kl"]["max_mean_kl"]
    good = {"kl": {"mean_kl": lim / 2, "top1_agree": 0.95, "ppl_ref": 10.0, "ppl_test": 10.2, "tokens": 500}}
    checks = gate_checks(good, t)
    assert [c["name"] for c in checks] == ["kl.mean_kl", "kl.top1_agree", "kl.ppl_ratio"]
    assert gate_passed(checks)
    bad = {"kl": {**good["kl"], "mean_kl": lim + 0.5}}
    checks = gate_checks(bad, t)
    assert not gate_passed(checks)
    c = checks[0]
    assert not c["passed"] and c["by"] == pytest.approx(0.5) and c["severity"] == "fail"
    report = {"gate": {"passed": False, "checks": checks}}
    assert gate_lines(report)[0].startswith(f"FAIL kl.mean_kl: {lim + 0.5:.4g} (limit <= {lim:.4g}, off by 0.5)")


def test_gsm8k_drop_is_judged_against_its_noise():
    t = load_thresholds()
    # a 3-point drop on 1319 problems with paired se 0.005 fails flexible (limit 1.96 * se)
    suites = {"gsm8k": {"paired": {"flexible-extract": _paired(0.60, 0.57, 1319, 0.005),
                                   "strict-match": _paired(0.50, 0.40, 1319, 0.005)}}}
    checks = {c["name"]: c for c in gate_checks(suites, t)}
    f = checks["gsm8k.flexible-extract.drop"]
    assert not f["passed"] and f["limit"] == pytest.approx(max(t["gsm8k"]["min_drop"], 1.96 * 0.005))
    # the same drop on 5 problems (se 0.2) is noise
    suites["gsm8k"]["paired"]["flexible-extract"] = _paired(0.60, 0.40, 5, 0.2)
    checks = {c["name"]: c for c in gate_checks(suites, t)}
    assert checks["gsm8k.flexible-extract.drop"]["passed"]
    # strict-only drop: a formatting finding (warn), the gate passes
    s = checks["gsm8k.strict-match.drop"]
    assert not s["passed"] and s["severity"] == "warn"
    assert gate_passed(list(checks.values()))


def test_degenerate_fails_whatever_the_scores_say():
    t = load_thresholds()
    suites = {"kl": {"mean_kl": 0.0, "top1_agree": 1.0, "ppl_ref": 5.0, "ppl_test": 5.0, "tokens": 10},
              "degenerate": {"build": {"n": 10, "degenerate": 6, "rate": 0.6, "reasons": {"repeat": 6}},
                             "baseline": {"n": 10, "degenerate": 0, "rate": 0.0, "reasons": {}}}}
    checks = gate_checks(suites, t)
    failed = [c["name"] for c in checks if not c["passed"]]
    assert failed == ["degenerate.rate", "degenerate.increase"] and not gate_passed(checks)


def test_markdown_renders_every_section():
    t = load_thresholds()
    suites = {"kl": {"mean_kl": 0.01, "top1_agree": 0.9, "ppl_ref": 5.0, "ppl_test": 5.1, "tokens": 10}}
    report = {"build": {"path": "/x/b", "manifest_sha256": "ab" * 32}, "baseline": None,
              "backend": {"build": "in-process", "device_name": "cpu"},
              "thresholds": {"version": 1, "file": t["_file"]}, "suites": suites,
              "gate": {"passed": True, "checks": gate_checks(suites, t)},
              "versions": {}, "seeds": {}, "data": {}, "timings_s": {}}
    md = render_markdown(report)
    assert "**Gate: PASSED**" in md and "| kl.mean_kl | 0.01 |" in md and "mean KL 0.01000" in md
