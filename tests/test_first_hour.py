"""The first hour of a new user (issue 19), the defects a fresh-eyes run found last: what each
command prints (one line, no traceback) and its exit code. The commands run in-process through
``quantize.cli.main``, except where a signal has to reach worker processes."""

import json
import shutil

import pytest

from quantize.cli import main


def run(capsys, *args) -> tuple[int, str, str]:
    rc = main([str(a) for a in args])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


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
