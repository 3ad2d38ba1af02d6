"""Index checks against hostile repos: paths out of the folder, links, pickles, carried files."""

import json
import os
import pickle

import pytest
import torch
from conftest import write_checkpoint

from formats.checkpoint import (
    INDEX_NAME,
    carry_files,
    carry_plan,
    load_index,
    scan_index,
)
from formats.sources import open_source
from quantize.base.errors import OutputError, SourceError


def with_index_entry(src, value):
    idx = json.loads((src / INDEX_NAME).read_text())
    idx["weight_map"]["a.weight"] = value
    (src / INDEX_NAME).write_text(json.dumps(idx))
    return src


@pytest.mark.parametrize("value,message", [
    ("../evil.safetensors", "names '../evil.safetensors', which is not a file inside the source folder"),
    ("/etc/passwd", "names '/etc/passwd', which is not a file inside the source folder"),
    ("sub/../../x.safetensors", "which is not a file inside the source folder"),
    (7, "names 7, which is not a file name"),
])
def test_index_entries_outside_the_folder_refused(tmp_path, value, message):
    src = with_index_entry(write_checkpoint(tmp_path / "s", {"a.weight": torch.ones(2, 2)}, {}), value)
    with pytest.raises(SourceError, match=message):
        load_index(src)


def test_symlink_leading_out_refused(tmp_path):
    outside = write_checkpoint(tmp_path / "elsewhere", {"a.weight": torch.ones(2, 2)}, {})
    src = tmp_path / "s"
    src.mkdir()
    (src / "model-00001-of-00001.safetensors").symlink_to(outside / "model-00001-of-00001.safetensors")
    (src / INDEX_NAME).write_text((outside / INDEX_NAME).read_text())
    (src / "config.json").write_text("{}")
    with pytest.raises(SourceError, match="names 'model-00001-of-00001.safetensors', a link "
                                          "leading outside the source folder"):
        open_source(src)


def test_hf_cache_snapshot_links_into_blobs_accepted(tmp_path):
    """huggingface_hub's cache: snapshots/<rev>/<file> are links to ../../blobs/<sha>."""
    flat = write_checkpoint(tmp_path / "flat", {"a.weight": torch.ones(2, 2)}, {})
    repo = tmp_path / "models--org--name"
    snap, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for f in flat.iterdir():
        (blobs / f"blob-{f.name}").write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(os.path.relpath(blobs / f"blob-{f.name}", snap))
    source = open_source(snap)
    assert torch.equal(source.read("a.weight"), torch.ones(2, 2))


def test_every_index_problem_reported_at_once(tmp_path):
    src = write_checkpoint(tmp_path / "s", {f"t{i}.weight": torch.ones(2, 2) for i in range(4)},
                           {}, n_shards=4)
    idx = json.loads((src / INDEX_NAME).read_text())
    idx["weight_map"]["t0.weight"] = "../up.safetensors"
    (src / "model-00002-of-00004.safetensors").unlink()
    (src / "model-00003-of-00004.safetensors").write_bytes(b"")
    (src / INDEX_NAME).write_text(json.dumps(idx))
    weight_map, findings, listed = scan_index(src)
    assert [f.message for f in findings] == [
        "model.safetensors.index.json names '../up.safetensors', which is not a file inside "
        "the source folder",
        "index names shard files that are missing or empty: model-00002-of-00004.safetensors, "
        "model-00003-of-00004.safetensors"]
    assert weight_map == {"t3.weight": "model-00004-of-00004.safetensors"}
    assert listed == {f"t{i}.weight" for i in range(4)}


def test_pickles_are_never_unpickled_nor_copied(tmp_path):
    """A pickle that would run code on load sits next to safetensors weights: the conversion
    ignores it (never opened), does not carry it, and says so."""
    from quantize.convert.pipeline import convert

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    src = write_checkpoint(tmp_path / "s", {"model.layers.0.mlp.down_proj.weight": torch.randn(16, 32)}, {})
    (src / "pytorch_model.bin").write_bytes(pickle.dumps(Evil()))
    summary = convert(src, tmp_path / "o", progress=False)
    assert not marker.exists()
    assert not (tmp_path / "o" / "pytorch_model.bin").exists()
    assert ("info: pickled weights pytorch_model.bin are never loaded nor copied (safetensors "
            "only)") in summary.notes


def test_carry_refuses_links_out_and_copies_code_as_files(tmp_path):
    src = write_checkpoint(tmp_path / "s", {"a.weight": torch.ones(2, 2)}, {})
    (tmp_path / "secret.txt").write_text("not yours")
    (src / "tokenizer.json").symlink_to(tmp_path / "secret.txt")
    (src / "modeling_x.py").write_text("raise SystemExit('never imported')\n")
    (src / "sub").mkdir()
    (src / "sub" / "template.jinja").write_text("{{ x }}")
    (src / "leftover.json.tmp").write_text("{")
    copied, refused = carry_plan(src, set())
    assert copied == ["config.json", "modeling_x.py", "sub/template.jinja"]
    assert refused == ["tokenizer.json is a link leading outside the source folder; not copied"]
    out = tmp_path / "o"
    carry_files(src, out, skip={"config.json"})
    assert (out / "modeling_x.py").read_bytes() == (src / "modeling_x.py").read_bytes()
    assert not (out / "tokenizer.json").exists()


def test_carry_failure_names_the_file(tmp_path, monkeypatch):
    src = write_checkpoint(tmp_path / "s", {"a.weight": torch.ones(2, 2)}, {})
    (src / "tokenizer.json").write_text("{}")

    def full(a, b):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("shutil.copyfile", full)
    with pytest.raises(OutputError, match=r"cannot copy tokenizer.json into .*No space left"):
        carry_files(src, tmp_path / "o", skip={"config.json"})
    assert not list((tmp_path / "o").glob("*.tmp"))
