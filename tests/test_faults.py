"""Fault injection: each way a conversion can go wrong, and exactly what the user sees.

Every fault runs through the ``quantize`` command (``quantize.cli.main``) on a tiny 3-shard
block-FP8 checkpoint and asserts the exact message, that nothing that looks complete is left
behind, and, for faults that strike mid-run, that ``--resume`` after fixing the cause gives a
build byte-identical to an uninterrupted one. ``pytest -s`` prints each message.
"""

import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import BLOCK_FP8_QC, edit_json, edit_shard, write_checkpoint
from safetensors.torch import load_file

from formats.checkpoint import INDEX_NAME
from formats.manifest import CHECK_STATS_NAME, MANIFEST_NAME, PROGRESS_NAME
from formats.shards import read_header
from quantize.cli import main
from quantize.convert.pipeline import convert
from quantize.kernels.fp8 import quantize_fp8_block

REPO = Path(__file__).resolve().parents[1]
S1, S2, S3 = (f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3))


SHOW = {"on": False}


@pytest.fixture(autouse=True)
def _show_with_s(request):
    SHOW["on"] = request.config.getoption("capture") == "no"


def run(capsys, *args) -> tuple[int, str]:
    """Run the quantize command; returns (exit code, stderr); with ``pytest -s`` also prints
    what the user saw."""
    rc = main([str(a) for a in args])
    err = capsys.readouterr().err
    if SHOW["on"]:
        with capsys.disabled():
            print(f"\n--- quantize {args[0]}: exit {rc}\n{err}", end="")
    return rc, err


def nvfp4(capsys, src, out, *extra):
    return run(capsys, "nvfp4", "--src", src, "--out", out, "--quiet", "--device", "cpu", *extra)


