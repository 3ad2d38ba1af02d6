"""Gate checks against the versioned thresholds."""

import pytest

from eval.gate import (
    DEFAULT_THRESHOLDS,
    gate_checks,
    gate_passed,
    load_thresholds,
    release_scope,
    skipped_without_baseline,
)
from eval.report import gate_lines, gate_reason, render_markdown


def test_thresholds_file_is_versioned():
    t = load_thresholds()
    assert t["version"] == 1 and t["_file"] == str(DEFAULT_THRESHOLDS) and len(t["_sha256"]) == 64
    assert t["kl"]["max_mean_kl"] > 0 and t["gsm8k"]["strict_severity"] == "warn"


def test_bad_thresholds_file(tmp_path):
    (tmp_path / "t.toml").write_text("[kl]\nmax_mean_kl = 1\n")
    with pytest.raises(ValueError, match="version"):
        load_thresholds(tmp_path / "t.toml")


@pytest.mark.parametrize("text,message", [
    ("version = 1\n[kl]\nmax_mean_kl = 'x'\n", "kl.max_mean_kl must be a number, got 'x'"),
    ("version = 1\n[kl]\nseverity = 'error'\n", "kl.severity must be 'fail' or 'warn', got 'error'"),
    ("version = 1\n[kl]\nmax_mean_kll = 0.1\n", "unknown key kl.max_mean_kll (known: max_mean_kl, "),
    ("version = 1\n[gsmk]\nz = 2\n", "unknown section [gsmk]"),
    ("version = 1\n[kl\nmax = 1\n", "not valid TOML"),
    ("version = 1\nkl = 3\n", "'kl' must be a table [kl]"),
])
def test_thresholds_errors_name_file_and_key(tmp_path, text, message):
    p = tmp_path / "t.toml"
    p.write_text(text)
    with pytest.raises(ValueError) as e:
        load_thresholds(p)
    assert str(e.value).startswith(f"thresholds file {p}: ") and message in str(e.value)
    with pytest.raises(ValueError) as e:
        load_thresholds(tmp_path / "none.toml")
    assert str(e.value).startswith(f"thresholds file {tmp_path / 'none.toml'}: cannot read it")


def test_missing_threshold_keys_fall_back_to_v1(tmp_path):
    p = tmp_path / "strict.toml"
    p.write_text("version = 2\n[kl]\nmax_mean_kl = 0.05\n")
    t, v1 = load_thresholds(p), load_thresholds()
    assert t["kl"]["max_mean_kl"] == 0.05 and t["kl"]["severity"] == "fail"
    assert t["passkey"] == v1["passkey"] and t["version"] == 2
    assert "kl.severity" in t["_defaulted"] and "kl.max_mean_kl" not in t["_defaulted"]
    assert len(t["_defaulted"]) == sum(len(v) for k, v in v1.items() if isinstance(v, dict)) - 1
    # the gate runs on it (no KeyError after a whole eval)
    suites = {"kl": {"mean_kl": 0.1, "top1_agree": 0.95, "ppl_ref": 10.0, "ppl_test": 10.2, "tokens": 500}}
    assert not gate_passed(gate_checks(suites, t))
    assert load_thresholds()["_defaulted"] == []


def test_release_scope():
    full = release_scope(["kl", "gsm8k", "passkey"], ["kl", "gsm8k", "passkey"], None, "/src", "in-process")
    assert full == {"release": True, "not_release": []}
    part = release_scope(["gsm8k"], ["gsm8k"], 3, None, "in-process")
    assert not part["release"] and part["not_release"] == [
        "--limit 3: only the first 3 problems of each set were scored",
        "no baseline: no accuracy drop could be measured",
        "suite(s) kl, passkey not run (a release gate runs kl, gsm8k, passkey)"]
    assert release_scope(["gsm8k", "passkey"], ["gsm8k", "passkey"], None, "/s", "endpoint")["release"]
    cut = release_scope(["kl", "gsm8k", "passkey"], ["kl"], None, "/s", "in-process")
    assert cut["not_release"] == ["the evaluation did not finish (gsm8k, passkey not done)"]
    assert skipped_without_baseline({"gsm8k": {}, "degenerate": {}}) == [
        "gsm8k.flexible-extract.drop", "gsm8k.strict-match.drop", "degenerate.increase"]


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


def _report(suites, t, complete=True, scope=None, baseline=None, **extra):
    checks = gate_checks(suites, t)
    passed = complete and gate_passed(checks)
    return {"build": {"path": "/x/b", "manifest_sha256": None}, "baseline": baseline,
            "backend": {"build": "in-process", "device_name": "cpu"}, "complete": complete,
            "thresholds": {"version": 1, "file": t["_file"], "defaulted": []}, "suites": suites,
            "scope": scope, "gate": {"passed": passed, "release": passed and scope["release"],
                                     "reason": gate_reason(checks, complete, scope), "checks": checks,
                                     "skipped": [] if baseline else skipped_without_baseline(suites)},
            "versions": {}, "seeds": {}, "data": {}, "timings_s": {}, **extra}


