"""The first hour of a new user (issue 19): what each refused or misused command prints, and
its exit code. Every test runs the ``quantize`` command (``quantize.cli.main``)."""

import pytest

from formats.engines import mixed_moe_schemes
from quantize.cli import main


def run(capsys, *args) -> tuple[int, str, str]:
    rc = main([str(a) for a in args])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


# ---- item 4: the routed-expert scheme rule of `quantize check`, applied to the plan ----------

MOE_TP3 = (
    "error: recipe spark-mixed at TP=3 mixes ['nvfp4', 'unquantized'] in the routed experts of "
    "model.language_model.layers.1.mlp.experts (and 3 more MoE layer(s)): "
    "model.language_model.layers.1.mlp.experts.0.down_proj.weight -> bf16 (K=128 does not split "
    "over TP=3); engines load one scheme per MoE layer, so this build would fail its final "
    "check: choose a --tp that every expert projection splits over, or a recipe that gives "
    "these experts one target\n")


def test_mixed_moe_schemes_rule():
    assert mixed_moe_schemes({
        "m.layers.1.mlp.experts.0.gate_proj": "nvfp4",
        "m.layers.1.mlp.experts.0.down_proj": "unquantized",
        "m.layers.2.mlp.experts.0.gate_proj": "nvfp4",
        "m.layers.2.mlp.experts.1.down_proj": "nvfp4",
        "m.layers.2.mlp.shared_experts.down_proj": "unquantized",
    }) == {"m.layers.1.mlp.experts": ["nvfp4", "unquantized"]}


@pytest.mark.parametrize("cmd", ["nvfp4", "preflight", "recipe show"])
def test_tp3_mixed_experts_refused_before_any_byte(cmd, glm5_next_src, tmp_path, capsys):
    out = tmp_path / "out"
    args = {"nvfp4": ["nvfp4", "--src", glm5_next_src, "--out", out, "--device", "cpu", "--quiet"],
            "preflight": ["preflight", glm5_next_src, "--out", out],
            "recipe show": ["recipe", "show", "--src", glm5_next_src, "--summary"]}[cmd]
    rc, stdout, err = run(capsys, *args, "--tp", "3")
    assert (rc, stdout, err) == (1, "", MOE_TP3)
    assert not out.exists()


# ---- item 6: inputs that are refused, each with one line naming what is wrong ---------------

def test_workers_capped_by_cores_and_shards(glm5_next_src, tmp_path, capsys, monkeypatch):
    import os

    out = tmp_path / "out"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    rc, stdout, err = run(capsys, "nvfp4", "--src", glm5_next_src, "--out", out, "--workers", "1000")
    assert (rc, err) == (1, "error: --workers 1000: this machine has 2 CPU core(s); use at most 2 "
                            "(each worker is one converting process)\n")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    rc, stdout, err = run(capsys, "nvfp4", "--src", glm5_next_src, "--out", out, "--workers", "4")
    assert (rc, err) == (1, f"error: --workers 4: {glm5_next_src} has 3 shard(s); use at most 3 "
                            "(workers divide the shards among them)\n")
    assert not out.exists()


def test_descriptor_is_not_a_conversion_source(tmp_path, capsys):
    from quantize.data.fixtures import write_release_descriptor

    d = write_release_descriptor(tmp_path / "glm53.descriptor.json", "glm5_next")
    rc, stdout, err = run(capsys, "nvfp4", "--src", d, "--out", tmp_path / "out")
    assert (rc, err) == (1, f"error: --src {d} is a header-only descriptor: it has no weights to "
                            "convert; use it with `quantize plan`, `quantize recipe show` or "
                            "`quantize preflight`, and convert the folder that holds the shards\n")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, message", [
    (["plan", "--src", "demo", "--node-mem-gib", "-100"], "argument --node-mem-gib: must be > 0, got -100"),
    (["plan", "--src", "demo", "--mem-util", "1.5"], "argument --mem-util: must be > 0 and <= 1, got 1.5"),
    (["plan", "--src", "demo", "--max-model-len", "0"], "argument --max-model-len: must be >= 1, got 0"),
    (["plan", "--src", "demo", "--tp", "0"], "argument --tp: must be >= 1, got 0"),
    (["plan", "--src", "demo", "--graphs-gib", "-1"], "argument --graphs-gib: must be >= 0, got -1"),
    (["nvfp4", "--src", "demo", "--tp", "0"], "argument --tp: must be >= 1, got 0"),
    (["nvfp4", "--src", "demo", "--workers", "0"], "argument --workers: must be >= 1, got 0"),
    (["check", "x", "--tp", "-2"], "argument --tp: must be >= 1, got -2"),
    (["verify", "x", "--rows", "-1"], "argument --rows: must be >= 1, got -1"),
    (["recipe", "show", "--src", "demo", "--tp", "0"], "argument --tp: must be >= 1, got 0"),
])
def test_numbers_out_of_range_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    sub = " ".join(argv[:2]) if argv[0] == "recipe" else argv[0]
    assert (e.value.code, err.splitlines()[-1]) == (2, f"quantize {sub}: error: {message}")