def rewrite_header(path, fn):
    """Apply ``fn`` to the parsed header JSON of a shard and write it back, data untouched."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    fn(header)
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + raw[8 + n:])


def stops_then_resumes(capsys, src: Path, out: Path, clean: Path, first: str, done: int,
                       fix) -> None:
    """The run stops with a line starting ``first`` and the resume hint, leaving nothing that
    looks finished; after ``fix()``, ``--resume`` gives the uninterrupted build, byte for byte."""
    rc, err = nvfp4(capsys, src, out)
    lines = err.splitlines()
    assert rc == 1 and len(lines) == 2 and lines[0].startswith(first), err
    assert lines[1] == (f"{done} output shard(s) are finished in {out}; fix the cause and rerun "
                        "the same command with --resume to continue")
    assert not (out / MANIFEST_NAME).exists() and not (out / INDEX_NAME).exists()
    fix()
    assert nvfp4(capsys, src, out, "--resume")[0] == 0
    assert_same_build(clean, out)


def assert_same_build(a: Path, b: Path) -> None:
    """Byte-identical folders (the manifest too: it holds no timestamps or output path), but
    the local check statistics (identities of each folder's own files)."""
    assert sorted(set(os.listdir(a)) - {CHECK_STATS_NAME}) == sorted(set(os.listdir(b)) - {CHECK_STATS_NAME})
    for p in sorted(q for q in a.iterdir() if q.name != CHECK_STATS_NAME):
        assert p.read_bytes() == (b / p.name).read_bytes(), p.name


@pytest.fixture
def clean(tiny_fp8_llama, tmp_path):
    out = tmp_path / "clean"
    convert(tiny_fp8_llama, out, progress=False, device="cpu")
    return out


# ---- source faults: found by pre-flight, before anything is written ------------------------

def _truncate(src):
    (src / S2).write_bytes((src / S2).read_bytes()[:-100])


def _garble_header(src):
    raw = bytearray((src / S1).read_bytes())
    raw[8:20] = b"\xff" * 12
    (src / S1).write_bytes(bytes(raw))


def _overlap(src):
    def fn(h):
        h["model.norm.weight"]["data_offsets"] = h["model.layers.1.post_attention_layernorm.weight"]["data_offsets"]
    rewrite_header(src / S1, fn)


def _absurd_shape(src):
    rewrite_header(src / S1, lambda h: h["model.norm.weight"].update(shape=[2**40, 2**40]))


def _index_tensor(src):
    edit_json(src / INDEX_NAME, lambda d: d["weight_map"].update({"mtp.fc.weight": S2}))


def _index_file(src):
    edit_json(src / INDEX_NAME, lambda d: d["weight_map"].update(
        {"model.layers.2.mlp.up_proj.weight": "model-00004-of-00003.safetensors"}))


def _missing_scale(src):
    name = "model.layers.0.mlp.down_proj.weight_scale_inv"
    edit_shard(src / S3, lambda t: t.pop(name))
    edit_json(src / INDEX_NAME, lambda d: d["weight_map"].pop(name))


def _orphan_scale(src):
    edit_shard(src / S1, lambda t: t.update({"model.layers.0.mlp.extra.weight_scale_inv": torch.ones(1, 1)}))
    edit_json(src / INDEX_NAME, lambda d: d["weight_map"].update({"model.layers.0.mlp.extra.weight_scale_inv": S1}))


def _int_scale(src):
    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    edit_shard(src / S1, lambda t: t.update({name: t[name].to(torch.int32)}))


def _nan_scale(src):
    edit_shard(src / S1, lambda t: t["model.layers.0.self_attn.o_proj.weight_scale_inv"].fill_(float("nan")))


def _huge_scale(src):
    edit_shard(src / S1, lambda t: t["model.layers.0.self_attn.o_proj.weight_scale_inv"].fill_(1e30))


def _layers(src):
    edit_json(src / "config.json", lambda c: c.update(num_hidden_layers=3))


def _bad_config(src):
    (src / "config.json").write_text('{"model_type": "llama",')


def _gptq(src):
    edit_json(src / "config.json", lambda c: c.update(quantization_config={"quant_method": "gptq"}))


def _dotdot(src):
    edit_json(src / INDEX_NAME, lambda d: d["weight_map"].update({"lm_head.weight": "../x.safetensors"}))


def _absolute(src):
    edit_json(src / INDEX_NAME, lambda d: d["weight_map"].update({"lm_head.weight": "/etc/passwd"}))


def _link_out(src):
    target = src.parent / "outside.safetensors"
    shutil.move(src / S2, target)
    (src / S2).symlink_to(target)


def _pickle_only(src):
    for p in src.glob("*.safetensors*"):
        p.unlink()
    (src / "pytorch_model.bin").write_bytes(b"\x80\x04N.")


SOURCE_FAULTS = [
    ("truncated shard", _truncate,
     f"error: [header] shard {S2}: tensor model.layers.1.self_attn.v_proj.weight declares bytes "
     "[22676, 24724) but needs 2048 inside a data section of 24624 bytes (truncated or corrupt)"),
    ("corrupted header", _garble_header,
     f"error: [header] shard {S1}: header is not valid JSON ('utf-8' codec can't decode byte 0xff "
     "in position 0: invalid start byte)"),
    ("overlapping offsets", _overlap,
     f"error: [header] shard {S1}: tensors model.layers.1.post_attention_layernorm.weight and "
     "model.norm.weight overlap"),
    ("header declares 2^80 elements", _absurd_shape,
     f"error: [header] shard {S1}: tensor model.norm.weight declares bytes [32908, 33036) but "
     "needs 2417851639229258349412352 inside a data section of 65804 bytes (truncated or corrupt)"),
    ("index names a missing tensor", _index_tensor,
     f"error: [index] mtp.fc.weight (index says {S2}) is not in that shard's header"),
    ("index names a missing file", _index_file,
     "error: [index] index names shard files that are missing or empty: "
     "model-00004-of-00003.safetensors"),
    ("missing scale", _missing_scale,
     f"error: [fp8] FP8 weight model.layers.0.mlp.down_proj.weight in {S1} has no "
     "model.layers.0.mlp.down_proj.weight_scale_inv"),
    ("orphan scale", _orphan_scale,
     f"error: [fp8] orphan scale model.layers.0.mlp.extra.weight_scale_inv in {S1}: no weight "
     "model.layers.0.mlp.extra.weight"),
    ("int32 scales", _int_scale,
     f"error: [fp8] scale model.layers.0.self_attn.o_proj.weight_scale_inv in {S1} has dtype I32; "
     "expected F32, BF16, F16 or F8_E8M0"),
    ("NaN scale", _nan_scale,
     f"error: [scale] scale model.layers.0.self_attn.o_proj.weight_scale_inv in {S1} has 1 NaN/Inf "
     "value(s) (first at flat index 0); model.layers.0.self_attn.o_proj.weight cannot be "
     "dequantized"),
    ("absurd scale", _huge_scale,
     f"error: [scale] scale model.layers.0.self_attn.o_proj.weight_scale_inv in {S1} has max 1e+30, "
     "so |model.layers.0.self_attn.o_proj.weight| may reach 4.48e+32, beyond 65504 (the float16 "
     "range, which no trained weight exceeds): a corrupt scale"),
    ("config vs index layers", _layers,
     "error: [layout] config.json declares num_hidden_layers=3 but the checkpoint has no tensors "
     "for layer(s) 2"),
    ("config.json corrupt", _bad_config,
     "error: [config] config.json is not valid JSON: Expecting property name enclosed in double "
     "quotes: line 1 column 24 (char 23)"),
    ("unsupported source format", _gptq,
     "error: [config] source quant_method 'gptq' is not supported (fp8, compressed-tensors "
     "float-quantized, or unquantized)"),
    ("index path ../", _dotdot,
     "error: [index] model.safetensors.index.json names '../x.safetensors', which is not a file "
     "inside the source folder"),
    ("index absolute path", _absolute,
     "error: [index] model.safetensors.index.json names '/etc/passwd', which is not a file inside "
     "the source folder"),
    ("symlink leading out", _link_out,
     f"error: [index] model.safetensors.index.json names '{S2}', a link leading outside the "
     "source folder"),
    ("pickle-only source", _pickle_only,
     "error: [index] {src} has no model.safetensors.index.json or model.safetensors (found "
     "pickled weights ['pytorch_model.bin'], which are never loaded)"),
]


@pytest.mark.parametrize("fault,mutate,line", SOURCE_FAULTS, ids=[f[0] for f in SOURCE_FAULTS])
def test_source_fault_refused_before_writing(tmp_path, tiny_fp8_llama, capsys, fault, mutate, line):
    mutate(tiny_fp8_llama)
    rc, err = nvfp4(capsys, tiny_fp8_llama, tmp_path / "out")
    assert rc == 1
    assert err.splitlines()[0] == "error: 1 problem(s) in src:"
    assert err.splitlines()[1] == line.format(src=tiny_fp8_llama)
    assert not (tmp_path / "out").exists()  # pre-flight writes nothing


# ---- data faults: found while converting ---------------------------------------------------

def test_nan_weight_mid_run_stops_and_resumes(tmp_path, tiny_fp8_llama, clean, capsys):
    name = "model.layers.1.mlp.up_proj.weight"  # FP8 in shard 2: shard 1 is finished first
    good = (tiny_fp8_llama / S2).read_bytes()
    edit_shard(tiny_fp8_llama / S2, lambda t: t[name].view(torch.uint8)[3, :2].fill_(0x7F))
    stops_then_resumes(
        capsys, tiny_fp8_llama, tmp_path / "out", clean,
        f"error: tensor {name} in shard {S2} has 2 NaN/Inf values after dequantization; refusing "
        "to write a silent NaN", 1, lambda: (tiny_fp8_llama / S2).write_bytes(good))


def test_inf_in_a_kept_norm_is_refused(tmp_path, tiny_fp8_llama, capsys):
    edit_shard(tiny_fp8_llama / S1, lambda t: t["model.norm.weight"].__setitem__(5, float("inf")))
    rc, err = nvfp4(capsys, tiny_fp8_llama, tmp_path / "out")
    assert (rc, err.splitlines()[0]) == (1, (
        f"error: tensor model.norm.weight in shard {S1} has 1 NaN/Inf values; refusing to write "
        "a silent NaN"))


def test_absurd_amax_in_dense_weight_is_refused(tmp_path, capsys):
    w = torch.randn(32, 64) * 0.02
    w[7, 7] = 3.0e6
    src = write_checkpoint(tmp_path / "src", {"model.layers.0.mlp.down_proj.weight": w}, {})
    rc, err = nvfp4(capsys, src, tmp_path / "out")
    assert (rc, err.splitlines()[0]) == (1, (
        "error: tensor model.layers.0.mlp.down_proj.weight in shard "
        "model-00001-of-00001.safetensors has amax 3e+06, outside [7.9e-36, 65504] where an NVFP4 "
        "global scale 2688/amax is meaningful: a corrupt weight. To carry it unquantized instead, "
        "add a recipe rule matching model.layers.0.mlp.down_proj with target bf16"))


def test_all_zero_weight_written_as_exact_zeros_and_reported(tmp_path, tiny_fp8_llama, capsys):
    name = "model.layers.1.mlp.down_proj.weight"  # in no fused group: its own global scale
    edit_shard(tiny_fp8_llama / S1, lambda t: t[name].view(torch.uint8).zero_())
    out = tmp_path / "out"
    assert main(["nvfp4", "--src", str(tiny_fp8_llama), "--out", str(out), "--quiet"]) == 0
    report = capsys.readouterr().out
    print(report)
    note = (f"  note: 1 all-zero weight(s) written as exact zeros (NVFP4: all codes 0, block "
            f"scales 0.125; global scale 1.0 unless shared with a fused group): {name}")
    assert note in report.splitlines()
    t = load_file(str(out / S1))
    m = name[: -len(".weight")]
    assert t[f"{m}.weight_global_scale"].item() == 1.0
    assert torch.all(t[f"{m}.weight_packed"] == 0)
    assert torch.all(t[f"{m}.weight_scale"].float() == 0.125)
    assert note[len("  note: "):] in json.loads((out / MANIFEST_NAME).read_text())["summary"]["notes"]


def test_bf16_scales_give_the_same_build_as_f32_scales(tmp_path, capsys):
    """Block-FP8 releases exist with bf16 ``weight_scale_inv``: accepted, and the NVFP4 bytes
    equal those from the same (bf16-representable) scales stored as f32."""
    g = torch.Generator().manual_seed(3)
    w, s = quantize_fp8_block(torch.randn(256, 256, generator=g) * 0.03)
    s32 = s.to(torch.bfloat16).float()
    cfg = {"quantization_config": BLOCK_FP8_QC}
    a = write_checkpoint(tmp_path / "a", {"m.down_proj.weight": w, "m.down_proj.weight_scale_inv": s32}, cfg)
    b = write_checkpoint(tmp_path / "b", {"m.down_proj.weight": w,
                                          "m.down_proj.weight_scale_inv": s32.bfloat16()}, cfg)
    assert read_header(b / "model-00001-of-00001.safetensors")["m.down_proj.weight_scale_inv"].dtype == "BF16"
    convert(a, tmp_path / "oa", progress=False)
    convert(b, tmp_path / "ob", progress=False)
    shard = "model-00001-of-00001.safetensors"
    assert (tmp_path / "oa" / shard).read_bytes() == (tmp_path / "ob" / shard).read_bytes()


# ---- output faults ---------------------------------------------------------------------------

def test_output_not_empty_or_inside_source(tmp_path, tiny_fp8_llama, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    rc, err = nvfp4(capsys, tiny_fp8_llama, out)
    assert (rc, err.splitlines()[1]) == (1, (
        f"error: [output] output folder {out} is not empty; choose another --out"))
    rc, err = nvfp4(capsys, tiny_fp8_llama, out, "--resume")
    assert (rc, err.splitlines()[1]) == (1, (
        f"error: [output] --resume: {out} holds no spark-quant build (no {PROGRESS_NAME} or "
        f"{MANIFEST_NAME}); refusing to write into it"))
    rc, err = nvfp4(capsys, tiny_fp8_llama, tiny_fp8_llama / "nvfp4")
    assert (rc, err.splitlines()[1]) == (1, (
        f"error: [output] --out {tiny_fp8_llama / 'nvfp4'} is the source folder or inside it; "
        "choose a folder outside the source"))
    assert (out / "keep.txt").read_text() == "mine" and not (tiny_fp8_llama / "nvfp4").exists()


@pytest.fixture
def tmpfs(tmp_path):
    """Mount small tmpfs file systems (root only); unmounted afterwards."""
    mounted = []

    def mount(name: str, size: int, *opts: str) -> Path:
        if shutil.which("mount") is None:
            pytest.skip("no mount command here; disk-full and read-only tests need one (and root)")
        point = tmp_path / name
        point.mkdir()
        o = ",".join([f"size={size}", *opts])
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", o, "tmpfs", str(point)],
                             capture_output=True, text=True)
        if res.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({res.stderr.strip() or res.returncode}); "
                        "disk-full and read-only tests need root")
        mounted.append(point)
        return point

    yield mount
    for point in reversed(mounted):
        subprocess.run(["umount", "-l", str(point)], capture_output=True)


