"""``quantize eval`` refuses bad input before it loads a model or writes a file: options,
BUILD / baseline folders, passkey lengths against the context, endpoints; and a run clears
only its own earlier artifacts."""

import json
import socket

import pytest

from eval.suite import ARTIFACTS, EvalOptions, _clear_previous, preflight, run_eval
from quantize.cli import build_parser, main


def _folder(path, **config):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
    return path


@pytest.fixture
def no_load(monkeypatch):
    """Any model or tokenizer load fails the test."""
    import transformers

    import eval.models

    def boom(*a, **k):
        raise AssertionError("a model or tokenizer was loaded")

    monkeypatch.setattr(eval.models, "load_model", boom)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", boom)


def test_no_suite_is_an_error_and_keeps_the_previous_report(tmp_path, capsys, no_load):
    build = _folder(tmp_path / "b")
    (build / "eval").mkdir()
    (build / "eval" / "report.json").write_text("earlier")
    assert main(["eval", str(build), "--suite", ""]) == 1
    err = capsys.readouterr().err
    assert "no suite given (--suite); choose one or more of kl, gsm8k, mc, passkey, kv-parity" in err
    assert (build / "eval" / "report.json").read_text() == "earlier"
    assert [p.name for p in (build / "eval").iterdir()] == ["report.json"]
    with pytest.raises(ValueError, match=r"unknown suite\(s\) 'gsm9k' \(--suite\); choose from kl, gsm8k"):
        EvalOptions(suites=("gsm9k",))


def test_build_and_baseline_folders_are_checked_first(tmp_path, capsys, no_load):
    missing = tmp_path / "nope"
    assert main(["eval", str(missing)]) == 1
    assert f"error: BUILD {missing}: no such folder" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["eval", str(empty)]) == 1
    assert f"error: BUILD {empty}: not a model folder (no config.json)" in capsys.readouterr().err
    assert list(empty.iterdir()) == []  # no eval/ folder created
    build = _folder(tmp_path / "b")
    assert main(["eval", str(build), "--baseline", str(missing)]) == 1
    assert f"error: baseline {missing}: no such folder" in capsys.readouterr().err
    assert main(["eval", str(build), "--baseline", str(build)]) == 1
    assert f"BUILD and --baseline are the same folder ({build})" in capsys.readouterr().err
    assert not (build / "eval").exists()


def test_vocabulary_mismatch_names_baseline_and_build(tmp_path, no_load):
    build, base = _folder(tmp_path / "b", vocab_size=100), _folder(tmp_path / "s", vocab_size=120)
    with pytest.raises(ValueError, match=r"vocabulary sizes differ: baseline 120 .*, build 100"):
        run_eval(build, base, EvalOptions(suites=("kl",)))
    assert not (build / "eval").exists()


@pytest.mark.parametrize("flag,value,message", [
    ("--limit", "0", "must be >= 1, got 0"), ("--limit", "-3", "must be >= 1, got -3"),
    ("--passkey-trials", "0", "must be >= 1"), ("--kl-tokens", "1", "must be >= 2"),
    ("--batch-size", "0", "must be >= 1"), ("--max-gen-toks", "0", "must be >= 1"),
    ("--kv-gsm8k-limit", "-1", "must be >= 0"), ("--limit", "five", "not an integer: 'five'"),
    ("--passkey-lengths", "1024,0", "each must be >= 1, got '1024,0'"),
    ("--passkey-depths", "0,101", "each must be 0..100, got '0,101'"),
])
def test_counts_are_checked_by_argparse(flag, value, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["eval", "/nonexistent", flag, value])
    assert e.value.code == 2
    assert f"argument {flag}: {message}" in capsys.readouterr().err


def test_valid_counts_parse():
    args = build_parser().parse_args(["eval", "b", "--kv-gsm8k-limit", "0", "--passkey-depths", "0,100",
                                      "--passkey-lengths", "160,320", "--limit", "1"])
    assert (args.kv_gsm8k_limit, args.passkey_depths, args.passkey_lengths, args.limit) == \
        (0, (0, 100), (160, 320), 1)