def test_plan_that_does_not_fit_exits_1(tmp_path, capsys):
    from quantize.data.fixtures import write_release_descriptor

    d = write_release_descriptor(tmp_path / "glm53.descriptor.json", "glm5_next")
    # spark-mixed: a weight-only glm5_next plan is refused for vLLM (it builds MLA / indexer /
    # KDA unquantized), so the one-node plan of the default recipe is the one that does not fit
    rc, stdout, err = run(capsys, "plan", "--src", d, "--nodes", "1", "--recipe", "spark-mixed")
    assert rc == 1 and "max-model-len 1,048,576: does NOT fit, margin -77.30 GiB per rank" in stdout


@pytest.mark.parametrize("cmd", ["verify", "check"])
def test_missing_build_folder(cmd, tmp_path, capsys):
    assert run(capsys, cmd, tmp_path / "nope") == (1, "", f"error: {tmp_path / 'nope'}: no such build folder\n")
    (tmp_path / "f.txt").write_text("x")
    assert run(capsys, cmd, tmp_path / "f.txt") == (
        1, "", f"error: {tmp_path / 'f.txt'}: not a folder (give the build folder)\n")


def test_recipe_errors_name_the_file(glm5_next_src, tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('[[rule]]\nmatch = "role:nosuch"\ntarget = "nvfp4"\n')
    rc, stdout, err = run(capsys, "recipe", "show", "--src", glm5_next_src, "--recipe", bad)
    assert (rc, err.split(" (valid: ")[0]) == (1, f"error: recipe {bad}: rule 0: rule 'role:nosuch': unknown role")
    bad.write_text('[[rule]]\nmatch = "re:(("\ntarget = "nvfp4"\n')
    rc, stdout, err = run(capsys, "recipe", "show", "--src", glm5_next_src, "--recipe", bad)
    assert (rc, err) == (1, f"error: recipe {bad}: rule 0: recipe rule match 're:((' is not a valid "
                            "regex (missing ), unterminated subpattern at position 1)\n")
    bad.write_text('rule = "nvfp4"\n')
    rc, stdout, err = run(capsys, "recipe", "show", "--src", glm5_next_src, "--recipe", bad)
    assert (rc, err) == (1, f"error: recipe {bad}: 'rule' must be an array of tables ([[rule]] "
                            "with match and target)\n")
    rc, stdout, err = run(capsys, "recipe", "show", "--src", glm5_next_src, "--recipe", tmp_path / "no.toml")
    assert (rc, err) == (1, f"error: recipe file {tmp_path / 'no.toml'}: no such file\n")


def test_closed_pipe_is_quiet(glm5_next_src):
    """`quantize recipe show ... | head`: the reader is gone before anything is written (its
    end of the pipe is closed at once), so the first write fails; no 'Broken pipe' error."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])))
    p = subprocess.Popen([sys.executable, "-m", "quantize.cli", "recipe", "show", "--src", str(glm5_next_src)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=repo, env=env)
    p.stdout.close()
    err = p.stderr.read().decode()
    p.stderr.close()
    assert (p.wait(), err) == (141, "")


# ---- item 2: a missing optional package is one line naming its extra ------------------------

@pytest.mark.parametrize("argv, module, extra", [
    (["eval", "BUILD", "--suite", "kl,passkey"], "lm_eval", "eval"),
    (["eval", "BUILD", "--suite", "kl"], "transformers", "demo"),
    (["eval", "BUILD", "--suite", "passkey"], "matplotlib", "eval"),
    (["calibrate", "--src", "SRC", "--dataset", "arc"], "pyarrow", "calibrate"),
    (["plan", "--src", "demo"], "gguf", "demo"),
])
def test_missing_extra_is_named_before_any_work(argv, module, extra, tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, module, None)  # find_spec -> None, import -> ModuleNotFoundError
    argv = [str(tmp_path / "b") if a in ("BUILD", "SRC") else a for a in argv]
    (tmp_path / "b").mkdir()
    what = "--src demo" if "demo" in argv else f"quantize {argv[0]}"
    assert run(capsys, *argv) == (1, "", f"error: {what} needs {module}, which is not installed: "
                                         f"pip install 'spark-quant[{extra}]'\n")
    assert list((tmp_path / "b").iterdir()) == []  # no partial report


def test_module_missing_mid_command_names_its_extra(capsys, monkeypatch):
    """The safety net in main: an import of an optional package that fails deep inside a command
    (here: lm_eval's task folder looked up by eval.harness) prints one line, not a traceback."""
    import sys

    import quantize.cli as cli

    def recipe_show(args):
        from eval.harness import _stock_task_yaml

        return _stock_task_yaml("gsm8k/gsm8k.yaml")

    monkeypatch.setitem(sys.modules, "lm_eval", None)
    monkeypatch.setattr(cli, "_cmd_recipe_show", recipe_show)
    assert run(capsys, "recipe", "show", "--src", "x") == (
        1, "", "error: quantize recipe needs lm_eval, which is not installed: pip install 'spark-quant[eval]'\n")


def test_calibrate_unknown_dataset_is_one_line(demo_src, tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)
    rc, stdout, err = run(capsys, "calibrate", "--src", demo_src, "--dataset", "nosuch",
                          "--samples", "2", "--seq-len", "8", "--out", tmp_path / "cal", "--quiet")
    assert (rc, err) == (1, "error: --dataset 'nosuch' is not built in (gsm8k, arc, essays, random) "
                            "nor a local path, and the `datasets` package is not installed\n")


# ---- item 3: a complete demo build exits 0; the showcase says in one line where it cannot run

@pytest.mark.parametrize("extra, what", [
    (["--format", "modelopt"], "modelopt build (the showcase loads compressed-tensors builds in transformers)"),
    (["--scheme", "w4a4", "--calibration", "STATS"],
     "w4a4 build (the showcase compares weight-only builds with their dequantized reference)"),
])
def test_demo_showcase_says_where_it_cannot_run(extra, what, tmp_path, capsys, monkeypatch):
    """The conversion itself is stubbed (its exit and output are other tests'); this is the
    CLI's decision after a finished build."""
    from types import SimpleNamespace

    import eval.showcase
    import quantize.convert.pipeline as pipeline
    import quantize.data.demo as demo

    out = tmp_path / "out"
    monkeypatch.setattr(demo, "build_demo", lambda: tmp_path / "demo-src")
    monkeypatch.setattr(pipeline, "convert", lambda *a, **k: SimpleNamespace(render=lambda: "converted"))
    monkeypatch.setattr(eval.showcase, "showcase", lambda *a, **k: pytest.fail("showcase ran"))
    rc, stdout, err = run(capsys, "nvfp4", "--src", "demo", "--out", out, *extra)
    assert (rc, stdout, err) == (0, f"converted\nshowcase: not run for this {what}; the build is "
                                    f"complete (quantize check {out})\n", "")


# ---- item 7: --resume on a finished build keeps it -------------------------------------------

def test_resume_on_a_finished_build_keeps_it(tiny_fp8_llama, tmp_path, capsys):
    out = tmp_path / "out"
    assert run(capsys, "nvfp4", "--src", tiny_fp8_llama, "--out", out, "--device", "cpu", "--quiet")[0] == 0
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir()}
    rc, stdout, err = run(capsys, "nvfp4", "--src", tiny_fp8_llama, "--out", out, "--device", "cpu",
                          "--quiet", "--resume")
    assert (rc, stdout, err) == (0, f"{out} is already complete (it has its spark_quant_manifest.json): "
                                    "nothing to resume, the build is kept as it is; `quantize verify "
                                    f"{out}` checks it, and a new build needs an empty --out\n", "")
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir()} == before
    # killed after the manifest but before the ledgers went: the leftovers go, the build stays
    (out / ".spark-quant-progress.rank0.json").write_text("{}")
    (out / ".tmpK9x2Qa").write_bytes(b"x")
    assert run(capsys, "nvfp4", "--src", tiny_fp8_llama, "--out", out, "--device", "cpu", "--quiet",
               "--resume")[0] == 0
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir()} == before


