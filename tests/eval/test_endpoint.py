"""``quantize eval --endpoint``: the demo build served by a real ``transformers serve`` on
loopback, evaluated through lm-eval's local-chat-completions / local-completions clients."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from quantize.cli import main

pytest.importorskip("fastapi", reason="needs transformers[serving] (the eval extra)")
pytest.importorskip("uvicorn", reason="needs transformers[serving] (the eval extra)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(demo_build, tmp_path_factory):
    exe = shutil.which("transformers") or str(Path(sys.executable).with_name("transformers"))
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    # bf16: compressed-tensors decompresses NVFP4 into bf16 weights on the first request
    with open(log, "wb") as f:
        proc = subprocess.Popen([exe, "serve", str(demo_build), "--device", "cpu", "--dtype", "bfloat16",
                                 "--host", "127.0.0.1", "--port", str(port)],
                                stdout=f, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5):
                    break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    pytest.fail(f"transformers serve did not come up:\n{log.read_text()[-3000:]}")
                time.sleep(1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_eval_through_an_openai_compatible_server(served, demo_build, tmp_path):
    out = tmp_path / "eval"
    rc = main(["eval", str(demo_build), "--endpoint", served, "--suite", "gsm8k,passkey", "--limit", "1",
               "--max-gen-toks", "16", "--passkey-lengths", "160", "--passkey-depths", "0,100",
               "--passkey-trials", "1", "--out", str(out)])
    r = json.loads((out / "report.json").read_text())
    assert rc == 0 and r["gate"]["passed"]
    # No --baseline: the source the build's manifest records (the demo FP8 source) is the
    # baseline, evaluated in process, so the drops are measured and only --limit keeps this
    # from being a release gate.
    assert r["gate"]["release"] is False and r["scope"]["not_release"] == [
        "--limit 1: only the first 1 problems of each set were scored"]
    assert "gsm8k.flexible-extract.drop" not in r["gate"]["skipped"]
    assert "No baseline" not in (out / "report.md").read_text()
    assert r["backend"] == {**r["backend"], "build": "endpoint", "endpoint": served, "device": "endpoint"}
    # first id of GET /v1/models (the served folder), published as its name, never a local path
    assert r["backend"]["endpoint_model"] == demo_build.name
    g = r["suites"]["gsm8k"]
    assert g["build"]["n"] == 1 and g["settings"]["chat_template"]
    rows = [json.loads(x) for x in (out / "gsm8k_samples.jsonl").read_text().splitlines()]
    assert sorted(x["model"] for x in rows) == ["baseline", "build"]  # paired
    assert all(isinstance(x["response"], str) and x["response"] for x in rows)
    recs = [json.loads(x) for x in (out / "passkey_records.jsonl").read_text().splitlines()]
    assert sorted((x["model"], x["depth"]) for x in recs) == [
        ("baseline", 0), ("baseline", 100), ("build", 0), ("build", 100)]
    assert all(x["completion"] for x in recs)
    assert r["suites"]["passkey"]["build"]["mean"] == 1.0  # the served build finds the key


def test_endpoint_refuses_in_process_suites(served, demo_build, tmp_path):
    with pytest.raises(ValueError, match="need the model in process"):
        from eval.suite import EvalOptions, run_eval

        run_eval(demo_build, None, EvalOptions(suites=("kl",), endpoint=served, out=str(tmp_path)))
