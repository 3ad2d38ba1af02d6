"""``quantize eval`` end to end on the demo build (CI): kl + 3-problem GSM8K + a small passkey
grid + ARC, the report's structure, and a build with one corrupted fused-group global scale
(FC-06) failing the gate."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantize.cli import main

FAST = ["--limit", "3", "--max-gen-toks", "16", "--kl-tokens", "512", "--passkey-lengths", "160,320",
        "--passkey-depths", "0,100", "--passkey-trials", "1", "--batch-size", "5", "--device", "cpu"]


@pytest.fixture(scope="module")
def demo_report(demo_build, demo_src, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval")
    # left by an earlier, wider run (kv-parity) and by the user: only ours must go
    (out / "passkey_kv_fp8.png").write_bytes(b"stale")
    (out / "notes.txt").write_text("mine")
    rc = main(["eval", str(demo_build), "--baseline", str(demo_src), "--suite", "kl,gsm8k,passkey,mc",
               "--out", str(out), *FAST])
    return rc, out, json.loads((out / "report.json").read_text())


def test_demo_build_passes_and_report_has_every_part(demo_report, demo_build, demo_src, tmp_path):
    rc, out, r = demo_report
    assert rc == 0 and r["gate"]["passed"]
    # --limit 3: the checks passed, but this is no release gate (quantize upload refuses it)
    assert r["gate"]["release"] is False and r["scope"]["release"] is False
    assert r["scope"]["not_release"] == ["--limit 3: only the first 3 problems of each set were scored"]
    assert r["scope"]["limit"] == 3 and r["scope"]["baseline"] == demo_src.name  # published: no local path
    assert r["scope"]["suites_done"] == ["kl", "gsm8k", "mc", "passkey"]
    assert r["scope"]["n"] == {"kl": {"n": 511, "unit": "tokens"}, "gsm8k": {"n": 3, "unit": "problems"},
                               "mc": {"n": 3, "unit": "problems"}, "passkey": {"n": 4, "unit": "prompts"}}
    assert r["results"]["gsm8k"]["dataset"]["split"] == "test[:3]"
    assert r["warnings"] == [] and r["gate"]["skipped"] == []
    # the folder holds exactly what the report lists (the stale heatmap is gone, notes.txt kept)
    present = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert present == sorted([*r["files"], "notes.txt"]) and "passkey_kv_fp8.png" not in present
    assert r["schema"] == "spark-quant-eval/1" and r["complete"] is True
    assert r["build"]["manifest_sha256"] == __import__("hashlib").sha256(
        (demo_build / "spark_quant_manifest.json").read_bytes()).hexdigest()
    assert r["baseline"]["quant_method"] == "fp8" and r["build"]["quant_method"] == "compressed-tensors"
    assert r["backend"]["build"] == "in-process" and r["backend"]["device"] == "cpu"
    assert {"torch", "transformers", "lm_eval", "compressed-tensors"} <= set(r["versions"])
    assert r["versions"]["lm_eval"] == "0.4.13"
    assert r["thresholds"]["version"] == 1 and len(r["thresholds"]["sha256"]) == 64
    assert set(r["data"]) >= {"gsm8k", "arc_challenge", "essays_sha256", "passkey_prompts_sha256"}
    assert r["seeds"] == {"lm_eval": 1234, "passkey": 1234}
    for f in ("report.json", "report.md", "gsm8k_samples.jsonl", "passkey_records.jsonl",
              "passkey_build.png", "passkey_baseline.png", "tasks/spark_gsm8k.yaml"):
        assert (out / f).is_file(), f
    names = {c["name"] for c in r["gate"]["checks"]}
    assert {"kl.mean_kl", "kl.top1_agree", "gsm8k.flexible-extract.drop", "gsm8k.strict-match.drop",
            "mc.acc.drop", "passkey.mean.drop", "degenerate.rate"} <= names
    md = (out / "report.md").read_text()
    assert "**Gate: PASSED**" in md and "**Not a release gate**" in md and "-0 " not in md
    assert "Note: 3 problems are too few to judge accuracy by" in md
    # quantize upload reads this report: its verdict and the card's model-index numbers.
    from quantize.hub.card import read_gate, render_card

    assert read_gate(r) == (False, "passed on a partial run, not a release gate (--limit 3: only the "
                                   "first 3 problems of each set were scored)")
    assert r["results"]["kl"]["mean_kl"] == r["suites"]["kl"]["mean_kl"]
    assert r["results"]["gsm8k"]["exact_match,flexible-extract"] == r["suites"]["gsm8k"]["build"]["flexible-extract"]["acc"]
    staged = tmp_path / "card_check"
    shutil.copytree(demo_build, staged, ignore=shutil.ignore_patterns("eval"))
    (staged / "eval").mkdir()
    shutil.copy(out / "report.json", staged / "eval" / "report.json")
    card = str(render_card(staged, "me/demo-nvfp4"))
    assert "Eval gate: **passed on a partial run, not a release gate (--limit 3" in card
    assert "| gsm8k | exact_match,strict-match |" in card and "| 3 problems |" in card


def test_demo_kl_gsm8k_passkey_values(demo_report):
    _, out, r = demo_report
    s = r["suites"]
    kl = s["kl"]
    assert kl["tokens"] == 511  # one window of 512 ids scores 511 next tokens
    # measured 0.2178 nats / 69.9 % top-1 / perplexity 24.03 -> 31.24 (deterministic on CPU)
    assert kl["mean_kl"] == pytest.approx(0.2178, abs=0.01)
    assert kl["top1_agree"] == pytest.approx(0.699, abs=0.02)
    assert kl["ppl_ref"] == pytest.approx(24.03, rel=0.01) and kl["ppl_test"] == pytest.approx(31.24, rel=0.02)
    g = s["gsm8k"]
    assert g["build"]["n"] == g["baseline"]["n"] == 3 and g["settings"]["chat_template"]
    for f in ("strict-match", "flexible-extract"):
        assert 0.0 <= g["build"][f]["acc"] <= 1.0
        assert g["paired"][f]["n"] == 3
    rows = [json.loads(x) for x in (out / "gsm8k_samples.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and {x["model"] for x in rows} == {"build", "baseline"}
    assert all(x["response"] and "strict-match" in x and "flexible-extract" in x for x in rows)
    assert [x["target"] for x in rows[:3]] == ["18", "3", "70000"]
    pk = s["passkey"]
    assert pk["build"]["lengths"] == [160, 320] and pk["build"]["depths"] == [0, 100]
    assert pk["baseline"]["mean"] == 1.0  # SmolLM2-135M finds the key at these lengths
    mc = s["mc"]
    assert mc["build"]["n"] == 3 and mc["paired"]["n"] == 3
    assert s["degenerate"]["build"]["n"] == 3 + 4


def test_corrupted_fused_group_scale_fails_the_gate(demo_build, demo_src, tmp_path, capsys):
    """FC-06: one member of a fused gate/up group written with a global scale 64x off."""
    broken = tmp_path / "broken"
    shutil.copytree(demo_build, broken, ignore=shutil.ignore_patterns("eval"))
    for stale in ("eval/gsm8k_samples.jsonl", "eval/passkey_build.png", "eval/tasks/spark_gsm8k.yaml"):
        (broken / stale).parent.mkdir(parents=True, exist_ok=True)
        (broken / stale).write_text("from an earlier, wider run")
    index = json.loads((broken / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.0.mlp.up_proj.weight_global_scale"
    shard = broken / index[name]
    tensors = load_file(str(shard))
    assert torch.equal(tensors[name], tensors["model.layers.0.mlp.gate_proj.weight_global_scale"])
    tensors[name] = tensors[name] / 64
    save_file(tensors, str(shard), metadata={"format": "pt"})
    rc = main(["eval", str(broken), "--baseline", str(demo_src), "--suite", "kl", *FAST])
    assert rc == 1
    r = json.loads((broken / "eval" / "report.json").read_text())
    assert not r["gate"]["passed"]
    # a narrower run over an earlier one: only its own files remain, as the report says
    assert r["files"] == ["report.json", "report.md"]
    assert sorted(p.name for p in (broken / "eval").rglob("*")) == ["report.json", "report.md"]
    failed = {c["name"]: c for c in r["gate"]["checks"] if not c["passed"]}
    assert "kl.mean_kl" in failed and failed["kl.mean_kl"]["by"] > 0
    assert r["suites"]["kl"]["mean_kl"] > 5  # measured 8.99 nats, top-1 11 %
    err = capsys.readouterr().err
    assert "FAIL kl.mean_kl" in err and "off by" in err
    from quantize.hub.card import read_gate

    assert read_gate(r)[1].startswith("failed: kl.mean_kl ")