def remount(point: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(point)], check=True)


def test_read_only_output_refused_up_front(tmp_path, tiny_fp8_llama, tmpfs, capsys):
    fs = tmpfs("ro", 1 << 20, "ro")
    rc, err = nvfp4(capsys, tiny_fp8_llama, fs / "out")
    assert (rc, err.splitlines()[1]) == (1, (
        f"error: [output] output folder {fs / 'out'} is not writable ({fs}: Read-only file system)"))
    remount(fs, "rw")
    assert nvfp4(capsys, tiny_fp8_llama, fs / "out")[0] == 0


def test_free_space_counts_carried_files(tmp_path, tiny_fp8_llama, tmpfs, capsys):
    """A disk that holds the tensors (a 1 MiB tmpfs does, test_output_turns_read_only...) but
    not a 2 MiB tokenizer.json carried beside them is refused up front (issue 19 item 7)."""
    fs = tmpfs("tok", 1 << 20)
    (tiny_fp8_llama / "tokenizer.json").write_bytes(b"{" + b" " * (2 << 20) + b"}")
    rc, err = nvfp4(capsys, tiny_fp8_llama, fs / "out")
    line = err.splitlines()[1]
    assert rc == 1 and line.startswith(
        f"error: [output] not enough free disk on the filesystem of {fs}: need 2.") and line.endswith(
        "free 1.0 MiB. Free some space, choose another --out, or point HF_HOME (the download "
        "cache) at another disk."), err
    assert not (fs / "out").exists()


