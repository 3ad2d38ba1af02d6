"""The first hour of a new user (issue 19), the defects a fresh-eyes run found last: what each
command prints (one line, no traceback) and its exit code. The commands run in-process through
``quantize.cli.main``, except where a signal has to reach worker processes."""

import json
import shutil

import pytest

from tests.test_new_user import refused_unless_accepted, run


def _build(src, out, capsys, *extra):
    """``quantize nvfp4`` of a tiny source on the CPU; the build must be complete."""
    assert run(capsys, "nvfp4", "--src", src, "--out", out, "--device", "cpu", "--quiet", *extra)[0] == 0
    return out


# ---- 1: verify finds the source where eval does (the demo cache too) -------------------------

def test_verify_finds_a_source_in_the_demo_cache(tiny_fp8_llama, tmp_path, capsys, monkeypatch):
    """A build of a source that lives in the demo cache ($SPARK_QUANT_CACHE), evaluated and
    verified from another folder: eval's default baseline and verify's source are the same
    folder, found by quantize.data.demo.find_recorded_source."""
    import eval.suite

    cache = tmp_path / "cache"
    src = shutil.copytree(tiny_fp8_llama, cache / "tiny-demo")
    build = _build(src, tmp_path / "builds" / "b", capsys)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    monkeypatch.setenv("SPARK_QUANT_CACHE", str(cache))
    rc, stdout, err = run(capsys, "verify", build)
    assert (rc, err) == (0, "")
    assert stdout.splitlines()[2].startswith(f"  samples: 20 tensors read back, 20 compared with {src.resolve()} (worst")
    got = []
    monkeypatch.setattr(eval.suite, "run_eval", lambda b, baseline, opts, baseline_endpoint=None: got.append(
        baseline) or {"gate": {"passed": True, "release": True, "checks": []}, "scope": {}})
    assert run(capsys, "eval", build, "--suite", "kl")[0] == 0
    assert got == [str(src.resolve())]
    # not in the cache (nor next to the build, nor here): said, and compared with nothing
    monkeypatch.setenv("SPARK_QUANT_CACHE", str(tmp_path / "empty"))
    rc, stdout, err = run(capsys, "verify", build)
    assert (rc, stdout.splitlines()[2]) == (0, "  samples: 20 tensors read back, source not compared")
    assert (f"info: [source] source tiny-demo (the manifest's) is not next to {build}, in the working "
            "directory, in the demo cache or the Hugging Face cache: samples checked for finite values "
            "only (--src SRC compares them with it)") in stdout.splitlines()


# ---- 2: a --dataset that looks like a file path and is not there is a missing file ------------

@pytest.mark.parametrize("dataset", ["/missing.jsonl", "calib/set.parquet", "notes.txt", "data.json",
                                     "./calib", "a/b/c", "~/calib"])
