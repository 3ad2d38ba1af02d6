"""``quantize verify``: manifest hashes, headers, index, layout, samples against the source."""

import json
import shutil

import pytest
import torch
from conftest import write_checkpoint
from safetensors.torch import load_file, save_file

from formats.checkpoint import INDEX_NAME
from formats.manifest import MANIFEST_NAME, PROGRESS_NAME
from formats.shards import sha256_file
from quantize.cli import main
from quantize.convert.pipeline import convert
from quantize.inspect.verify import verify

S1 = "model-00001-of-00003.safetensors"


@pytest.fixture
def build(tmp_path, tiny_fp8_llama):
    out = tmp_path / "build"
    convert(tiny_fp8_llama, out, progress=False)
    return tiny_fp8_llama, out


def reseal(out, rel):
    """Update the manifest entry of ``rel`` as if the build had been written that way."""
    man = json.loads((out / MANIFEST_NAME).read_text())
    man["files"][rel] = {"sha256": sha256_file(out / rel), "bytes": (out / rel).stat().st_size}
    (out / MANIFEST_NAME).write_text(json.dumps(man))


def errors(rep):
    return [f.message for f in rep.findings if f.level == "error"]


def test_clean_build_verifies(build, capsys):
    src, out = build
    rep = verify(out)
    assert rep.ok, rep.render()
    assert (rep.files, rep.headers, rep.sampled, rep.compared) == (6, 3, 20, 20)
    assert rep.source == str(src.resolve())
    assert 0.3 < rep.worst <= 1.0  # rounding error reaches, never exceeds, one e2m1 step unit
    assert main(["verify", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"verify {out}: OK\n  files: 6 hashed")
    assert "20 compared with" in text


def test_damaged_files_are_named(build):
    _, out = build
    data = bytearray((out / S1).read_bytes())
    data[-1] ^= 0x01
    (out / S1).write_bytes(bytes(data))
    (out / "tokenizer_config.json").unlink()
    (out / "notes.txt").write_text("?")
    (out / "x.safetensors.tmp").write_text("")
    assert errors(verify(out)) == [
        f"{S1}: sha256 differs from the manifest (corrupted or modified after the build)",
        "tokenizer_config.json is listed in the manifest but missing",
        "notes.txt: not in the manifest",
        "x.safetensors.tmp: a leftover temp file"]


def test_eval_report_in_the_build_is_read_past(build):
    _, out = build
    (out / "eval").mkdir()
    (out / "eval" / "report.json").write_text("{}")
    (out / "eval" / "report.md").write_text("#")
    rep = verify(out)
    assert rep.ok, rep.render()
    assert [f.message for f in rep.findings if f.key == "eval"] == [
        "eval/: 2 file(s) of `quantize eval`'s report, written after the build, not hashed"]
    (out / "evaluation.txt").write_text("?")  # a name beginning with eval is still an unknown file
    assert errors(verify(out)) == ["evaluation.txt: not in the manifest"]


def test_unfinished_build(build):
    _, out = build
    (out / MANIFEST_NAME).unlink()
    (out / PROGRESS_NAME).write_text("{}")
    assert errors(verify(out)) == [
        f"{out} has no {MANIFEST_NAME}: not a finished build (a progress ledger is there: the "
        "conversion was interrupted; rerun it with --resume)"]


def test_tampered_weights_caught_by_samples_even_with_matching_hashes(build):
    """Bytes changed and the manifest re-sealed: hashes pass, the dequantized samples do not."""
    _, out = build
    t = load_file(str(out / S1))
    name = next(k for k in sorted(t) if k.endswith(".weight_packed"))
    t[name][0] = t[name][0] ^ 0x77
    save_file(t, str(out / S1))
    reseal(out, S1)
    found = errors(verify(out))
    assert len(found) == 1
    assert found[0].startswith(f"{name[:-len('_packed')]} row 0 column ")
    assert "beyond the NVFP4 rounding bound" in found[0]


def test_index_disagreeing_with_headers(build):
    _, out = build
    idx = json.loads((out / INDEX_NAME).read_text())
    idx["weight_map"].pop("model.norm.weight")
    idx["weight_map"]["model.ghost.weight"] = S1
    (out / INDEX_NAME).write_text(json.dumps(idx))
    reseal(out, INDEX_NAME)
    assert errors(verify(out)) == [
        "model.ghost.weight is in the index but no shard header",
        "model.norm.weight is in a shard but not the index",
        "quantize check could not run: 2 problem(s) in build:"]


def test_other_source_with_same_layout_fails_the_samples(build, tmp_path):
    src, out = build
    other = tmp_path / "other"
    shutil.copytree(src, other)
    for shard in other.glob("*.safetensors"):
        t = load_file(str(shard))
        for k, v in t.items():
            if v.dtype == torch.float8_e4m3fn:
                t[k] = (v.float() * -1).to(torch.float8_e4m3fn)  # same headers, other values
            elif k.endswith("layernorm.weight"):
                t[k] = v * 2
        save_file(t, str(shard))
    found = errors(verify(out, src=other))
    assert any("beyond the NVFP4 rounding bound" in m for m in found)
    assert "model.layers.0.input_layernorm.weight row 0: keep bytes differ from the source" in found


def test_source_with_other_headers_is_not_compared(build, tmp_path):
    _, out = build
    other = write_checkpoint(tmp_path / "other", {"a.weight": torch.ones(2, 2)}, {})
    rep = verify(out, src=other)
    assert errors(rep) == [f"source {other} is not the one this build was made from: shard "
                           f"model-00001-of-00001.safetensors differs from the manifest's header digest"]
    assert rep.compared == 0


def test_missing_source_is_a_note_not_an_error(build, tmp_path):
    _, out = build
    rep = verify(out, src=tmp_path / "gone")
    assert rep.ok and rep.compared == 0 and rep.sampled == 20
    assert [f.message for f in rep.findings if f.kind == "source"] == [
        f"source {tmp_path / 'gone'} is not available: samples checked for finite values only"]


def test_modelopt_build_verifies_against_its_source(tmp_path, tiny_fp8_llama):
    """ModelOpt stores the dequant-direction scale_2 = amax / 2688; the samples use it."""
    out = tmp_path / "mo"
    convert(tiny_fp8_llama, out, fmt="modelopt", progress=False)
    rep = verify(out)
    assert rep.ok, rep.render()
    assert (rep.sampled, rep.compared) == (20, 20) and 0.3 < rep.worst <= 1.0


def test_saturated_block_after_scale_rounded_down_verifies(tmp_path):
    """A block whose e4m3 scale rounds down in the subnormal range (1.4 * 2^-9 -> 2^-9) clips
    its top elements to 6 units; verify allows that clipping, nothing more (found on a
    synthetic GLM-expert checkpoint, where it flagged a fresh build)."""
    from conftest import BLOCK_FP8_QC, fp8_pair

    from formats.shards import read_header

    h, inter = 64, 256
    g = torch.Generator().manual_seed(0)
    t = {"model.embed_tokens.weight": torch.randn(256, h, generator=g).bfloat16(),
         "model.norm.weight": torch.ones(h).bfloat16(),
         "model.layers.0.input_layernorm.weight": torch.ones(h).bfloat16(),
         "model.layers.0.post_attention_layernorm.weight": torch.ones(h).bfloat16()}
    for m, shape in [("self_attn.q_proj", (h, h)), ("self_attn.k_proj", (32, h)),
                     ("self_attn.v_proj", (32, h)), ("self_attn.o_proj", (h, h)),
                     ("mlp.gate_proj", (inter, h)), ("mlp.up_proj", (inter, h))]:
        t.update(fp8_pair(f"model.layers.0.{m}", torch.randn(*shape, generator=g) * 0.05))
    w = torch.zeros(h, inter)
    w[:, 0] = 1.0  # tensor amax 1.0: global scale 2688
    tiny = 1.4 * 2.0 ** -9 / 448  # block scale 448 * amax = 1.4 * 2^-9, rounds to 2^-9
    w[:, 128:144] = tiny * torch.linspace(1.0, 0.1, 16)  # its own 128-column FP8 block: exact
    t.update(fp8_pair("model.layers.0.mlp.down_proj", w))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
              "intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 256, "tie_word_embeddings": True,
              "rms_norm_eps": 1e-5, "max_position_embeddings": 512,
              "quantization_config": BLOCK_FP8_QC}
    src = write_checkpoint(tmp_path / "src", t, config)
    out = tmp_path / "build"
    convert(src, out, progress=False)
    shard = next(out.glob("*.safetensors"))
    assert "model.layers.0.mlp.down_proj.weight_packed" in read_header(shard)
    got = load_file(str(shard))
    scale = got["model.layers.0.mlp.down_proj.weight_scale"].view(torch.uint8)
    assert int(scale[0, 8]) == 0x01  # 2^-9: rounded down from 1.4 * 2^-9
    assert int(got["model.layers.0.mlp.down_proj.weight_packed"][0, 64]) & 0x0F == 0x7  # +6: clipped
    rep = verify(out)
    assert rep.ok, rep.render()
    assert rep.worst <= 1.0
