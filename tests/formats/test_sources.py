"""Source reading and validation: FP8 pairs, index vs headers, missing shards, CT FP8."""

import json
from pathlib import Path

import pytest
import torch
from conftest import BLOCK_FP8_QC, fp8_pair, write_checkpoint
from safetensors.torch import save_file

from formats.sources import SourceKind, open_source
from quantize.base.errors import SourceError


def test_fc03_block_dequant_before_requant(tmp_path):
    w = torch.ones(256, 256).to(torch.float8_e4m3fn)
    s = torch.tensor([[0.5, 1.0], [2.0, 4.0]])
    src = write_checkpoint(tmp_path, {"model.layers.0.mlp.down_proj.weight": w,
                                      "model.layers.0.mlp.down_proj.weight_scale_inv": s},
                           {"quantization_config": BLOCK_FP8_QC})
    source = open_source(src)
    assert list(source.tensors) == ["model.layers.0.mlp.down_proj.weight"]
    d = source.read("model.layers.0.mlp.down_proj.weight")
    assert d.dtype == torch.float32
    assert d[0, 0] == 0.5 and d[0, 200] == 1.0 and d[200, 0] == 2.0 and d[255, 255] == 4.0


def test_fc03_orphan_scale_and_missing_scale_are_errors(tmp_path):
    t = {"a.weight_scale_inv": torch.ones(1, 1),
         "b.weight": torch.ones(4, 16).to(torch.float8_e4m3fn)}
    src = write_checkpoint(tmp_path, t, {"quantization_config": BLOCK_FP8_QC})
    with pytest.raises(SourceError) as e:
        open_source(src)
    msg = str(e.value)
    assert "orphan scale a.weight_scale_inv" in msg
    assert "FP8 weight b.weight in model-00001-of-00001.safetensors has no b.weight_scale_inv" in msg


def test_cross_shard_scale_found_through_index(tmp_path):
    t = fp8_pair("m", torch.full((8, 32), 3.0))
    src = write_checkpoint(tmp_path, t, {"quantization_config": BLOCK_FP8_QC},
                           {"m.weight": 0, "m.weight_scale_inv": 1}, n_shards=2)
    source = open_source(src)
    assert source.tensors["m.weight"].scale.shard == "model-00002-of-00002.safetensors"
    assert torch.allclose(source.read("m.weight"), torch.full((8, 32), 3.0))


