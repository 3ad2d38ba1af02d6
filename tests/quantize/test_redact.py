"""Token redaction: environment tokens, registered secrets, token-shaped strings, nested JSON."""

import io

from quantize.base.redact import RedactingStream, redact, redact_obj, register_secret


def test_environment_and_registered_secrets_masked(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "s3cr3t-env-value")
    monkeypatch.setenv("HUGGING_FACE_HUB_TOKEN", "another-secret-42")
    register_secret("passed-on-the-command-line")
    register_secret("short")  # too short to mask safely: ordinary words would vanish
    assert redact("a s3cr3t-env-value b another-secret-42 c passed-on-the-command-line short") == (
        "a *** b *** c *** short")


def test_token_shapes_masked_without_knowing_them():
    assert redact("hf_AbCdEfGhIjKlMnOpQrStUv12 and hf_short") == "*** and hf_short"
    assert redact("Authorization: Bearer eyJhbGciOi.J9-x") == "Authorization: Bearer ***"
    assert redact("https://user:pa55word@huggingface.co/org/m and https://huggingface.co/a:b") == (
        "https://user:***@huggingface.co/org/m and https://huggingface.co/a:b")


def test_nested_objects_and_keys(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "tok-0123456789")
    obj = {"source": {"repo": "org/m", "auth": ["x", "tok-0123456789"]}, "tok-0123456789": 3,
           "n": 1.5, "ok": True}
    assert redact_obj(obj) == {"source": {"repo": "org/m", "auth": ["x", "***"]}, "***": 3,
                               "n": 1.5, "ok": True}


def test_stream_redacts_each_write(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "tok-0123456789")
    inner = io.StringIO()
    s = RedactingStream(inner)
    print("using tok-0123456789 now", file=s)
    assert inner.getvalue() == "using *** now\n"


def test_rendered_model_card_carries_no_token(tmp_path, tiny_fp8_llama, monkeypatch):
    import json

    from formats.manifest import MANIFEST_NAME
    from quantize.convert.pipeline import convert
    from quantize.hub.card import render_card

    token = "hf_" + "Zq81kLmN0pQrStUv" * 2
    monkeypatch.setenv("HF_TOKEN", token)
    out = tmp_path / "o"
    convert(tiny_fp8_llama, out, progress=False)
    man = json.loads((out / MANIFEST_NAME).read_text())  # as an older tool might have left it
    man["summary"]["notes"].append(f"fetched with Bearer {token}")
    (out / MANIFEST_NAME).write_text(json.dumps(man))
    text = render_card(out, "org/tiny-NVFP4").content
    assert token not in text and "fetched with Bearer ***" in text
