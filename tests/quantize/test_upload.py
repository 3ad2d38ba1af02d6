"""``quantize upload``: gate, card and resumable upload, with the real huggingface_hub client
talking to the local Hub endpoint (tests/hub_server.py). The endpoint speaks LFS, not Xet, so
the child runs with HF_HUB_DISABLE_XET=1 (huggingface_hub's own switch)."""

import hashlib
import json
import signal
import time
from pathlib import Path

import pytest

from formats.manifest import CHECK_STATS_NAME
from quantize import cli
from quantize.base.errors import CardError, GateFailed
from quantize.convert.pipeline import convert
from quantize.hub.card import read_gate, render_card, validate_card
from quantize.hub.upload import upload_build
from tests.hub_server import FakeHub, client_env, run_quantize

TOKEN = "hf_test_token"
SCOPE = {"suites": ["kl", "gsm8k", "passkey"], "suites_done": ["kl", "gsm8k", "passkey"], "limit": None,
         "baseline": "/models/tiny-fp8", "backend": "in-process",
         "n": {"kl": {"n": 2047, "unit": "tokens"}, "gsm8k": {"n": 1319, "unit": "problems"},
               "passkey": {"n": 75, "unit": "prompts"}},
         "release": True, "not_release": []}
REPORT = {"schema": "spark-quant-eval/1", "complete": True, "scope": SCOPE,
          "gate": {"passed": True, "release": True, "reason": "all checks within thresholds"},
          "results": {"kl": {"mean_kl": 0.0123456, "top1_agreement": 0.971,
                             "dataset": {"type": "baber/paul_graham_essays",
                                         "name": "Paul Graham essays"}},
                      "gsm8k": {"exact_match,strict-match": 0.42,
                                "dataset": {"type": "gsm8k", "name": "GSM8K", "config": "main",
                                            "split": "test"}}}}
PLAN = {"fit": [{"setup": "1x DGX Spark", "weights GiB": 0.01, "KV tokens": 500000, "fits": "yes"}]}


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> Path:
    """A finished build of a 3-shard FP8 checkpoint from the Hub repo org/tiny-fp8 (MIT), with
    a passed eval gate and a fit plan."""
    from tests.quantize.test_hub_download import layered_fp8

    tmp = tmp_path_factory.mktemp("up")
    out = tmp / "build"
    convert(layered_fp8(tmp / "src", layers=3), out, progress=False, device="cpu",
            source_info={"repo": "org/tiny-fp8", "commit": "c0ffee" * 6 + "c0ff",
                         "license": "mit"})
    (out / "eval").mkdir()
    (out / "eval" / "report.json").write_text(json.dumps(REPORT))
    (out / "plan.json").write_text(json.dumps(PLAN))
    return out


def _upload(args: list[str], hub: FakeHub, tmp: Path, kill_on=None):
    env = client_env(hub, tmp / "hf", HF_TOKEN=TOKEN, HF_HUB_DISABLE_XET="1")
    return run_quantize(["upload", *args], env, hub, kill_on=kill_on, timeout=180)


def _sent(log: list[dict]) -> list[dict]:
    """Requests that create, upload or commit anything."""
    return [e for e in log if e["method"] == "PUT" or "/preupload/" in e["path"]
            or "/commit/" in e["path"] or "lfs/objects" in e["path"] or "repos/create" in e["path"]]


