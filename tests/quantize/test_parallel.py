"""Fast kernels, worker processes and torchrun ranks all write the single-process build's bytes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from formats.checkpoint import INDEX_NAME
from quantize.errors import OutputError
from quantize.kernels.fused import _has_cxx, _has_triton
from quantize.manifest import MANIFEST_NAME
from quantize.parallel import assign_shards
from quantize.pipeline import convert
from test_pipeline import moe_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def assert_same_build(a: Path, b: Path) -> None:
    """Every file byte-identical; the manifest equal except for the output-independent source
    path (both builds read the same source)."""
    assert sorted(os.listdir(a)) == sorted(os.listdir(b))
    for p in sorted(a.iterdir()):
        if p.name == MANIFEST_NAME:
            x, y = json.loads(p.read_text()), json.loads((b / p.name).read_text())
            assert x == y
        else:
            assert p.read_bytes() == (b / p.name).read_bytes(), p.name


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("par")
    src = moe_checkpoint(tmp)
    clean = tmp / "clean"
    convert(src, clean, progress=False, device="cpu", kernel="reference")
    return src, clean


def test_assign_shards_balanced_and_complete():
    sizes = {"a": 100, "b": 90, "c": 50, "d": 40, "e": 10}
    ranks = assign_shards(sizes, 2)
    assert ranks == [["a", "d", "e"], ["b", "c"]]  # 150 / 140
    assert sorted(sum(ranks, [])) == sorted(sizes)
    assert assign_shards(sizes, 1) == [sorted(sizes)]
    assert assign_shards({"a": 1}, 3) == [["a"], [], []]


@pytest.mark.skipif(not _has_cxx(), reason="inductor needs a C++ compiler")
def test_inductor_build_is_the_reference_build(moe, tmp_path):
    src, clean = moe
    convert(src, tmp_path / "fast", progress=False, device="cpu", kernel="inductor")
    assert_same_build(clean, tmp_path / "fast")


def test_two_workers_write_the_single_process_build(moe, tmp_path):
    src, clean = moe
    s = convert(src, tmp_path / "w2", progress=False, device="cpu", kernel="reference", workers=2)
    assert s.shards_written == 4 and s.shards_skipped == 0
    assert s.elements_quantized > 0 and s.tensors_by_target["nvfp4"] > 0
    assert_same_build(clean, tmp_path / "w2")


def test_torchrun_gloo_two_ranks_write_the_single_process_build(moe, tmp_path):
    src, clean = moe
    out = tmp_path / "tr"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "2", "-m", "quantize.cli", "nvfp4", "--src", str(src),
                        "--out", str(out), "--device", "cpu", "--kernel", "reference", "--quiet"],
                       capture_output=True, text=True, cwd=ROOT, timeout=600,
                       env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("wrote ") == 1  # rank 0 reports, rank 1 stays quiet
    assert_same_build(clean, out)


def test_failed_rank_stops_all_then_resume_with_other_rank_count(moe, tmp_path):
    """One rank cannot write its shard: every rank raises, finished shards stay in the per-rank
    ledgers, and a resume with one process completes the identical build."""
    src, clean = moe
    out = tmp_path / "o"
    out.mkdir()
    blocker = out / "model-00003-of-00004.safetensors"
    blocker.mkdir()  # a directory where a shard must go: its rename fails
    with pytest.raises(OutputError, match="cannot write shard model-00003-of-00004"):
        convert(src, out, progress=False, device="cpu", kernel="reference", workers=2,
                resume=True)
    ledgers = sorted(p.name for p in out.glob(".spark-quant-progress*"))
    assert ledgers == [".spark-quant-progress.rank0.json", ".spark-quant-progress.rank1.json"]
    done = {}
    for name in ledgers:
        done.update(json.loads((out / name).read_text())["shards"])
    assert "model-00003-of-00004.safetensors" not in done and len(done) >= 1
    assert not (out / INDEX_NAME).exists() and not (out / MANIFEST_NAME).exists()
    blocker.rmdir()
    s = convert(src, out, progress=False, device="cpu", kernel="reference", resume=True)
    assert s.shards_skipped == len(done) and s.shards_written == 4 - len(done)
    assert_same_build(clean, out)


@pytest.mark.skipif(not (torch.cuda.is_available() and _has_triton()),
                    reason="needs a CUDA device and triton")
@pytest.mark.parametrize("kernel", ["triton", "reference"])
def test_cuda_build_is_the_cpu_reference_build(moe, tmp_path, kernel):
    src, clean = moe
    convert(src, tmp_path / kernel, progress=False, device="cuda", kernel=kernel)
    assert_same_build(clean, tmp_path / kernel)