def test_too_little_space_refused_up_front(tmp_path, tiny_fp8_llama, tmpfs, capsys):
    fs = tmpfs("small", 64 << 10)
    rc, err = nvfp4(capsys, tiny_fp8_llama, fs / "out")
    assert rc == 1
    line = err.splitlines()[1]
    assert line.startswith(f"error: [output] not enough free disk on the filesystem of {fs}: "
                           "need ") and line.endswith(
        "free 64.0 KiB. Free some space, choose another --out, or point HF_HOME (the download "
        "cache) at another disk.")


def _failing_on_second_shard(monkeypatch, action):
    import quantize.convert.pipeline as pl

    real, calls = pl.write_shard_atomic, {"n": 0}

    def write(tensors, path, metadata=None, sha256=False):
        calls["n"] += 1
        if calls["n"] == 2:
            action()
        return real(tensors, path, metadata, sha256)

    monkeypatch.setattr(pl, "write_shard_atomic", write)


def test_disk_full_mid_run_then_resume(tmp_path, tiny_fp8_llama, clean, tmpfs, monkeypatch, capsys):
    fs = tmpfs("full", 512 << 10)
    ballast = fs / "ballast"

    def fill():
        with open(ballast, "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError:
                pass

    def fix():
        assert sorted(os.listdir(fs / "out")) == [PROGRESS_NAME, S1]  # no temp, no partial file
        monkeypatch.undo()
        ballast.unlink()

    _failing_on_second_shard(monkeypatch, fill)
    stops_then_resumes(
        capsys, tiny_fp8_llama, fs / "out", clean,
        f"error: cannot write shard {S2} in {fs / 'out'}: Error while serializing: I/O error: No "
        "space left on device (os error 28)", 1, fix)


def test_output_turns_read_only_mid_run_then_resume(tmp_path, tiny_fp8_llama, clean, tmpfs,
                                                     monkeypatch, capsys):
    fs = tmpfs("flip", 1 << 20)
    _failing_on_second_shard(monkeypatch, lambda: remount(fs, "ro"))
    stops_then_resumes(
        capsys, tiny_fp8_llama, fs / "out", clean,
        f"error: cannot write shard {S2} in {fs / 'out'}: Error while serializing: I/O error: "
        "Read-only file system (os error 30)", 1,
        lambda: (monkeypatch.undo(), remount(fs, "rw")))


def test_source_shard_truncated_mid_run_then_resume(tmp_path, tiny_fp8_llama, clean, monkeypatch,
                                                    capsys):
    """S3 is truncated while the writer holds shard 2 and the reader, having opened S3 for its
    own tensors, has not read one yet. The reader thread runs ahead of the writer (it queues
    finished tensors) and reads S3 earlier for scales of S1 and S2, so the two threads are put
    in this order by events (no sleeps, no timing): the reader waits for the truncation before
    its first read of S3's own tensors, the writer for the reader to have reached them."""
    import threading

    from formats.shards import ShardReader
    from formats.sources import Source

    good = (tiny_fp8_llama / S3).read_bytes()
    at_s3, truncated, current = threading.Event(), threading.Event(), {"shard": None}
    real_get, real_stream = ShardReader.get, Source.stream

    def stream(self, shards=None, partners=None):
        for shard in real_stream(self, shards, partners):
            current["shard"] = shard
            yield shard

    def get(self, shard, name, rows=None):
        if shard == S3 == current["shard"] and threading.current_thread().name == "read":
            self._handle(shard)  # S3's header and size are read before the truncation
            at_s3.set()
            assert truncated.wait(120), "the writer never took shard 2"
        return real_get(self, shard, name, rows)

    def truncate():
        assert at_s3.wait(120), f"the reader never reached the tensors of {S3}"
        os.truncate(tiny_fp8_llama / S3, 5000)
        truncated.set()

    monkeypatch.setattr(Source, "stream", stream)
    monkeypatch.setattr(ShardReader, "get", get)
    _failing_on_second_shard(monkeypatch, truncate)
    stops_then_resumes(
        capsys, tiny_fp8_llama, tmp_path / "out", clean,
        f"error: shard {S3} changed while it was being read ({len(good)} -> 5000 bytes): truncated "
        "or replaced during the run; restore it and rerun with --resume", 2,
        lambda: (monkeypatch.undo(), (tiny_fp8_llama / S3).write_bytes(good)))


def test_source_shard_rewritten_after_preflight_then_resume(tmp_path, tiny_fp8_llama, clean,
                                                            monkeypatch, capsys):
    """Same size, other bytes, before the reader ever opened it (a re-download or an editor
    between pre-flight and the read): refused by the (size, mtime) pre-flight saw, not
    converted silently."""
    import quantize.convert.pipeline as pl

    path, good = tiny_fp8_llama / S3, (tiny_fp8_llama / S3).read_bytes()
    st = path.stat()
    real = pl._prepare_out

    def prepare(out, resume):  # after pre-flight, before any shard is read
        real(out, resume)
        bad = bytearray(good)
        bad[-1] ^= 0x01
        path.write_bytes(bytes(bad))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))

    def fix():
        monkeypatch.undo()
        path.write_bytes(good)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))

    monkeypatch.setattr(pl, "_prepare_out", prepare)
    stops_then_resumes(
        capsys, tiny_fp8_llama, tmp_path / "out", clean,
        f"error: shard {S3} changed since pre-flight read its header ({len(good)} -> {len(good)} "
        "bytes, modification time changed: True): truncated or replaced during the run; restore "
        "it and rerun with --resume", 0, fix)