def test_upload_publishes_build_then_card(build, tmp_path):
    with FakeHub(token=TOKEN) as hub:
        rc, out, err = _upload([str(build), "--repo", "me/tiny-nvfp4", "--private",
                                "--revision", "spark"], hub, tmp_path)
        assert rc == 0, err
        repo = hub.repos["me/tiny-nvfp4"]
        head = repo.branches["spark"]
        assert out.strip().splitlines()[-1] == f"committed: {hub.url}/me/tiny-nvfp4/commit/{head}"
        assert repo.private and repo.files("main") == {}  # only the branch got the build
        files = repo.files("spark")
        local = {p.relative_to(build).as_posix() for p in build.rglob("*") if p.is_file()}
        assert CHECK_STATS_NAME in local  # the converter's counts describe this folder's files only
        local.discard(CHECK_STATS_NAME)
        assert set(files) == local  # README.md replaced by the card, nothing else hidden
        for rel in local - {"README.md"}:
            assert files[rel].read() == (build / rel).read_bytes(), rel
        card = files["README.md"].read().decode()
        # One commit holds weights and card, after the Hub had checked the card.
        posts = [e["path"] for e in hub.log if e["method"] == "POST"]
        assert posts[0] == "/api/validate-yaml" and posts[-1].endswith("/commit/spark")
    meta = validate_card(card)
    assert (meta["base_model"], meta["base_model_relation"], meta["license"]) == \
        ("org/tiny-fp8", "quantized", "mit")
    assert {"nvfp4", "compressed-tensors", "dgx-spark", "llama"} <= set(meta["tags"])
    results = meta["model-index"][0]["results"]
    got = {(r["task"]["name"], m["type"], m["value"]) for r in results for m in r["metrics"]}
    assert got == {("gsm8k", "exact_match,strict-match", 0.42), ("kl", "mean_kl", 0.01235),
                   ("kl", "top1_agreement", 0.971)}  # 4 significant digits
    assert "| 1x DGX Spark | 0.01 | 500000 | yes |" in card
    assert "| `model.layers.*.mlp.gate_proj` | NVFP4 (e2m1, e4m3 block scale / 16, f32 global scale) | 3 |" in card
    assert "| `model.embed_tokens` | kept as in the source | 1 |" in card
    assert ("Eval gate: **passed**. Scope: suites kl, gsm8k, passkey (KL 2047 tokens, GSM8K 1319 "
            "problems, passkey 75 prompts); every problem of each set; baseline `tiny-fp8`.") in card  # no local path
    assert "| kl | mean_kl | 0.01235 | 2047 tokens |" in card
    assert "| gsm8k | exact_match,strict-match | 0.42 | 1319 problems |" in card


def test_interrupted_upload_resends_only_what_is_missing(build, tmp_path):
    shards = sorted(build.glob("*.safetensors"))
    oids = {hashlib.sha256(p.read_bytes()).hexdigest() for p in shards}
    last = hashlib.sha256(shards[-1].read_bytes()).hexdigest()

    def kill_on(ev):  # SIGKILL when the last shard's PUT arrives, once the others are stored
        if ev.get("arrived") != last:
            return False
        deadline = time.monotonic() + 30
        while len(hub.lfs) < len(oids) - 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        return True

    with FakeHub(token=TOKEN) as hub:
        args = [str(build), "--repo", "me/tiny-nvfp4"]
        rc, _, err = _upload(args, hub, tmp_path, kill_on=kill_on)
        assert rc == -signal.SIGKILL, err
        first = set(hub.lfs)
        assert first == oids - {last}
        assert hub.repos["me/tiny-nvfp4"].files() == {}  # nothing committed
        n = len(hub.log)
        rc, _, err = _upload(args, hub, tmp_path)
        assert rc == 0, err
        resent = {e["stored"] for e in hub.log[n:] if e.get("stored")}
        assert resent == oids - first  # only the missing objects travel again
        files = hub.repos["me/tiny-nvfp4"].files()
        for p in shards:
            assert files[p.name].read() == p.read_bytes()


def test_fc33_invalid_card_stops_before_any_byte(build, tmp_path):
    with FakeHub(token=TOKEN) as hub:
        rc, _, err = _upload([str(build), "--repo", "me/x", "--license", "foo"], hub, tmp_path)
        assert rc == 1 and "license: 'foo' is not a Hub license identifier" in err
        assert hub.log == []  # checked locally: not one request
        # A card that passes our checks but not the Hub's: stopped after validate-yaml only.
        hub.reject_yaml = "\"base_model\" must reference a model on the Hub"
        rc, _, err = _upload([str(build), "--repo", "me/x"], hub, tmp_path)
        assert rc == 1 and "the Hub rejected the card's metadata" in err
        assert "must reference a model on the Hub" in err
        assert _sent(hub.log) == [] and "me/x" not in hub.repos