def test_fc21a_index_lists_tensor_missing_from_shard(tmp_path):
    src = write_checkpoint(tmp_path, {"a.weight": torch.ones(2, 2)}, {}, n_shards=2)
    idx = json.loads((src / "model.safetensors.index.json").read_text())
    idx["weight_map"]["mtp.fc.weight"] = "model-00002-of-00002.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(SourceError, match=r"mtp\.fc\.weight \(index says model-00002-of-00002"):
        open_source(src)


@pytest.mark.parametrize("how", ["missing", "empty"])
def test_fc22_missing_or_empty_shard_fails_before_reading(tmp_path, how):
    src = write_checkpoint(tmp_path / "s", {f"t{i}.weight": torch.ones(2, 2) for i in range(3)},
                           {}, n_shards=3)
    shard3 = src / "model-00003-of-00003.safetensors"
    if how == "missing":
        shard3.unlink()
    else:
        shard3.write_bytes(b"")
    with pytest.raises(SourceError, match="missing or empty: model-00003-of-00003.safetensors"):
        open_source(src)


def test_truncated_shard_is_refused_by_header_check(tmp_path):
    src = write_checkpoint(tmp_path, {"a.weight": torch.ones(64, 64)}, {})
    f = src / "model-00001-of-00001.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(SourceError, match=r"a.weight declares bytes .*\(truncated or corrupt\)"):
        open_source(src)


def test_index_path_outside_folder_refused(tmp_path):
    src = write_checkpoint(tmp_path, {"a.weight": torch.ones(2, 2)}, {})
    (src / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a.weight": "../evil.safetensors"}}))
    with pytest.raises(SourceError, match="not a file inside the source folder"):
        open_source(src)


def test_block_size_read_from_config_not_shapes(tmp_path):
    qc = dict(BLOCK_FP8_QC, weight_block_size=[64, 64])
    t = fp8_pair("m", torch.ones(128, 128), block=(64, 64))
    source = open_source(write_checkpoint(tmp_path, t, {"quantization_config": qc}))
    assert source.layout.block == (64, 64)
    # the same tensors declared with 128x128 blocks no longer match the scale grid
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": BLOCK_FP8_QC}))
    with pytest.raises(SourceError, match=r"scale m.weight_scale_inv .* has shape \[2, 2\]"):
        open_source(tmp_path)


@pytest.mark.parametrize("strategy,scale", [("tensor", torch.tensor([2.0])),
                                            ("channel", torch.full((4, 1), 2.0)),
                                            ("block", torch.full((1, 1), 2.0))])
def test_compressed_tensors_fp8_source(tmp_path, strategy, scale):
    weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True}
    if strategy == "block":
        weights["block_structure"] = [128, 128]
    qc = {"quant_method": "compressed-tensors", "format": "float-quantized",
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}
    t = {"m.weight": torch.full((4, 32), 1.5).to(torch.float8_e4m3fn), "m.weight_scale": scale,
         "m.input_scale": torch.tensor([1.0])}
    source = open_source(write_checkpoint(tmp_path, t, {"quantization_config": qc}))
    assert source.kind is SourceKind.CT_FP8
    assert torch.all(source.read("m.weight") == 3.0)
    assert source.dropped == ["m.input_scale"]


def test_unsupported_quant_method_named(tmp_path):
    src = write_checkpoint(tmp_path, {"a.weight": torch.ones(2, 2)},
                           {"quantization_config": {"quant_method": "gptq"}})
    with pytest.raises(SourceError, match="quant_method 'gptq' is not supported") as e:
        open_source(src)
    assert e.value.key == "quantization_config.quant_method"


def test_pickle_only_source_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(SourceError, match="pickled weights .*pytorch_model.bin.* never loaded"):
        open_source(tmp_path)


def test_dense_bf16_source_reads_exact_bits(tmp_path):
    x = torch.randn(3, 16).bfloat16()
    save_file({"a.weight": x}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    source = open_source(tmp_path)
    assert source.kind is SourceKind.DENSE
    assert torch.equal(source.read("a.weight").view(torch.int16), x.view(torch.int16))


@pytest.mark.parametrize("layout", ["block", "channel", "group", "tensor"])
def test_read_rows_equals_rows_of_read(tmp_path, layout):
    """Row reads (used by verify) dequantize exactly like full reads, partial edge blocks too."""
    w = (torch.randn(200, 300) * 0.1).to(torch.float8_e4m3fn)
    if layout == "block":
        qc, scale = BLOCK_FP8_QC, torch.rand(2, 3) + 0.5
        suffix = "_scale_inv"
    else:
        args = {"num_bits": 8, "type": "float", "strategy": layout, "symmetric": True}
        if layout == "group":
            args["group_size"] = 128
        qc = {"quant_method": "compressed-tensors", "format": "float-quantized",
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": args}}}
        scale = {"channel": torch.rand(200, 1), "group": torch.rand(200, 3),
                 "tensor": torch.rand(1)}[layout] + 0.5
        suffix = "_scale"
    src = write_checkpoint(tmp_path, {"m.weight": w, f"m.weight{suffix}": scale},
                           {"quantization_config": qc})
    source = open_source(src)
    full = source.read("m.weight")
    for start, stop in [(0, 1), (127, 129), (130, 200), (199, 200)]:
        assert torch.equal(source.read_rows("m.weight", start, stop), full[start:stop])


def test_tensor_in_shard_but_not_in_index_is_an_error(tmp_path):
    src = write_checkpoint(tmp_path, {"a.weight": torch.ones(2, 2), "model.norm.weight": torch.ones(2)}, {})
    idx = json.loads((src / "model.safetensors.index.json").read_text())
    del idx["weight_map"]["model.norm.weight"]
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(SourceError, match=r"model.norm.weight \(in model-00001-of-00001.safetensors, not listed in the index\)"):
        open_source(src)


def test_hub_cache_snapshot_links_are_followed(tmp_path):
    """huggingface_hub's cache: snapshots/<commit>/<file> -> ../../blobs/<hash>."""
    repo = tmp_path / "models--org--m"
    plain = write_checkpoint(tmp_path / "plain", {"a.weight": torch.ones(4, 16), "b.weight": torch.ones(2)}, {},
                             n_shards=2)
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(plain.iterdir())):
        blob = repo / "blobs" / f"h{i}"
        blob.write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(Path("../../blobs") / blob.name)
    assert torch.equal(open_source(snap).read("a.weight"), torch.ones(4, 16))
    # a link leaving the repo's cache folder is still refused
    (snap / "model-00002-of-00002.safetensors").unlink()
    (snap / "model-00002-of-00002.safetensors").symlink_to(plain / "model-00002-of-00002.safetensors")
    with pytest.raises(SourceError, match="a link leading outside the source folder"):
        open_source(snap)


def test_recipe_bad_regex_named():
    from quantize.base.errors import RecipeError
    from quantize.plan.recipe import Rule, Target
    with pytest.raises(RecipeError, match=r"recipe rule match 're:\(\(' is not a valid regex"):
        Rule("re:((", Target.NVFP4)
