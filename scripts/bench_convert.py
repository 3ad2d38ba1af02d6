"""Benchmark the streaming converter against a plain read + write of the same bytes.

Prints, measured in one run on this machine:
- our conversion of a synthetic GLM-expert-shaped block-FP8 checkpoint: G elements/s and
  GB/s of source, and the ratio to a plain sequential read + write (+ fsync) of the same
  files;
- the same on the demo (SmolLM2-135M as block FP8), if it is built;
- peak RSS of the conversion (own process) at 4 and at 16 shards of equal size.

    python scripts/bench_convert.py --device cpu --size-gb 2
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from quantize.fixtures import write_synthetic_fp8  # noqa: E402

PROBE = """
import sys, json, time
from quantize.pipeline import convert

def peak_rss():  # VmHWM is reset by exec, unlike ru_maxrss
    status = open("/proc/self/status").read()
    return int(status.split("VmHWM:")[1].split()[0]) * 1024

s = convert(sys.argv[1], sys.argv[2], progress=False, device=sys.argv[3])
print(json.dumps({"peak_rss": peak_rss(),
                  "seconds": s.seconds, "elements": s.elements_quantized,
                  "bytes_in": s.bytes_in}))
"""


def plain_copy(src: Path, dst: Path) -> float:
    """Read every file of ``src`` and write it to ``dst`` with fsync; seconds."""
    dst.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    for p in sorted(src.iterdir()):
        data = p.read_bytes()
        with open(dst / p.name, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        del data
    return time.perf_counter() - t0


def drop_caches() -> None:
    """Best effort: make both runs read from disk (needs root; ignored otherwise)."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        pass


def run_convert(src: Path, out: Path, device: str) -> dict:
    import json

    r = subprocess.run([sys.executable, "-c", PROBE, str(src), str(out), device],
                       capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if r.returncode:
        raise SystemExit(r.stderr)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--size-gb", type=float, default=2.0, help="FP8 bytes of the synthetic checkpoint")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-convert-"))
    hidden, inter, per_shard = 6144, 2048, 8  # GLM-5.3-Flash-sized experts, 8 per shard
    shard_bytes = 3 * hidden * inter * per_shard
    n_shards = max(1, round(args.size_gb * 1e9 / shard_bytes))
    src = write_synthetic_fp8(work / "src", n_shards, per_shard, hidden, inter, fast=True)
    drop_caches()
    t_plain = plain_copy(src, work / "copy")
    shutil.rmtree(work / "copy")
    drop_caches()
    r = run_convert(src, work / "out", args.device)
    gb = r["bytes_in"] / 1e9
    print(f"machine: {os.cpu_count()} cores, device {args.device}, torch threads default")
    print(f"synthetic block FP8: {n_shards} shards, {gb:.2f} GB, {r['elements'] / 1e9:.2f} G elements")
    print(f"  plain read + write : {t_plain:.1f} s  ({gb / t_plain:.3f} GB/s)")
    print(f"  spark-quant convert: {r['seconds']:.1f} s  ({r['elements'] / r['seconds'] / 1e9:.3f} "
          f"G elements/s, {gb / r['seconds']:.3f} GB/s of source)")
    print(f"  ratio convert / plain read+write throughput: {t_plain / r['seconds']:.3f}")
    print(f"  peak RSS: {r['peak_rss'] / 2**20:.0f} MiB")
    shutil.rmtree(work / "out")

    demo = Path(os.environ.get("SPARK_QUANT_CACHE", Path.home() / ".cache/spark-quant")) / "demo-smollm2-135m-fp8-v1"
    if demo.is_dir():
        d = run_convert(demo, work / "demo-out", args.device)
        t_demo = plain_copy(demo, work / "demo-copy")
        print(f"demo (SmolLM2-135M block FP8, {d['bytes_in'] / 1e6:.0f} MB): {d['seconds']:.2f} s, "
              f"{d['elements'] / d['seconds'] / 1e9:.3f} G elements/s; plain read+write {t_demo:.2f} s; "
              f"ratio {t_demo / d['seconds']:.3f}")

    for n in (4, 16):
        s = write_synthetic_fp8(work / f"rss{n}", n, 2, 2048, 1024, fast=True)
        p = run_convert(s, work / f"rss{n}-out", args.device)
        print(f"peak RSS, {n:2d} shards of {3 * 2048 * 1024 * 2 / 2**20:.0f} MiB FP8: "
              f"{p['peak_rss'] / 2**20:.0f} MiB")
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