# ---- item 8: what a published card says -------------------------------------------------------

def test_modelopt_card_license_and_plan_json(tiny_fp8_llama, tmp_path, capsys):
    import json

    from quantize.convert.pipeline import convert
    from quantize.hub.card import render_card

    build = tmp_path / "mo"
    convert(tiny_fp8_llama, build, fmt="modelopt", progress=False, device="cpu",
            source_info={"repo": "org/tiny-fp8", "license": "apache-2.0"})
    rc, stdout, err = run(capsys, "plan", "--src", build, "--out", build, "--node-mem-gib", "8",
                          "--max-model-len", "4096", "--activation-gib", "0", "--non-torch-gib", "0",
                          "--graphs-gib", "0")
    assert (rc, stdout.splitlines()[-1], err) == (
        0, f"wrote {build / 'plan.json'} (the fit table of the build's model card)", "")
    fit = json.loads((build / "plan.json").read_text())["fit"]
    assert [(r["nodes"], r["TP"], r["max-model-len"], r["fits"]) for r in fit] == [(1, 1, 4096, "yes")]
    assert list(fit[0]) == ["nodes", "TP", "KV dtype", "draft", "max-model-len", "weights GiB/rank",
                            "KV pool tokens", "sessions 128k", "sessions 256k", "sessions 512k",
                            "sessions 1M", "fits"]
    card = render_card(build, "me/tiny-nvfp4", license="mit")
    assert "modelopt" in card.data.tags and "compressed-tensors" not in card.data.tags
    text = card.content
    assert ("(ModelOpt NVFP4, `hf_quant_config.json`, loaded by vLLM, SGLang and TensorRT-LLM); "
            "activations\nstay 16-bit.") in text
    assert "- License: `mit`, as given to `quantize upload --license`." in text
    assert "| nodes | TP | KV dtype |" in text and "No fit plan was attached" not in text
    card = render_card(build, "me/tiny-nvfp4")
    assert "- License: `apache-2.0`, carried from the source model." in card.content