CARD = """---
base_model: {base}
base_model_relation: quantized
license: {license}
library_name: transformers
pipeline_tag: text-generation
tags: [nvfp4]
{extra}---
# card
"""


@pytest.mark.parametrize("base,license,extra,key,message", [
    ("org/src", "mit", "model-index: not correct\n", "model-index", "model-index: invalid"),
    ("null", "mit", "", "base_model", "base_model: missing"),
    ("org/src", "foo", "", "license", "license: 'foo' is not a Hub license identifier"),
    ("not a repo", "mit", "", "base_model", "base_model: 'not a repo' is not a Hub repo id"),
    ("org/src", "other", "", "license", "license: 'other' needs license_name and license_link"),
    ("org/src", "mit", "model-index:\n- name: x\n  results:\n  - task: {type: t}\n"
     "    dataset: {type: d, name: d}\n    metrics: [{type: acc, value: high}]\n",
     "model-index", "metric acc value 'high' is not a number"),
])
def test_fc33_card_metadata_checks(base, license, extra, key, message):
    with pytest.raises(CardError) as e:
        validate_card(CARD.format(base=base, license=license, extra=extra))
    assert e.value.key == key and message in str(e.value)


def test_fc33_valid_card_passes():
    meta = validate_card(CARD.format(base="zai-org/GLM-5.3-Flash", license="mit", extra=""))
    assert meta["base_model_relation"] == "quantized"


def test_gate_refusal_and_force(build, tmp_path, capsys):
    import shutil

    missing = tmp_path / "missing"
    shutil.copytree(build, missing)
    (missing / "eval" / "report.json").unlink()
    with pytest.raises(GateFailed, match=r"eval gate not run: no eval report \(eval/report.json\)\. "
                                         r"Run `quantize eval BUILD --baseline SRC` first, or pass --force"):
        upload_build(missing, "me/x")  # refused before any Hub call
    failed = tmp_path / "failed"
    shutil.copytree(build, failed)
    (failed / "eval" / "report.json").write_text(json.dumps(
        {**REPORT, "gate": {"passed": False, "release": False, "reason": "kl.mean_kl 0.31 (limit <= 0.05)"},
         "results": {}}))
    assert cli.main(["upload", str(failed), "--repo", "me/x"]) == 1
    err = capsys.readouterr().err
    assert (f"refusing to upload {failed}: eval gate failed: kl.mean_kl 0.31 (limit <= 0.05). The build "
            "failed its checks (see eval/report.md)") in err and "Run the eval" not in err
    assert cli.main(["upload", str(failed), "--repo", "me/x", "--dry-run", "--force"]) == 0
    printed = capsys.readouterr().out
    assert "> **Published with `--force`:** eval gate failed: kl.mean_kl 0.31 (limit <= 0.05)." in printed
    assert "Eval gate: **failed: kl.mean_kl 0.31 (limit <= 0.05)**." in printed
    assert "**eval gate" not in printed  # not "Eval gate: **eval gate failed"
    assert "README.md (rendered card, committed with the weights)" in printed