def test_ctrl_c_corrupt_ledger_and_damaged_finished_shard(tmp_path, tiny_fp8_llama, clean,
                                                          monkeypatch, capsys):
    out = tmp_path / "out"

    def interrupt():
        raise KeyboardInterrupt

    _failing_on_second_shard(monkeypatch, interrupt)
    rc, err = nvfp4(capsys, tiny_fp8_llama, out)
    assert (rc, err.splitlines()) == (130, [
        f"interrupted: 1 output shard(s) are finished in {out}; fix the cause and rerun the same "
        "command with --resume to continue"])
    monkeypatch.undo()
    ledger = (out / PROGRESS_NAME).read_text()
    (out / PROGRESS_NAME).write_text("{not json")
    rc, err = nvfp4(capsys, tiny_fp8_llama, out, "--resume")
    assert (rc, err.splitlines()[0]) == (1, (
        f"error: resume ledger {out / PROGRESS_NAME} is corrupt (Expecting property name "
        "enclosed in double quotes: line 1 column 2 (char 1)); delete it to start this build "
        "over"))
    (out / PROGRESS_NAME).write_text(ledger)
    data = bytearray((out / S1).read_bytes())
    data[-3] ^= 0xFF  # a finished shard damaged on disk is redone, not trusted
    (out / S1).write_bytes(bytes(data))
    summary = convert(tiny_fp8_llama, out, progress=False, device="cpu", resume=True)
    assert (summary.shards_skipped, summary.shards_written) == (0, 3)
    assert_same_build(clean, out)