def test_plan_out_needs_a_finished_build(tiny_fp8_llama, capsys):
    rc, stdout, err = run(capsys, "plan", "--src", tiny_fp8_llama, "--out", tiny_fp8_llama,
                          "--node-mem-gib", "8", "--max-model-len", "4096")
    assert (rc, err) == (1, f"error: --out {tiny_fp8_llama}: not a finished build (no "
                            "spark_quant_manifest.json); the fit table is written into the build "
                            "folder its card is made from\n")


# ---- item 9: eval's baseline: `demo`, or the source the manifest records ---------------------

def test_eval_baseline_demo_and_from_manifest(tiny_fp8_llama, tmp_path, capsys, monkeypatch):
    """run_eval is stubbed: this is which baseline the CLI hands it, and the line it prints."""
    import eval.suite
    import quantize.data.demo as demo
    from quantize.convert.pipeline import convert

    build = tmp_path / "b"
    convert(tiny_fp8_llama, build, progress=False, device="cpu")
    got = []

    def run_eval(build, baseline, opts, baseline_endpoint=None):
        got.append(baseline)
        return {"gate": {"passed": True, "release": True, "checks": []}, "scope": {}}

    monkeypatch.setattr(eval.suite, "run_eval", run_eval)
    monkeypatch.setattr(demo, "build_demo", lambda: tmp_path / "demo-src")
    rc, stdout, err = run(capsys, "eval", build, "--suite", "kl")
    assert (rc, stdout.splitlines()[0]) == (
        0, f"baseline: {tiny_fp8_llama.resolve()} (the source recorded in {build / 'spark_quant_manifest.json'})")
    assert run(capsys, "eval", build, "--suite", "kl", "--baseline", "demo")[0] == 0
    (tiny_fp8_llama / "config.json").unlink()  # the source is gone: no baseline, no line
    rc, stdout, err = run(capsys, "eval", build, "--suite", "kl")
    assert (rc, stdout.splitlines()[0]) == (0, f"report: {build / 'eval' / 'report.json'}, {build / 'eval' / 'report.md'}")
    assert got == [str(tiny_fp8_llama.resolve()), str(tmp_path / "demo-src"), None]


# ---- item 9: the recipe recommended for the model is its default; the W4A4 preset ------------

def test_glm5_next_default_recipe_is_spark_mixed(glm5_next_src, tiny_fp8_llama, capsys):
    rc, stdout, err = run(capsys, "recipe", "show", "--src", glm5_next_src, "--summary")
    assert (rc, stdout.splitlines()[0].split(",")[0]) == (0, "recipe spark-mixed")
    rc, stdout, err = run(capsys, "recipe", "show", "--src", tiny_fp8_llama, "--summary")
    assert (rc, stdout.splitlines()[0].split(",")[0]) == (0, "recipe weight-only")