def test_partial_or_unfinished_gate_is_not_a_release(build, tmp_path, capsys):
    """FC: `--suite gsm8k --limit 3` passed its checks but is no release gate."""
    import shutil

    partial = tmp_path / "partial"
    shutil.copytree(build, partial)
    why = ["--limit 3: only the first 3 problems of each set were scored",
           "suite(s) kl, passkey not run (a release gate runs kl, gsm8k, passkey)"]
    scope = {**SCOPE, "suites": ["gsm8k"], "suites_done": ["gsm8k"], "limit": 3,
             "n": {"gsm8k": {"n": 3, "unit": "problems"}}, "release": False, "not_release": why}
    (partial / "eval" / "report.json").write_text(json.dumps(
        {**REPORT, "scope": scope, "gate": {"passed": True, "release": False, "reason": "all checks within thresholds"},
         "results": {"gsm8k": {"exact_match,strict-match": 0.0, "dataset": {"type": "gsm8k", "split": "test[:3]"}}}}))
    with pytest.raises(GateFailed) as e:
        upload_build(partial, "me/x")
    assert (f"eval gate passed on a partial run, not a release gate ({'; '.join(why)}). Re-run `quantize "
            "eval` as a release gate (every problem, no --limit; --baseline; the default suites), or pass "
            "--force") in str(e.value)
    card = upload_build(partial, "me/x", dry_run=True, force=True).card
    assert ("Eval gate: **passed on a partial run, not a release gate (--limit 3: only the first 3 problems "
            "of each set were scored; suite(s) kl, passkey not run (a release gate runs kl, gsm8k, passkey))**. "
            "Scope: suites gsm8k (GSM8K 3 problems); first 3 problems only (--limit); baseline "
            "`tiny-fp8`.") in card  # a published card names no local path
    assert "| gsm8k | exact_match,strict-match | 0.0 | 3 problems |" in card
    assert validate_card(card)["model-index"][0]["results"][0]["dataset"]["split"] == "test[:3]"
    cut = tmp_path / "cut"
    shutil.copytree(build, cut)
    reason = "incomplete: the evaluation did not finish (suites done: kl; not done: gsm8k, passkey)"
    (cut / "eval" / "report.json").write_text(json.dumps(
        {**REPORT, "complete": False, "gate": {"passed": False, "release": False, "reason": reason}}))
    with pytest.raises(GateFailed, match=r"eval gate incomplete: the evaluation did not finish \(suites done: "
                                         r"kl; not done: gsm8k, passkey\)\. Re-run `quantize eval` to the end"):
        upload_build(cut, "me/x")