def test_calibrate_missing_dataset_file_is_named(dataset, tiny_fp8_llama, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, stdout, err = run(capsys, "calibrate", "--src", tiny_fp8_llama, "--dataset", dataset,
                          "--samples", "2", "--seq-len", "8", "--out", tmp_path / "cal", "--quiet")
    assert (rc, stdout, err) == (1, "", f"error: --dataset {dataset}: no such file or folder (a local "
                                        "calibration set is a .jsonl, .jsonl.gz, .json, .parquet, .txt "
                                        "file or a folder of them)\n")
    assert not (tmp_path / "cal").exists()


def test_hub_dataset_names_are_not_paths(tmp_path, monkeypatch):
    from calibrate.data import looks_like_path

    monkeypatch.chdir(tmp_path)
    assert [looks_like_path(d) for d in ("HuggingFaceH4/ultrachat_200k", "org/name:cfg@train", "wikitext",
                                         "gsm8k")] == [False] * 4
    (tmp_path / "org").mkdir()  # a folder of that name here: org/name is a path under it
    assert looks_like_path("org/name") is True


# ---- 3: Ctrl-C of a --workers 2 conversion prints the resume hint, as one process does -------

CTRL_C_AFTER_FIRST_SHARD = '''
import os
import signal
import sys

if os.environ.get("SPARK_QUANT_TEST_CTRL_C"):
    import formats.manifest as manifest

    _mark = manifest.Ledger.mark

    def mark(self, *args, **kwargs):
        digest = _mark(self, *args, **kwargs)
        try:  # one Ctrl-C, from the first process to finish a shard
            os.close(os.open(os.environ["SPARK_QUANT_TEST_CTRL_C"], os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return digest
        os.killpg(0, signal.SIGINT)  # what Ctrl-C does: SIGINT to the whole foreground group
        # this writer thread writes nothing more until its process stops it (Consumer.close),
        # so the build cannot finish before the interrupt is handled
        frame = sys._getframe(1)
        while frame.f_code.co_name != "_work":
            frame = frame.f_back
        frame.f_locals["self"].stop.wait(300)
        return digest

    manifest.Ledger.mark = mark
'''


@pytest.mark.parametrize("workers", ["1", "2"])
def test_ctrl_c_prints_the_resume_hint(workers, glm5_next_src, tmp_path):
    """Ctrl-C once an output shard is finished (a ``sitecustomize`` on PYTHONPATH sends SIGINT
    to the process group from the ledger's mark, in whichever process marks first: the one
    process, or a worker). The parent prints one line naming --resume and the out folder, and
    exits 130; no worker prints anything, and the build has no manifest."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(CTRL_C_AFTER_FIRST_SHARD)
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "quantize.cli", "nvfp4", "--src", str(glm5_next_src), "--out", str(out),
            "--device", "cpu", "--kernel", "reference", "--quiet", "--workers", workers]
    path = os.pathsep.join(filter(None, [str(hook), str(repo), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path, SPARK_QUANT_TEST_CTRL_C=str(tmp_path / "pressed"))
    p = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       start_new_session=True)
    assert p.returncode == 130, p.stderr
    assert re.fullmatch(rf"interrupted: [123] output shard\(s\) are finished in {re.escape(str(out))}; fix the "
                        r"cause and rerun the same command with --resume to continue\n", p.stderr), p.stderr
    assert not (out / "spark_quant_manifest.json").exists() and list(out.glob(".spark-quant-progress*"))


# ---- 4: check says what it read: the converter's counts, or (--full) every scale tensor ------

def test_check_says_what_it_read(tiny_fp8_llama, tmp_path, capsys):
    build = _build(tiny_fp8_llama, tmp_path / "b", capsys)
    verdict = (f"{build}: 0 error(s), 0 warning(s) for vllm TP=1 (engine and TP as spark_quant_manifest.json "
               "records; --engine / --tp check another)\n")
    assert run(capsys, "check", build) == (0, verdict, (
        "read: the configs, every shard header, the one-element scales; the scale rule's counts of 3 "
        "shard(s) as the converter recorded them (.spark-quant-stats.json; --full reads every scale "
        "tensor)\n"))
    assert run(capsys, "check", build, "--full") == (0, verdict, (
        "read: the configs, every shard header and every scale tensor (28 scale tensor(s) of 3 shard(s), "
        "--full); weights are not read (`quantize verify` samples them)\n"))
    (build / ".spark-quant-stats.json").unlink()  # no counts: every scale tensor is read, and said
    assert run(capsys, "check", build)[::2] == (0, (
        "read: the configs, every shard header and every scale tensor (28 scale tensor(s) of 3 shard(s): "
        "no converter counts in .spark-quant-stats.json)\n"))


# ---- 5: pre-flight of an --out that holds a finished build says it is complete ---------------

def test_preflight_of_a_finished_build_says_complete(tiny_fp8_llama, tmp_path, capsys):
    from formats.manifest import already_complete

    build = _build(tiny_fp8_llama, tmp_path / "b", capsys)
    complete = (f"{build} is already complete (it has its spark_quant_manifest.json): nothing to resume, "
                f"the build is kept as it is; `quantize verify {build}` checks it, and a new build needs "
                "an empty --out")
    assert already_complete(build) == complete  # the words nvfp4 --resume prints (test_new_user.py)
    rc, stdout, err = run(capsys, "preflight", tiny_fp8_llama, "--out", build)
    assert (rc, stdout.splitlines()[1:], err) == (
        1, [f"error: [output] output folder {build} is not empty: {complete}"], "")
    rc, stdout, err = run(capsys, "preflight", tiny_fp8_llama, "--out", build, "--resume")
    assert (rc, stdout.splitlines()[1:], err) == (0, [f"info: [output] {complete}"], "")
    rc, stdout, err = run(capsys, "nvfp4", "--src", tiny_fp8_llama, "--out", build, "--device", "cpu", "--quiet")
    assert (rc, stdout, err) == (1, "", f"error: 1 problem(s) in src:\nerror: [output] output folder {build} "
                                        f"is not empty: {complete}\n")


# ---- 6: upload --dry-run needs no --force; it says what --force would be needed for ----------

def test_upload_dry_run_without_force_says_it_would_refuse(tiny_fp8_llama, tmp_path, capsys, monkeypatch):
    import huggingface_hub

    build = _build(tiny_fp8_llama, tmp_path / "b", capsys)
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda *a, **k: pytest.fail("a dry run called the Hub"))
    card = ["--base-model", "org/tiny", "--license", "mit"]
    rc, stdout, err = run(capsys, "upload", build, "--repo", "me/tiny-nvfp4", "--dry-run", *card)
    assert (rc, err) == (0, "")
    lines = stdout.splitlines()
    assert lines[-1] == ("  without --force: would refuse: eval gate not run: no eval report (eval/report.json). "
                         "Run `quantize eval BUILD --baseline SRC` first, or pass --force to publish anyway "
                         "(the card will say so)")
    assert ("> **Published with `--force`:** eval gate not run: no eval report (eval/report.json). Its quality "
            "has not been confirmed by a release eval gate.") in lines  # the card --force would publish
    assert "README.md (rendered card, committed with the weights)" in stdout
    # with --force the same plan, the refusal replaced by what --force does
    rc, stdout, err = run(capsys, "upload", build, "--repo", "me/tiny-nvfp4", "--dry-run", "--force", *card)
    assert (rc, stdout.splitlines()[-1], err) == (0, "  --force: not run: no eval report (eval/report.json)", "")
    # a real upload is still refused without --force, before any Hub call
    rc, stdout, err = run(capsys, "upload", build, "--repo", "me/tiny-nvfp4", *card)
    assert (rc, stdout, err) == (1, "", f"error: refusing to upload {build}: eval gate not run: no eval report "
                                        "(eval/report.json). Run `quantize eval BUILD --baseline SRC` first, or "
                                        "pass --force to publish anyway (the card will say so)\n")


# ---- 7: with --limit a check with too few samples is not gated; --limit bounds the grid ------

def _grid(mean, lengths=(1024,), depths=(0, 100), trials=1):
    """A passkey grid summary (eval.passkey.grid_summary) whose first prompts are missed until
    ``mean`` of them are right."""
    from eval.passkey import grid_summary

    cells = [(L, d, k) for L in lengths for d in depths for k in range(trials)]
    wrong = round(len(cells) * (1 - mean))
    return {**grid_summary([{"length": L, "depth": d, "trial": k, "tokens": L, "correct": int(i >= wrong)}
                            for i, (L, d, k) in enumerate(cells)]), "heatmap": "passkey.png"}


def _paired(base, test, n, se=0.0):
    return {"n": n, "base_acc": base, "test_acc": test, "delta": test - base, "se": se}


def test_limit_does_not_gate_checks_it_has_too_few_samples_for():
    from eval.gate import gate_checks, gate_passed, load_thresholds

    t = load_thresholds()
    # --limit 2: 2 passkey prompts (one miss = 0.5 > 0.10), 2 GSM8K problems (0.5 > 0.02)
    suites = {"passkey": {"baseline": _grid(1.0), "build": _grid(0.5)},
              "gsm8k": {"paired": {"flexible-extract": _paired(1.0, 0.0, 2), "strict-match": _paired(1.0, 0.0, 2)}}}
    checks = {c["name"]: c for c in gate_checks(suites, t, limit=2)}
    assert {n: (c["passed"], c["severity"], c.get("not_gated")) for n, c in checks.items()} == {
        "passkey.mean.drop": (False, "not gated", "--limit 2: too few samples (2 prompts: one moves the "
                                                  "value by 0.5, more than its bound 0.1)"),
        "gsm8k.flexible-extract.drop": (False, "not gated", "--limit 2: too few samples (2 problems: one "
                                                            "moves the value by 0.5, more than its bound 0.02)"),
        "gsm8k.strict-match.drop": (False, "warn", None)}
    assert gate_passed(list(checks.values()))
    # the same results without --limit are gated, and fail
    assert not gate_passed(gate_checks(suites, t))
    # enough samples under --limit to decide (10 prompts: one moves it by 0.1): gated, and it fails
    big = {"passkey": {"baseline": _grid(1.0, depths=(0, 25, 50, 75, 100), trials=2),
                       "build": _grid(0.7, depths=(0, 25, 50, 75, 100), trials=2)}}
    (c,) = gate_checks(big, t, limit=5)
    assert (c["name"], c["severity"], "not_gated" in c, gate_passed([c])) == ("passkey.mean.drop", "fail", False, False)


def test_eval_limit_exit_code_counts_only_gated_checks(tmp_path, capsys, monkeypatch):
    """The gate of a --limit 2 run (eval.suite._Run.finish: the report eval writes) whose passkey
    lost one of its 2 prompts: passkey is not gated, so the run passes, and says why in one line
    per check; a degenerate-output check it can decide still fails it."""
    from types import SimpleNamespace

    import eval.suite
    from eval.gate import load_thresholds
    from eval.suite import EvalOptions, _Run

    build = tmp_path / "b"
    build.mkdir()
    (build / "config.json").write_text("{}")

    def finish(limit, results, completions=()):
        out = tmp_path / f"r{len(list(tmp_path.iterdir()))}"
        out.mkdir()
        run = _Run(EvalOptions(suites=("passkey",), limit=limit), build, build, None, load_thresholds(),
                   [], [1024], None, False, None, out, out / "tasks", "cpu",
                   {"build": SimpleNamespace(endpoint_model=None)}, {}, done=["passkey"], results=results,
                   texts_for_degenerate={"build": [(f"p{i}", c) for i, c in enumerate(completions)]})
        return run.finish(True)

    lost_one = {"passkey": {"settings": {}, "baseline": _grid(1.0), "build": _grid(0.5)}}
    report = finish(2, lost_one)
    monkeypatch.setattr(eval.suite, "run_eval", lambda *a, **k: report)
    rc, stdout, err = run(capsys, "eval", build, "--suite", "passkey", "--limit", "2")
    assert (rc, err) == (0, "passkey.mean.drop: 0.5 (limit <= 0.1) not gated (--limit 2: too few samples "
                            "(2 prompts: one moves the value by 0.5, more than its bound 0.1))\n")
    assert stdout.splitlines()[-1].startswith("gate: PASSED (not a release gate: --limit 2: ")
    assert not finish(None, lost_one)["gate"]["passed"]  # no --limit: gated
    report = finish(2, lost_one, ["the " * 20] * 4)  # 4 completions, all repeats: decided, and failed
    rc, stdout, err = run(capsys, "eval", build, "--suite", "passkey", "--limit", "2")
    assert (rc, err.splitlines()[1]) == (1, "FAIL degenerate.rate: 1 (limit <= 0.25, off by 0.75) 4 of 4 "
                                            "completions degenerate (repeat 4)")


def test_limit_bounds_the_passkey_depths():
    from eval.suite import EvalOptions, _passkey_depths

    assert _passkey_depths(EvalOptions()) == [0, 25, 50, 75, 100]
    assert [_passkey_depths(EvalOptions(limit=n)) for n in (1, 2, 3, 4, 5, 50)] == [
        [50], [0, 100], [0, 50, 100], [0, 25, 75, 100], [0, 25, 50, 75, 100], [0, 25, 50, 75, 100]]
    assert _passkey_depths(EvalOptions(limit=2, passkey_depths=(10, 20, 30))) == [10, 20, 30]


# ---- 8: nvfp4 without --out says where it writes, first -------------------------------------

def test_nvfp4_without_out_says_where_it_writes(tiny_fp8_llama, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, stdout, err = run(capsys, "nvfp4", "--src", tiny_fp8_llama, "--device", "cpu", "--quiet")
    assert (rc, stdout.splitlines()[0], err) == (0, "writing to ./src-NVFP4 (no --out given)", "")
    assert (tmp_path / "src-NVFP4" / "spark_quant_manifest.json").is_file()
    rc, stdout, err = run(capsys, "nvfp4", "--src", tiny_fp8_llama, "--out", tmp_path / "o", "--device", "cpu",
                          "--quiet")
    assert rc == 0 and "no --out given" not in stdout


# ---- 9: a model's config.json without model_type is refused as an unknown one is --------------

MISSING = ("config.json has no model_type key (at the top level or in text_config), so the architecture map "
           "cannot tell the model (known: llama, mistral, qwen2, qwen3, gemma3_text, mixtral, qwen2_moe, "
           "qwen3_moe, qwen3_next, deepseek_v2, deepseek_v3, deepseek_v32, glm_moe_dsa, glm5_next, "
           "glm5_next_text, kimi_linear): which Linears stay high precision would be guessed from tensor "
           "names; set model_type to the architecture the checkpoint is, or pass --allow-unknown-arch to "
           "plan it from tensor names alone (embedding, lm_head, router, MTP eh_proj and vision Linears "
           "stay high precision (found by name); every other 2-D Linear weight follows the recipe; no "
           "model-specific rule applies (DSA indexer, engine model rules))")


@pytest.mark.parametrize("cmd", ["nvfp4", "preflight", "recipe show"])
def test_missing_model_type_is_refused_unless_accepted(cmd, tiny_fp8_llama, tmp_path, capsys):
    cfg = json.loads((tiny_fp8_llama / "config.json").read_text())
    del cfg["model_type"]
    (tiny_fp8_llama / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    stdout = refused_unless_accepted(capsys, cmd, tiny_fp8_llama, out, MISSING)
    assert any(line.endswith("config.json has no model_type; planned from tensor names alone "
                             "(--allow-unknown-arch): embedding, lm_head, router, MTP eh_proj and vision "
                             "Linears stay high precision (found by name); every other 2-D Linear weight "
                             "follows the recipe; no model-specific rule applies (DSA indexer, engine model "
                             "rules). High precision: 1 embedding; quantized: nvfp4: 8 attention, 6 "
                             "dense_mlp; other Linear weights left unquantized by the recipe or alignment: 0")
               for line in stdout.splitlines())
    if cmd == "nvfp4":
        rc, stdout, err = run(capsys, "check", out)
        assert (rc, stdout.splitlines()[0]) == (0, "WARNING [config] config.json: config.json has no model_type: "
                                                   "checked from tensor names alone (embedding, lm_head, router, "
                                                   "MTP eh_proj and vision Linears stay high precision (found by "
                                                   "name); every other 2-D Linear weight follows the recipe; no "
                                                   "model-specific rule applies (DSA indexer, engine model rules))")


def test_a_config_that_describes_no_model_claims_no_architecture():
    from quantize import archs

    assert [archs.missing_model_type(c) for c in (
        {}, {"quantization_config": {}}, {"n_routed_experts": 8}, {"hidden_size": 64},
        {"architectures": ["X"]}, {"text_config": {"num_hidden_layers": 2}},
        {"text_config": {"num_hidden_layers": 2, "model_type": "llama"}}, {"model_type": "llama", "hidden_size": 8})] == [
        False, False, False, True, True, True, False, False]


# ---- a config that pre-flight refuses is refused as cleanly by plan and calibrate -----------

@pytest.mark.parametrize("edit, message", [
    ({"quantization_config": "fp8"}, "error: config.json quantization_config must be an object"),
    ({"num_key_value_heads": "3"},
     "error: config.json num_key_value_heads is '3': it must be a non-negative integer"),
    (None, "error: config.json is not valid JSON: Expecting value: line 1 column 1 (char 0)"),
])
@pytest.mark.parametrize("cmd", ["plan", "calibrate"])
def test_plan_and_calibrate_refuse_a_bad_config_naming_it(cmd, edit, message, tiny_fp8_llama, tmp_path, capsys):
    src = shutil.copytree(tiny_fp8_llama, tmp_path / "bad")
    if edit is None:
        (src / "config.json").write_text("")
    else:
        (src / "config.json").write_text(json.dumps({**json.loads((src / "config.json").read_text()), **edit}))
    args = (["plan", "--src", src] if cmd == "plan" else
            ["calibrate", "--src", src, "--dataset", "random", "--samples", "1", "--seq-len", "8",
             "--out", tmp_path / "stats"])
    rc, stdout, err = run(capsys, *args)
    assert (rc, err.strip().splitlines()) == (1, [message])
    assert not (tmp_path / "stats").exists()


def test_calibrate_refuses_a_config_without_model_type(tiny_fp8_llama, tmp_path, capsys):
    src = shutil.copytree(tiny_fp8_llama, tmp_path / "bad")
    cfg = json.loads((src / "config.json").read_text())
    del cfg["model_type"]
    (src / "config.json").write_text(json.dumps(cfg))
    rc, stdout, err = run(capsys, "calibrate", "--src", src, "--dataset", "random", "--samples", "1",
                          "--seq-len", "8", "--out", tmp_path / "stats")
    assert (rc, err.strip()) == (1, f"error: {src / 'config.json'} has no model_type: calibration builds "
                                    "the model with transformers' classes, which are chosen by it")


def test_manifest_records_the_scale_method_that_ran(tiny_fp8_llama, tmp_path, capsys):
    """--scales auto (the default) on the CPU runs round-to-nearest and the manifest says so;
    an explicit method is recorded as given."""
    auto = _build(tiny_fp8_llama, tmp_path / "auto", capsys)
    mse = _build(tiny_fp8_llama, tmp_path / "mse", capsys, "--scales", "mse")
    opts = [json.loads((b / "spark_quant_manifest.json").read_text())["options"] for b in (auto, mse)]
    assert [o["scales"] for o in opts] == ["rtn", "mse"]
    assert "calibration_sha256" not in opts[0] and "kv_cache" not in opts[0]


def test_resume_into_a_finished_build_of_other_options_names_them(tiny_fp8_llama, tmp_path, capsys):
    build = _build(tiny_fp8_llama, tmp_path / "b", capsys)
    before = {p.name: p.read_bytes() for p in build.iterdir() if p.is_file()}
    rc, stdout, err = run(capsys, "nvfp4", "--src", tiny_fp8_llama, "--out", build, "--device", "cpu",
                          "--resume", "--format", "modelopt", "--scales", "mse")
    assert rc == 1 and stdout == ""
    assert err.strip() == (f"error: {build} is a finished build made with other options: --format modelopt "
                           "(the build has compressed-tensors); --scales mse (the build has rtn). --resume "
                           "continues an unfinished build with the same options; a new build needs an "
                           "empty --out")
    assert {p.name: p.read_bytes() for p in build.iterdir() if p.is_file()} == before  # kept as it was
    rc, stdout, err = run(capsys, "nvfp4", "--src", tiny_fp8_llama, "--out", build, "--device", "cpu", "--resume")
    assert rc == 0 and "is already complete" in stdout


def test_gptq_sample_options_without_method_gptq_are_refused(tiny_fp8_llama, tmp_path, capsys):
    rc, stdout, err = run(capsys, "nvfp4", "--src", tiny_fp8_llama, "--out", tmp_path / "b", "--samples", "3")
    assert (rc, err.strip()) == (1, "error: --dataset, --samples, --seq-len, --damp and --act-order are "
                                    "options of --method gptq")
    assert not (tmp_path / "b").exists()