def test_spark_mixed_w4a4_keeps_mtp_in_block_fp8(glm5_next_src):
    from formats.sources import open_source
    from quantize import archs
    from quantize.plan.recipe import load_recipe
    from quantize.plan.tensors import plan_tensors

    source = open_source(glm5_next_src)
    mtp = archs.mtp_layer_indices(source.config)
    d = plan_tensors(source, load_recipe("spark-mixed-w4a4"))
    base = plan_tensors(source, load_recipe("spark-mixed"))
    in_mtp = {n for n in d if any(f".layers.{i}." in n for i in mtp)}
    assert mtp == [4] and len(in_mtp) > 0
    # every MTP Linear spark-mixed makes NVFP4 is block FP8 here; nothing else differs
    changed = {n for n in d if d[n].target != base[n].target}
    assert changed == {n for n in in_mtp if base[n].target.value == "nvfp4"} and len(changed) == 27
    assert {d[n].target.value for n in changed} == {"fp8-block"}


def test_spark_mixed_w4a4_build_passes_its_final_check(glm5_next_src, tmp_path, capsys):
    rc, stdout, err = run(capsys, "nvfp4", "--src", glm5_next_src, "--out", tmp_path / "b",
                          "--recipe", "spark-mixed-w4a4", "--device", "cpu", "--quiet")
    assert (rc, err) == (0, "")
    assert run(capsys, "check", tmp_path / "b")[:2] == (
        0, f"{tmp_path / 'b'}: 0 error(s), 0 warning(s) for vllm TP=1 (engine and TP as "
           "spark_quant_manifest.json records; --engine / --tp check another)\n")


# ---- item 5: wrong configs are refused before any work, naming the key ----------------------

def _glm_with(tmp_path, glm5_next_src, edit):
    import json
    import shutil

    src = tmp_path / "src"
    shutil.copytree(glm5_next_src, src)
    cfg = json.loads((src / "config.json").read_text())
    edit(cfg)
    (src / "config.json").write_text(json.dumps(cfg))
    return src


def test_unknown_model_type_with_a_dsa_indexer_is_refused(glm5_next_src, tmp_path, capsys):
    def edit(cfg):
        cfg["model_type"], cfg["text_config"]["model_type"] = "glm9_unknown", "glm9_unknown_text"

    src = _glm_with(tmp_path, glm5_next_src, edit)
    dsa = ("error: [config] config.json model_type 'glm9_unknown' is not one the architecture map "
           "knows for a DSA indexer (glm5_next, glm5_next_text, glm_moe_dsa, deepseek_v32), but "
           "model.language_model.layers.3.self_attn.indexer.weights_proj is a DSA indexer "
           "weights_proj: it would be planned as a plain Linear instead of staying high precision; "
           "set model_type to the architecture the checkpoint is\n")
    rc, stdout, err = run(capsys, "nvfp4", "--src", src, "--out", tmp_path / "out", "--quiet")
    assert (rc, err) == (1, "error: 2 problem(s) in src:\nerror: [config] "
                            + UNKNOWN.replace("'llama_deluxe'", "'glm9_unknown'") + "\n" + dsa)
    # --allow-unknown-arch accepts planning by names, never an indexer planned as a plain Linear
    rc, stdout, err = run(capsys, "nvfp4", "--src", src, "--out", tmp_path / "out", "--quiet",
                          "--allow-unknown-arch")
    assert (rc, err) == (1, "error: 1 problem(s) in src:\n" + dsa)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", ["abc", 2.5, -1, True])
def test_config_value_of_the_wrong_type_names_its_key(value, glm5_next_src, tmp_path, capsys):
    src = _glm_with(tmp_path, glm5_next_src, lambda cfg: cfg["text_config"].update(num_hidden_layers=value))
    rc, stdout, err = run(capsys, "preflight", src)
    assert rc == 1 and (f"error: [config] config.json text_config.num_hidden_layers is {value!r}: it "
                        "must be a non-negative integer") in stdout.splitlines()


# ---- item 7: --limit bounds the passkey grid too ----------------------------------------------

def test_limit_bounds_passkey(tmp_path, capsys, monkeypatch):
    import eval.suite
    from eval.suite import EvalOptions, _passkey_lengths

    cfg = {"max_position_embeddings": 8192}
    assert _passkey_lengths(cfg, EvalOptions()) == [1024, 2048, 4096, 8128]
    assert _passkey_lengths(cfg, EvalOptions(limit=5)) == [1024]
    assert _passkey_lengths(cfg, EvalOptions(limit=5, passkey_lengths=(2048, 4096))) == [2048, 4096]
    got = []

    def run_eval(build, baseline, opts, baseline_endpoint=None):
        got.append((opts.limit, opts.passkey_trials))
        return {"gate": {"passed": True, "release": True, "checks": []}, "scope": {}}

    monkeypatch.setattr(eval.suite, "run_eval", run_eval)
    (tmp_path / "b").mkdir()
    for extra in (["--limit", "5"], [], ["--limit", "5", "--passkey-trials", "2"]):
        assert run(capsys, "eval", tmp_path / "b", "--suite", "passkey", *extra)[0] == 0
    assert got == [(5, 1), (None, 3), (5, 2)]