def test_unfinished_build_is_refused(build, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(build, copy)
    (copy / "model-00001-of-00003.safetensors").write_bytes(b"x")
    with pytest.raises(OSError, match="model-00001-of-00003.safetensors in .* is missing or changed"):
        upload_build(copy, "me/x", dry_run=True)


def test_demo_build_card(demo_build):
    card = str(render_card(demo_build, "me/SmolLM2-135M-Instruct-NVFP4",
                           base_model="HuggingFaceTB/SmolLM2-135M-Instruct", license="apache-2.0",
                           forced=read_gate(None)[1]))
    assert "> **Published with `--force`:** eval gate not run: no eval report (eval/report.json)." in card
    meta = validate_card(card)
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert "| `model.layers.*.self_attn.q_proj` | NVFP4 (e2m1, e4m3 block scale / 16, f32 global scale) | 30 |" in card
    assert "| `model.embed_tokens` | kept as in the source | 1 |" in card


# ---- a flaky Hub (issue 17 kind 5) -------------------------------------------------------
def test_retry_waits_honour_retry_after_and_back_off():
    import httpx2

    from quantize.hub.retry import RetryTransport

    answers = [(429, {"Retry-After": "3"}), (503, {}), (503, {"Retry-After": "120"}), (200, {})]
    calls, slept = [], []

    def reply(request):
        calls.append(request.method)
        status, headers = answers[len(calls) - 1]
        return httpx2.Response(status, headers=headers)

    t = RetryTransport(httpx2.MockTransport(reply), sleep=slept.append)
    with httpx2.Client(transport=t) as c:
        assert c.post("http://hub/api/x", content=b"{}").status_code == 200
    assert slept == [3.0, 2.0, 60.0] and len(calls) == 4  # Retry-After, 2^1 backoff, cap 60
    calls.clear(), slept.clear()
    answers[:] = [(503, {})] * 7
    t = RetryTransport(httpx2.MockTransport(reply), sleep=slept.append)
    with httpx2.Client(transport=t) as c:
        assert c.get("http://hub/api/x").status_code == 503
    assert slept == [1.0, 2.0, 4.0, 8.0, 8.0] and len(calls) == 6  # then it gives up


def test_upload_through_429_and_503_commits_weights_with_card(build, tmp_path):
    with FakeHub(token=TOKEN) as hub:
        hub.flaky = [{"method": "POST", "path": r"/preupload/", "status": 503, "retry_after": "0", "times": 2},
                     {"method": "POST", "path": r"/commit/", "status": 429, "retry_after": "0", "times": 1},
                     {"method": "GET", "path": r"^/api/models/", "status": 503, "retry_after": "0", "times": 1}]
        rc, out, err = _upload([str(build), "--repo", "me/tiny-nvfp4"], hub, tmp_path)
        assert rc == 0, err
        assert [(f["method"], f["status"]) for f in hub.failed if f["path"].endswith("/main")] == \
            [("POST", 503), ("POST", 503), ("POST", 429)]
        assert "Hub: POST /api/models/me/tiny-nvfp4/commit/main: HTTP 429; retry 1/5 in 0s" in err
        files = hub.repos["me/tiny-nvfp4"].files()
        assert "README.md" in files and set(files) == {rel for rel, _ in
                                                        __import__("quantize.hub.upload", fromlist=["x"]).file_plan(build)} | {"README.md"}
        assert len([e for e in hub.log if "/commit/" in e["path"]]) == 1  # one commit: weights + card


def test_upload_gives_up_after_retries_and_commits_nothing(build, tmp_path):
    with FakeHub(token=TOKEN) as hub:
        hub.flaky = [{"method": "POST", "path": r"/commit/", "status": 503, "retry_after": "0", "times": 99}]
        rc, out, err = _upload([str(build), "--repo", "me/tiny-nvfp4"], hub, tmp_path)
        assert rc == 1, err
        assert "Hub: giving up on POST /api/models/me/tiny-nvfp4/commit/main after 5 retries (HTTP 503)" in err
        assert ("me/tiny-nvfp4@main on " + hub.url + ": Hub request failed (HTTP 503) after 5 "
                "retries with exponential backoff; gave up:") in err
        assert "Re-run the same command later: it resumes" in err
        assert len(hub.failed) == 6
        assert hub.repos["me/tiny-nvfp4"].files() == {}  # no weights without their card


def test_file_over_hub_limit_refused_before_any_byte(build, monkeypatch):
    from quantize.base.errors import OutputError
    from quantize.hub import upload

    monkeypatch.setattr(upload, "HUB_FILE_LIMIT", 2000)
    big = [rel for rel, n in upload.file_plan(build) if n > 2000]
    with pytest.raises(OutputError) as e:
        upload_build(build, "me/tiny-nvfp4", dry_run=False)
    assert str(e.value).startswith(f"{len(big)} file(s) exceed the Hub's per-file limit of 2e-06 GB: "
                                   f"{big[0]} (")
    assert str(e.value).endswith("; nothing was uploaded. Re-shard the build into smaller files "
                                 "(convert from a source with smaller shards)")


def test_changed_byte_or_stray_file_is_refused_before_any_byte(build, tmp_path):
    """A shard whose sha256 is not the manifest's (one byte flipped, same size) and a file the
    manifest does not list are refused by the dry run too, naming the file."""
    import shutil

    from quantize.base.errors import OutputError

    copy = shutil.copytree(build, tmp_path / "copy")
    shard = copy / "model-00002-of-00003.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(OutputError) as e:
        upload_build(copy, "me/x", dry_run=True)
    assert str(e.value) == (f"model-00002-of-00003.safetensors in {copy} is not the file the build wrote "
                            "(its sha256 differs from the manifest's); `quantize verify "
                            f"{copy}` shows what changed: rebuild, or restore the file (nothing was uploaded)")
    shard.write_bytes((build / shard.name).read_bytes())
    (copy / "calibration.json").write_text("{}")
    with pytest.raises(OutputError) as e:
        upload_build(copy, "me/x", dry_run=True)
    assert str(e.value) == (f"{copy} holds 1 file(s) its manifest does not list (calibration.json): an "
                            "upload sends only the build's own files; move them out of the folder "
                            "(nothing was uploaded)")
    (copy / "calibration.json").unlink()
    assert upload_build(copy, "me/x", dry_run=True).files == upload_build(build, "me/x", dry_run=True).files


@pytest.mark.parametrize("repo", ["not a repo", "tiny-nvfp4", "a/b/c"])
def test_a_repo_id_that_is_not_org_name_is_refused(build, repo):
    from quantize.base.errors import OutputError

    with pytest.raises(OutputError, match=rf"^--repo '{repo}' is not a Hub repo id: "):
        upload_build(build, repo, dry_run=True)