def _scope(suites, done, limit, baseline, n):
    return {"suites": suites, "suites_done": done, "limit": limit, "baseline": baseline,
            "backend": "in-process", "n": n, **release_scope(suites, done, limit, baseline, "in-process")}


def test_markdown_says_why_an_unfinished_run_failed():
    t = load_thresholds()
    suites = {"kl": {"mean_kl": 0.01, "top1_agree": 0.9, "ppl_ref": 5.0, "ppl_test": 5.1, "tokens": 10}}
    scope = _scope(["kl", "gsm8k", "passkey"], ["kl"], None, "/s", {"kl": {"n": 10, "unit": "tokens"}})
    md = render_markdown(_report(suites, t, complete=False, scope=scope, baseline={"path": "/s"}))
    assert "**Gate: FAILED**" in md and "| kl.mean_kl | 0.01 |" in md
    assert ("**incomplete: the evaluation did not finish (suites done: kl; not done: gsm8k, passkey).** "
            "The checks below cover only the finished suites.") in md


def test_markdown_of_a_partial_run_without_baseline():
    t = load_thresholds()
    gsm = {"strict-match": {"acc": 0.4}, "flexible-extract": {"acc": 0.4}, "n": 5}
    suites = {"gsm8k": {"settings": {}, "build": gsm},
              "passkey": {"settings": {}, "build": {"mean": 0.75, "max_length_all_depths_100": 1024,
                                                    "worst_cell": {"acc": 0.5, "length": 4096, "depth": 50},
                                                    "heatmap": "passkey_build.png"}},
              "degenerate": {"build": {"n": 9, "degenerate": 0, "rate": 0.0, "reasons": {}, "examples": []}}}
    scope = _scope(["gsm8k", "passkey"], ["gsm8k", "passkey"], 5, None,
                   {"gsm8k": {"n": 5, "unit": "problems"}, "passkey": {"n": 4, "unit": "prompts"}})
    md = render_markdown(_report(suites, t, scope=scope, warnings=["BUILD /x/b has no manifest"],
                                 files=["report.json", "report.md"]))
    assert "**Gate: PASSED**" in md
    assert ("Scope: suites gsm8k, passkey (GSM8K 5 problems, passkey 4 prompts); first 5 problems only "
            "(--limit); no baseline.") in md
    assert ("**Not a release gate** (`quantize upload` refuses it without --force): --limit 5: only the "
            "first 5 problems of each set were scored; no baseline: no accuracy drop could be measured; "
            "suite(s) kl not run") in md
    assert ("No baseline: these comparisons were skipped: gsm8k.flexible-extract.drop, "
            "gsm8k.strict-match.drop, passkey.mean.drop, degenerate.increase.") in md
    assert "**Warning:** BUILD /x/b has no manifest." in md
    assert "Note: 5 problems are too few to judge accuracy by" in md
    assert "worst cell 50.0 % at 4096 tokens, depth 50 % (![build](passkey_build.png))" in md
    assert "- build: 0 of 9 completions degenerate, 0.0 %\n" in md
    assert "`report.json`, `report.md`" in md


def test_checks_render_without_negative_zero():
    t = load_thresholds()
    flat = _paired(0.4, 0.4, 5, 0.2)
    flat["delta"] = 0.0  # -delta is -0.0
    gsm = {"strict-match": {"acc": 0.4}, "flexible-extract": {"acc": 0.4}, "n": 5}
    suites = {"gsm8k": {"settings": {}, "build": gsm, "baseline": gsm,
                        "paired": {"flexible-extract": flat, "strict-match": flat}},
              "degenerate": {"build": {"n": 5, "degenerate": 3, "rate": 0.6, "reasons": {"repeat": 3},
                                       "examples": ["!!!!"]}}}
    checks = gate_checks(suites, t)
    assert str(checks[0]["value"]) == "-0.0"
    scope = _scope(["gsm8k"], ["gsm8k"], None, "/s", {})
    md = render_markdown(_report(suites, t, scope=scope, baseline={"path": "/s"}))
    assert "| gsm8k.flexible-extract.drop | 0 | <= 0.392 |" in md and "-0" not in md
    assert "3 of 5 completions degenerate (repeat 3)" in gate_lines({"gate": {"checks": checks}})[0]
    assert "Failed: degenerate.rate 0.6 (limit <= 0.25)." in md