# ---- kill -9 at random points, then --resume ------------------------------------------------

# The child stops itself (SIGSTOP) just before its k-th os.replace, i.e. with a temp file
# fully written and not yet renamed; the parent then sends SIGKILL. No hook in the product.
CHILD = """
import os, signal, sys
from quantize.convert.pipeline import convert
k, calls, real = int(sys.argv[3]), [0], os.replace
def replace(a, b):
    calls[0] += 1
    if calls[0] == k:
        os.kill(os.getpid(), signal.SIGSTOP)
    return real(a, b)
os.replace = replace
convert(sys.argv[1], sys.argv[2], progress=False, device="cpu")
"""
N_REPLACES = 12  # ledger, 3 x (shard + ledger), index, tokenizer_config.json, config, check stats, manifest
KILL_POINTS = sorted(random.Random(9).sample(range(1, N_REPLACES + 1), 5))


@pytest.mark.parametrize("k", KILL_POINTS)
def test_kill_9_then_resume_is_byte_identical(tmp_path, tiny_fp8_llama, clean, k):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(tiny_fp8_llama), str(out), str(k)],
                         cwd=REPO, env=env, stderr=subprocess.PIPE)
    _, status = os.waitpid(p.pid, os.WUNTRACED)
    assert os.WIFSTOPPED(status), f"kill point {k} not reached: {p.stderr.read().decode()}"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    p.stderr.close()
    assert not (out / MANIFEST_NAME).exists()
    for f in out.iterdir():  # nothing half-written looks complete: each file is final or temp
        if f.suffix == ".tmp":
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])  # as if killed mid-write
        elif f.name not in (PROGRESS_NAME, CHECK_STATS_NAME):
            assert f.read_bytes() == (clean / f.name).read_bytes(), f.name
    (out / ".tmpK9x2Qa").write_bytes(b"\0" * 999)  # what a kill inside safetensors' save_file leaves
    done = len(json.loads((out / PROGRESS_NAME).read_text())["shards"]) if (out / PROGRESS_NAME).exists() else 0
    summary = convert(tiny_fp8_llama, out, progress=False, device="cpu", resume=True)
    assert summary.shards_skipped == done
    assert_same_build(clean, out)