# ---- item 5: an unknown model_type is refused unless accepted, and the plan says what it assumed

KNOWN = ("llama, mistral, qwen2, qwen3, gemma3_text, mixtral, qwen2_moe, qwen3_moe, qwen3_next, "
         "deepseek_v2, deepseek_v3, deepseek_v32, glm_moe_dsa, glm5_next, glm5_next_text, kimi_linear")
NAME_ONLY = ("embedding, lm_head, router, MTP eh_proj and vision Linears stay high precision (found "
             "by name); every other 2-D Linear weight follows the recipe; no model-specific rule "
             "applies (DSA indexer, engine model rules)")
UNKNOWN = (f"config.json model_type 'llama_deluxe' is not in the architecture map (known: {KNOWN}): "
           "which Linears stay high precision would be guessed from tensor names; set model_type "
           "to the architecture the checkpoint is, or pass --allow-unknown-arch to plan it from "
           f"tensor names alone ({NAME_ONLY})")
ASSUMED = ("model_type 'llama_deluxe' is not in the architecture map; planned from tensor names "
           f"alone (--allow-unknown-arch): {NAME_ONLY}. High precision: 1 embedding; quantized: "
           "nvfp4: 8 attention, 6 dense_mlp; other Linear weights left unquantized by the recipe "
           "or alignment: 0")


def refused_unless_accepted(capsys, cmd: str, src, out, message: str) -> str:
    """``cmd`` (nvfp4, preflight, recipe show or plan) on ``src``: refused with ``message``
    (exit 1, nothing written to ``out``), then accepted with ``--allow-unknown-arch`` (exit 0,
    nothing on stderr). Returns the accepted run's stdout."""
    args = {"nvfp4": ["nvfp4", "--src", src, "--out", out, "--device", "cpu", "--quiet"],
            "preflight": ["preflight", src, "--out", out],
            "recipe show": ["recipe", "show", "--src", src, "--summary"],
            "plan": ["plan", "--src", src, "--node-mem-gib", "8", "--max-model-len", "256"]}[cmd]
    rc, stdout, err = run(capsys, *args)
    if cmd == "nvfp4":
        assert (rc, stdout, err) == (1, "", f"error: 1 problem(s) in src:\nerror: [config] {message}\n")
    elif cmd == "preflight":
        assert (rc, stdout.splitlines()[1:], err) == (1, [f"error: [config] {message}"], "")
    else:
        assert (rc, stdout, err) == (1, "", f"error: {message}\n")
    assert not out.exists()
    rc, stdout, err = run(capsys, *args, "--allow-unknown-arch")
    assert (rc, err) == (0, "")
    return stdout


def _unknown_llama(tiny_fp8_llama):
    import json

    cfg = json.loads((tiny_fp8_llama / "config.json").read_text())
    cfg["model_type"] = "llama_deluxe"
    (tiny_fp8_llama / "config.json").write_text(json.dumps(cfg))
    return tiny_fp8_llama


@pytest.mark.parametrize("cmd", ["nvfp4", "preflight", "recipe show", "plan"])
def test_unknown_model_type_is_refused_unless_accepted(cmd, tiny_fp8_llama, tmp_path, capsys):
    src, out = _unknown_llama(tiny_fp8_llama), tmp_path / "out"
    stdout = refused_unless_accepted(capsys, cmd, src, out, UNKNOWN)
    line = {"nvfp4": f"  note: info: {ASSUMED}", "preflight": f"info: [config] {ASSUMED}",
            "recipe show": f"note: {ASSUMED}", "plan": f"note: {ASSUMED}"}[cmd]
    assert line in stdout.splitlines()
    if cmd == "nvfp4":
        rc, stdout, err = run(capsys, "check", out)
        assert (rc, stdout) == (0, f"WARNING [config] config.json: model_type 'llama_deluxe' is not in "
                                   f"the architecture map: checked from tensor names alone ({NAME_ONLY})\n"
                                   f"{out}: 0 error(s), 1 warning(s) for vllm TP=1 (engine and TP "
                                   "as spark_quant_manifest.json records; --engine / --tp check another)\n")


# ---- fresh-eyes findings: check's engine and TP, advice that can help, config.json as --src, ----
# ---- wrong-type layer counts, decoder and MTP layers counted apart --------------------------

