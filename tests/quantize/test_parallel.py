"""Fast kernels, worker processes and torchrun ranks all write the single-process build's bytes."""

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import assert_same_build, killed_at_write
from safetensors.torch import load_file, save_file
from test_pipeline import moe_checkpoint

from formats.checkpoint import INDEX_NAME
from formats.manifest import MANIFEST_NAME
from quantize.base.errors import SourceError
from quantize.convert.parallel import (
    assign_shards,
    core_slices,
    default_workers,
    spawn_local,
    usable_cores,
    worker_env,
)
from quantize.convert.pipeline import convert
from quantize.data.fixtures import write_synthetic_fp8
from quantize.kernels.fused import _has_cxx, _has_triton

ROOT = Path(__file__).resolve().parents[2]

_CORES_AT_IMPORT = sorted(os.sched_getaffinity(0))
"""This module's cores when it was imported: in a worker process, while the worker's target
was unpickled, after torch (and its OpenMP runtime) had loaded there."""


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
    # ModelOpt's arithmetic order (scale_2) through the same compiled graphs
    for kernel in ("reference", "inductor"):
        convert(src, tmp_path / f"mo-{kernel}", progress=False, device="cpu", kernel=kernel,
                fmt="modelopt")
    assert_same_build(tmp_path / "mo-reference", tmp_path / "mo-inductor")


def test_two_workers_write_the_single_process_build(moe, tmp_path):
    src, clean = moe
    s = convert(src, tmp_path / "w2", progress=False, device="cpu", kernel="reference", workers=2)
    assert s.shards_written == 4 and s.shards_skipped == 0
    assert s.elements_quantized > 0 and s.tensors_by_target["nvfp4"] > 0
    assert_same_build(clean, tmp_path / "w2")


@pytest.mark.skipif(not _has_cxx(), reason="inductor needs a C++ compiler")
def test_two_inductor_workers_write_the_one_worker_build(moe, tmp_path):
    """The compiled kernels loaded by worker processes (compiled by rank 0, or cached by
    another thread count) write the bytes one process writes."""
    src, clean = moe
    convert(src, tmp_path / "w1", progress=False, device="cpu", kernel="inductor", workers=1)
    s = convert(src, tmp_path / "w2", progress=False, device="cpu", kernel="inductor", workers=2)
    assert s.shards_written == 4
    assert_same_build(tmp_path / "w1", tmp_path / "w2")
    assert_same_build(clean, tmp_path / "w2")


@pytest.mark.skipif(not _has_cxx(), reason="inductor needs a C++ compiler")
def test_inductor_workers_compile_nothing_after_the_warm_up(tmp_path):
    """Issue 18: the graphs a worker warms up (compiled by rank 0, loaded by the others) serve
    every expert of the release's block layout, so no worker traces a graph in its shard loop,
    where compiling in one thread would cost its share seconds; gate/up [256, 2048] have a scale
    grid 16 wide, as GLM-5.3-Flash's down_proj [6144, 2048] has."""
    src = write_synthetic_fp8(tmp_path / "src", 2, 1, hidden=2048, inter=256, fast=True)
    convert(src, tmp_path / "w1", progress=False, device="cpu", kernel="inductor")
    s = convert(src, tmp_path / "w2", progress=False, device="cpu", kernel="inductor", workers=2)
    assert s.shards_written == 2 and s.elements_quantized == 2 * 3 * 256 * 2048
    assert s.graphs_compiled == [0, 0]
    assert s.stage_cpu_seconds["shard loop (process)"] > 0
    assert_same_build(tmp_path / "w1", tmp_path / "w2")


def _worker_view() -> tuple:
    import torch as t

    return (os.environ.get("OMP_NUM_THREADS"), os.environ.get("TORCHINDUCTOR_COMPILE_THREADS"),
            t.get_num_threads(), sorted(os.sched_getaffinity(0)))


def _log_rank(log: str) -> None:
    import torch.distributed as dist

    with open(log, "a") as f:
        f.write(f"{dist.get_rank()} ")


def test_workers_own_their_cores_and_warm_in_turn(tmp_path, monkeypatch):
    """Each worker runs on its own cores with thread pools of that size (set in its
    environment before torch loads there); the parent's environment is left as it was; the
    warm-up runs on rank 0 before any other rank starts it."""
    import functools

    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    cores = usable_cores()
    workers = min(2, len(cores))
    log = tmp_path / "log"
    log.write_text("")
    got = spawn_local(workers, _worker_view, {}, warm=functools.partial(_log_rank, str(log)))
    per = len(cores) // workers
    assert got == (str(per), "1", per, cores[:per])  # rank 0's view
    assert log.read_text().split()[0] == "0" and sorted(log.read_text().split()) == [
        str(r) for r in range(workers)]
    assert os.environ["OMP_NUM_THREADS"] == "7" and "MKL_NUM_THREADS" not in os.environ