# ---- hostile input: custom code and tokens ---------------------------------------------------

def test_custom_code_is_copied_and_never_executed(tmp_path, tiny_fp8_llama, capsys):
    marker = tmp_path / "executed"
    payload = f"open({str(marker)!r}, 'w').write('ran')\n"
    (tiny_fp8_llama / "modeling_evil.py").write_text(payload + "class EvilForCausalLM: pass\n")
    (tiny_fp8_llama / "configuration_evil.py").write_text(payload + "class EvilConfig: pass\n")
    edit_json(tiny_fp8_llama / "config.json", lambda c: c.update(auto_map={
        "AutoConfig": "configuration_evil.EvilConfig",
        "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}))
    out = tmp_path / "out"
    assert main(["nvfp4", "--src", str(tiny_fp8_llama), "--out", str(out), "--quiet"]) == 0
    report = capsys.readouterr().out
    print(report)
    assert ("  note: info: custom code (configuration_evil.py, modeling_evil.py) is copied as files "
            "and never executed; nothing here imports it unless --trust-remote-code is passed to "
            "a command that loads the model") in report.splitlines()
    for f in ("modeling_evil.py", "configuration_evil.py"):
        assert (out / f).read_bytes() == (tiny_fp8_llama / f).read_bytes()
    from eval.models import load_build_model

    load_build_model(out)  # evaluation loads the build with transformers' own Llama classes
    assert not marker.exists()


def test_tokens_never_reach_console_manifest_or_files(tmp_path, tiny_fp8_llama, monkeypatch, capsys):
    token = "hf_" + "Zq81kLmN0pQrStUv" * 2
    monkeypatch.setenv("HF_TOKEN", token)
    rc, err = run(capsys, "nvfp4", "--src", f"/nonexistent/{token}", "--out", tmp_path / "x")
    assert (rc, err) == (1, "error: --src /nonexistent/***: no such folder\n")
    out = tmp_path / "out"
    convert(tiny_fp8_llama, out, progress=False, source_info={
        "repo": f"https://user:{token}@huggingface.co/org/model", "note": f"Bearer {token}"})
    man = json.loads((out / MANIFEST_NAME).read_text())
    assert man["source"]["repo"] == "https://user:***@huggingface.co/org/model"
    assert man["source"]["note"] == "Bearer ***"
    for f in out.rglob("*"):
        assert token.encode() not in f.read_bytes(), f.name
    import logging

    import quantize.convert.pipeline as pl

    def chatty(*a, **k):
        log = logging.getLogger("spark_quant.test")
        log.addHandler(logging.StreamHandler())  # a library handler on the console stream
        log.propagate = False
        log.warning("GET /api with Authorization: Bearer %s", token)
        print(f"token is {token}")
        raise KeyboardInterrupt

    monkeypatch.setattr(pl, "convert", chatty)
    rc = main(["nvfp4", "--src", str(tiny_fp8_llama), "--out", str(tmp_path / "y")])
    cap = capsys.readouterr()
    assert rc == 130 and token not in cap.out + cap.err
    assert "token is ***" in cap.out and "Authorization: Bearer ***" in cap.err