@pytest.mark.parametrize("field,value,message", [
    ("limit", 0, "--limit must be an integer >= 1, got 0"),
    ("passkey_trials", 0, "--passkey-trials must be an integer >= 1"),
    ("kv_gsm8k_limit", -1, "--kv-gsm8k-limit must be an integer >= 0"),
    ("passkey_lengths", (0,), "--passkey-lengths must be token counts >= 1"),
    ("passkey_depths", (50, 101), r"--passkey-depths must be percentages 0..100"),
    ("kv_dtypes", ("fp4",), "--kv-dtypes: unknown"),
])
def test_options_are_checked_in_the_library_too(field, value, message):
    with pytest.raises(ValueError, match=message):
        EvalOptions(**{field: value})


def test_passkey_lengths_beyond_the_context_are_refused(tmp_path, no_load):
    build = _folder(tmp_path / "b", max_position_embeddings=2048)
    opts = EvalOptions(suites=("passkey",), passkey_lengths=(1024, 2040, 4096))
    with pytest.raises(ValueError, match=r"--passkey-lengths 2040,4096: beyond the model's context "
                                         r"\(max_position_embeddings 2048 in config.json leaves prompts "
                                         r"of at most 2038 tokens"):
        run_eval(build, None, opts)
    assert not (build / "eval").exists()
    assert preflight(build, None, EvalOptions(suites=("passkey",))).lengths == [1024, 1984]
    short = _folder(tmp_path / "short", max_position_embeddings=512)
    with pytest.raises(ValueError, match="below the default passkey lengths"):
        preflight(short, None, EvalOptions(suites=("passkey",)))


def test_bad_thresholds_stop_before_models(tmp_path, no_load):
    build = _folder(tmp_path / "b")
    bad = tmp_path / "t.toml"
    bad.write_text("version = 1\n[gsm8k]\nz = 'high'\n")
    with pytest.raises(ValueError, match=rf"thresholds file {bad}: gsm8k.z must be a number"):
        run_eval(build, None, EvalOptions(suites=("gsm8k",), thresholds=str(bad)))
    assert not (build / "eval").exists()


def test_missing_manifest_is_a_warning(tmp_path):
    build = _folder(tmp_path / "b")
    pre = preflight(build, None, EvalOptions(suites=("gsm8k",)))
    assert len(pre.warnings) == 1
    assert pre.warnings[0].startswith(f"BUILD {build} has no spark_quant_manifest.json: not a spark-quant build")
    (build / "spark_quant_manifest.json").write_text("{}")
    assert preflight(build, None, EvalOptions(suites=("gsm8k",))).warnings == []


def test_unreachable_endpoint_names_the_url(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    url = f"http://127.0.0.1:{port}"
    build = _folder(tmp_path / "b")
    with pytest.raises(OSError, match=rf"endpoint {url}: cannot reach {url}/v1/models \("):
        preflight(build, None, EvalOptions(suites=("gsm8k",), endpoint=url))


def test_clear_previous_removes_only_our_artifacts(tmp_path):
    ours = ["report.json", "report.md", "gsm8k_samples.jsonl", "passkey_records.jsonl",
            "passkey_build.png", "passkey_kv_fp8.png", "tasks/spark_gsm8k.yaml",
            "tasks/spark_arc_challenge.yaml", ".report.json.tmp"]
    theirs = ["notes.txt", "tasks/mine.yaml", "passkey.png"]
    for rel in ours + theirs:
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_text("x")
    _clear_previous(tmp_path)
    left = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert left == sorted(theirs)
    assert "tasks/spark_gsm8k.yaml" in ARTIFACTS
    (tmp_path / "tasks" / "mine.yaml").unlink()
    _clear_previous(tmp_path)
    assert not (tmp_path / "tasks").exists()  # our emptied tasks/ folder goes too