def _cores_at_import() -> list[int]:
    return _CORES_AT_IMPORT


def test_workers_own_their_cores_before_torch_loads():
    """A worker runs on its cores from its start (the parent pins the thread that spawns it),
    so torch's OpenMP runtime, initialized when torch loads there, counts only the worker's
    cores; pinned only later (in _child), it counted all of the parent's (issue 18)."""
    cores = usable_cores()
    if len(cores) < 2:
        pytest.skip("needs 2 cores")
    assert spawn_local(2, _cores_at_import, {}) == cores[: len(cores) // 2]
    assert sorted(os.sched_getaffinity(0)) == cores  # the parent's cores put back


def test_core_slices_and_worker_env():
    assert core_slices(list(range(16)), 8) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11],
                                               [12, 13], [14, 15]]
    assert core_slices([0, 2, 4, 6, 8], 2) == [[0, 2], [4, 6]]  # one core left idle
    assert core_slices([0, 1], 3) == [[0], [1], [0]]
    assert worker_env(2) == {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2",
                             "OPENBLAS_NUM_THREADS": "2", "TORCHINDUCTOR_COMPILE_THREADS": "1"}


def test_default_workers_rule():
    gib = 2**30
    shards = [5 * gib] * 64  # 320 GiB in 5 GiB shards
    assert default_workers(16, 256 * gib, shards) == 1  # one process saturates 16 cores' disk
    assert default_workers(128, 512 * gib, shards) == 8  # cores // 16
    assert default_workers(128, 128 * gib, shards) == 7  # (128 - 2) // (1 + 3 x 5) GiB
    assert default_workers(128, 128 * gib, [300 * 10**6] * 15) == 2  # 4.5 GB // 2 GiB
    assert default_workers(128, None, shards[:3]) == 3  # one shard a worker at least
    assert default_workers(128, None, [gib] * 5) == 2  # 2 GiB of source a worker
    assert default_workers(2, None, shards) == 1
    assert default_workers(128, 128 * gib, [100 * 2**20] * 4) == 1  # a small checkpoint
    assert default_workers(128, gib, shards) == 1 and default_workers(16, None, []) == 1


def test_torchrun_gloo_two_ranks_write_the_single_process_build(moe, tmp_path):
    src, clean = moe
    out = tmp_path / "tr"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "2", "-m", "quantize.cli", "nvfp4", "--src", str(src),
                        "--out", str(out), "--device", "cpu", "--kernel", "reference", "--quiet"],
                       capture_output=True, text=True, cwd=ROOT, timeout=600,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])), OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("wrote ") == 1  # rank 0 reports, rank 1 stays quiet
    assert_same_build(clean, out)


def test_failed_rank_stops_all_then_resume_with_other_rank_count(moe, tmp_path):
    """A NaN in one source shard stops the rank converting it; every rank raises, the shards
    finished by then stay in the per-rank ledgers, and once the shard is repaired a resume with
    one process reads those ledgers and completes the identical build (re-converting what
    depended on the repaired shard: here every shard, as weights and scales are spread)."""
    src, clean = moe
    bad = tmp_path / "src"
    shutil.copytree(src, bad)
    shard = bad / "model-00003-of-00004.safetensors"
    original = shard.read_bytes()
    t = load_file(str(shard))
    name = "model.layers.2.shared_head.norm.weight"  # a kept bf16 tensor of that shard
    t[name] = t[name].clone()
    t[name][0] = float("nan")
    save_file(t, str(shard))
    out = tmp_path / "o"
    with pytest.raises(SourceError, match=f"{name} in shard model-00003-of-00004.safetensors has 1 NaN"):
        convert(bad, out, progress=False, device="cpu", kernel="reference", workers=2)
    ledgers = sorted(p.name for p in out.glob(".spark-quant-progress*"))
    assert ledgers == [".spark-quant-progress.rank0.json", ".spark-quant-progress.rank1.json"]
    done = {}
    for p in ledgers:
        done.update(json.loads((out / p).read_text())["shards"])
    assert shard.name not in done and len(done) >= 1
    assert not (out / INDEX_NAME).exists() and not (out / MANIFEST_NAME).exists()
    shard.write_bytes(original)
    s = convert(bad, out, progress=False, device="cpu", kernel="reference", resume=True)
    assert s.shards_skipped + s.shards_written == 4
    assert not list(out.glob(".spark-quant-progress*"))
    assert_same_build(clean, out, same_source=False)