def test_check_uses_the_engine_and_tp_the_manifest_records(tiny_fp8_llama, tmp_path, capsys):
    import json
    import shutil

    out = tmp_path / "b"
    assert run(capsys, "nvfp4", "--src", tiny_fp8_llama, "--out", out, "--device", "cpu", "--quiet",
               "--tp", "2", "--engine", "sglang")[0] == 0
    manifest = " as spark_quant_manifest.json records; --engine / --tp check another)"

    def last(*args):
        rc, stdout, err = run(capsys, "check", *args)
        return rc, stdout.splitlines()[-1]

    # (sglang warns that its compressed-tensors NVFP4 support is unconfirmed)
    assert last(out) == (0, f"{out}: 0 error(s), 1 warning(s) for sglang TP=2 (engine and TP{manifest}")
    assert last(out, "--tp", "4") == (0, f"{out}: 0 error(s), 1 warning(s) for sglang TP=4 (engine{manifest}")
    assert last(out, "--tp", "1", "--engine", "vllm") == (0, f"{out}: 0 error(s), 0 warning(s) for vllm TP=1")
    bare = tmp_path / "bare"  # a build without its manifest (another tool's): the defaults, said
    shutil.copytree(out, bare)
    (bare / "spark_quant_manifest.json").unlink()
    (bare / ".spark-quant-stats.json").unlink()  # nor our converter's scale counts
    assert run(capsys, "check", bare)[:2] == (
        0, f"{bare}: 0 error(s), 0 warning(s) for vllm TP=1 (default engine and TP: no "
           "spark_quant_manifest.json records them)\n")
    assert json.loads((out / "spark_quant_manifest.json").read_text())["options"]["tp"] == 2


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_sglang_expert_alignment_advice_names_what_helps(tp, glm5_next_src, capsys):
    rc, stdout, err = run(capsys, "recipe", "show", "--src", glm5_next_src, "--summary",
                          "--engine", "sglang", "--tp", tp)
    why = {1: "K=128 is not a multiple of 256 for nvfp4 on sglang (SGLang modelopt_quant.py "
              "ModelOptNvFp4FusedMoEMethod asserts weight_scale.shape[2] % 16)",
           2: "K/TP=128/2=64 is not a multiple of 256 for nvfp4 on sglang (SGLang modelopt_quant.py "
              "ModelOptNvFp4FusedMoEMethod asserts weight_scale.shape[2] % 16)",
           3: "K=128 does not split over TP=3"}[tp]
    engines = "" if tp == 3 else "serve it with --engine vllm or trtllm, or "
    assert (rc, stdout, err) == (1, "", (
        f"error: recipe spark-mixed at TP={tp} mixes ['nvfp4', 'unquantized'] in the routed experts "
        "of model.language_model.layers.1.mlp.experts (and 3 more MoE layer(s)): "
        f"model.language_model.layers.1.mlp.experts.0.down_proj.weight -> bf16 ({why}); engines "
        "load one scheme per MoE layer, so this build would fail its final check: no --tp helps "
        "(K=128 is not a multiple of 256 for nvfp4 on sglang even at TP=1): " + engines +
        "use a recipe that gives these experts one target sglang loads at this shape (bf16 keeps "
        "them all unquantized)\n"))


DESCRIPTOR = '{"config": {...}, "tensors": {name: {"dtype", "shape"}}}'


@pytest.mark.parametrize("cmd", ["preflight", "recipe show", "plan", "nvfp4"])
def test_config_json_as_src_is_named_for_what_it_is(cmd, tiny_fp8_llama, tmp_path, capsys):
    cfg = tiny_fp8_llama / "config.json"
    args = {"preflight": ["preflight", cfg], "recipe show": ["recipe", "show", "--src", cfg],
            "plan": ["plan", "--src", cfg], "nvfp4": ["nvfp4", "--src", cfg, "--out", tmp_path / "o"]}[cmd]
    rc, stdout, err = run(capsys, *args)
    if cmd == "nvfp4":
        assert (rc, err) == (1, f"error: --src {cfg} is a JSON file, not a source (a model's "
                                "config.json is read from its folder): convert the folder that holds "
                                f"config.json and the safetensors shards (--src {tiny_fp8_llama})\n")
    else:
        assert (rc, stdout, err) == (1, "", f"error: {cfg} is a model's config.json, not a header-only "
                                            f"descriptor {DESCRIPTOR}: give the folder that holds it "
                                            f"and its shards ({tiny_fp8_llama})\n")
    assert not (tmp_path / "o").exists()


def test_json_that_is_no_descriptor(tmp_path, capsys):
    (tmp_path / "other.json").write_text('{"a": 1}')
    (tmp_path / "bad.json").write_text('{"a": ')
    assert run(capsys, "preflight", tmp_path / "other.json") == (
        1, "", f"error: other.json is not a header-only descriptor {DESCRIPTOR}: it has no 'config' "
               "and no 'tensors' object\n")
    assert run(capsys, "recipe", "show", "--src", tmp_path / "bad.json") == (
        1, "", "error: bad.json is not valid JSON (Expecting value: line 1 column 7 (char 6)); a "
               f"header-only descriptor is {DESCRIPTOR}\n")


@pytest.mark.parametrize("cmd", ["preflight", "recipe show", "plan"])
def test_wrong_type_layer_count_is_named_by_every_command(cmd, glm5_next_src, tmp_path, capsys):
    src = _glm_with(tmp_path, glm5_next_src, lambda cfg: cfg["text_config"].update(num_hidden_layers="abc"))
    args = {"preflight": ["preflight", src], "recipe show": ["recipe", "show", "--src", src],
            "plan": ["plan", "--src", src]}[cmd]
    rc, stdout, err = run(capsys, *args)
    wrong = "config.json text_config.num_hidden_layers is 'abc': it must be a non-negative integer"
    if cmd == "preflight":
        assert (rc, stdout.splitlines()[1:], err) == (1, [
            f"error: [config] {wrong}",
            "info: [layout] config.json text_config.num_hidden_layers is 'abc' (str, not a "
            "non-negative integer): layers, MTP layers and experts not checked against it"], "")
    else:
        assert (rc, stdout, err) == (1, "", f"error: {wrong}\n")


def test_layer_count_warning_states_decoder_and_mtp_layers(glm5_next_src, tmp_path, capsys):
    src = _glm_with(tmp_path, glm5_next_src, lambda cfg: cfg["text_config"].update(num_hidden_layers=3))
    rc, stdout, err = run(capsys, "preflight", src)
    assert (rc, stdout.splitlines()[1:], err) == (1, [
        "error: [layout] MTP layer 3 (num_hidden_layers + 0) lacks enorm.weight, hnorm.weight, "
        "eh_proj.weight, shared_head.norm.weight",
        "warning: [layout] checkpoint has layer(s) 4 beyond the 3 decoder layer(s) (0-2, "
        "num_hidden_layers=3) and 1 MTP layer(s) (3, num_nextn_predict_layers=1) config.json "
        "declares; they are converted as stored"], "")


# ---- item 8: published files name sources by repo id and relative names, never a local path --

def test_published_files_hold_no_local_path(demo_src, tmp_path, capsys):
    """The demo built next to its source and evaluated (kl, without --baseline: the source the
    manifest names is found next to the build); the manifest, the eval report and the rendered
    card hold neither the temp folder nor $HOME."""
    import json
    import os
    import shutil
    import tempfile
    from pathlib import Path

    from formats.manifest import recorded_source
    from quantize.hub.card import render_card

    build = demo_src.parent / f"published-{tmp_path.name}"
    try:
        assert run(capsys, "nvfp4", "--src", demo_src, "--out", build, "--device", "cpu", "--quiet",
                   "--no-showcase")[0] == 0
        manifest = json.loads((build / "spark_quant_manifest.json").read_text())
        assert manifest["source"]["path"] == demo_src.name
        assert recorded_source(build, manifest) == demo_src.resolve()
        assert recorded_source(tmp_path / "elsewhere", manifest) is None  # not next to it, nor in cwd
        rc, stdout, err = run(capsys, "eval", build, "--suite", "kl", "--kl-tokens", "64", "--device", "cpu")
        assert stdout.splitlines()[0] == (f"baseline: {demo_src.resolve()} (the source recorded in "
                                          f"{build / 'spark_quant_manifest.json'})")
        report = json.loads((build / "eval" / "report.json").read_text())
        assert (report["baseline"]["path"], report["build"]["path"]) == (demo_src.name, build.name)
        assert report["scope"]["baseline"] == demo_src.name
        card = render_card(build, "me/demo-nvfp4").content
        published = {"spark_quant_manifest.json": (build / "spark_quant_manifest.json").read_text(),
                     "eval/report.json": (build / "eval" / "report.json").read_text(),
                     "eval/report.md": (build / "eval" / "report.md").read_text(), "README.md card": card}
        local = {str(tmp_path), str(Path(tempfile.gettempdir()).resolve()), os.environ.get("HOME") or "/root",
                 str(demo_src.parent), str(Path.cwd())}
        assert {(name, p) for name, text in published.items() for p in local if p in text} == set()
    finally:
        shutil.rmtree(build, ignore_errors=True)