def test_single_process_ledger_resumed_by_two_workers(moe, tmp_path, monkeypatch):
    src, clean = moe
    killed_at_write(monkeypatch, 3)
    out = tmp_path / "o"
    with pytest.raises(KeyboardInterrupt):
        convert(src, out, progress=False, device="cpu", kernel="reference")
    monkeypatch.undo()
    s = convert(src, out, progress=False, device="cpu", kernel="reference", resume=True, workers=2)
    assert s.shards_skipped == 2 and s.shards_written == 2
    assert not list(out.glob(".spark-quant-progress*"))
    assert_same_build(clean, out)


@pytest.mark.skipif(not (torch.cuda.is_available() and _has_triton()),
                    reason="needs a CUDA device and triton")
@pytest.mark.parametrize("kernel", ["triton", "reference"])
def test_cuda_build_is_the_cpu_reference_build(moe, tmp_path, kernel):
    src, clean = moe
    convert(src, tmp_path / kernel, progress=False, device="cuda", kernel=kernel)
    assert_same_build(clean, tmp_path / kernel)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="ignore")
    except OSError:
        return ""


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (from /proc/N/stat: field 4 after the comm)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def test_workers_die_with_a_killed_parent(moe, tmp_path):
    """kill -9 of ``quantize nvfp4 --workers 2`` takes its workers with it (PR_SET_PDEATHSIG):
    nothing goes on writing into the output folder, and no manifest appears."""
    import signal
    import time

    src, _ = moe
    out = tmp_path / "b"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    parent = subprocess.Popen([sys.executable, "-m", "quantize.cli", "nvfp4", "--src", str(src),
                               "--out", str(out), "--workers", "2", "--quiet"], env=env, cwd=ROOT)
    # kill once both workers run their ranks: each rank's ledger is written when its rank starts,
    # after the worker asked the kernel for PR_SET_PDEATHSIG (a worker still importing torch
    # has not, and leaves only after its imports: a loaded machine made that race a failure)
    ledgers = [out / f".spark-quant-progress.rank{r}.json" for r in (0, 1)]
    deadline = time.time() + 300
    workers: list[int] = []
    while time.time() < deadline and parent.poll() is None:
        workers = [k for k in _children(parent.pid) if "spawn_main" in _cmdline(k)]
        if len(workers) >= 2 and all(p.exists() for p in ledgers):
            break
        time.sleep(0.05)
    if parent.poll() is not None or len(workers) < 2 or not all(p.exists() for p in ledgers):
        pytest.skip(f"the build finished before its workers could be seen ({parent.poll()}, {workers})")
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.time() + 20
    while time.time() < deadline and any(Path(f"/proc/{w}").exists() and
                                          "Z" not in Path(f"/proc/{w}/stat").read_text().split()[2]
                                          for w in workers):
        time.sleep(0.1)
    alive = [w for w in workers if Path(f"/proc/{w}").exists()
             and "Z" not in Path(f"/proc/{w}/stat").read_text().split()[2]]
    assert alive == [], f"workers {alive} outlived their parent"
    time.sleep(1.0)
    assert not (out / MANIFEST_NAME).exists()


def test_auto_workers_keeps_small_gpu_and_streamed_sources_in_one_process(moe, monkeypatch):
    from quantize.cli import _auto_workers

    src, _ = moe
    assert _auto_workers(src, "cpu", "auto") == 1  # 4 small shards: under 2 GiB a worker
    monkeypatch.setattr("quantize.convert.parallel.MIN_BYTES_PER_WORKER", 1)
    monkeypatch.setattr("quantize.convert.parallel.usable_cores", lambda: list(range(128)))
    assert _auto_workers(src, "cpu", "auto") == 4  # one shard a worker at most (128 cores: 8)
    assert _auto_workers(src, "cuda", "auto") == 1 and _auto_workers(src, "cpu", "triton") == 1
    assert _auto_workers("org/repo", "cpu", "auto") == 1  # a Hub source streams in one process
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert _auto_workers(src, "cpu", "auto") == 1  # torchrun ranks divide the shards


@pytest.mark.skipif(not _has_cxx(), reason="inductor needs a C++ compiler")
def test_workers_warm_the_compiled_kernels_only_when_they_will_run(moe, monkeypatch):
    from quantize.convert import pipeline

    src, _ = moe
    calls = []
    monkeypatch.setattr(pipeline, "warm_up", calls.append)
    opts = pipeline.ConvertOptions(device="cpu")
    pipeline._warm_kernels(opts, src)  # auto: every weight of the fixture is under 2^20 elements
    pipeline._warm_kernels(replace(opts, kernel="reference"), src)
    pipeline._warm_kernels(replace(opts, kernel="inductor", scales="mse"), src)
    assert calls == []
    pipeline._warm_kernels(replace(opts, kernel="inductor"), src)
    pipeline._warm_kernels(replace(opts, kernel="inductor", fmt="modelopt"), src)
    assert calls == ["global", "scale_2"]
