"""Benchmark Hub -> finished build against the download alone, on a link of fixed bandwidth.

A synthetic block-FP8 checkpoint shaped like GLM-5.3-Flash routed experts
(``quantize.data.fixtures.write_synthetic_fp8``: gate/up [2048, 6144], down [6144, 2048],
128x128 blocks) is served by the local Hub-compatible server (tests/hub_server.py) throttled to
``--mbps`` MB/s for all downloads together, and three runs are timed, each in its own process
and its own empty HF_HOME:

- download alone: huggingface_hub's ``hf_hub_download`` of every file, one after the other
  (the local server has no tree API for ``snapshot_download``), the time the link needs;
- Hub -> finished build: ``quantize nvfp4 --src ORG/NAME --source-budget B`` (download ahead
  within B, convert, check, manifest), and its ratio to the download alone (goal <= 1.1);
- the conversion alone from a local folder (what a download-then-convert run adds).

It prints peak source bytes on disk during the build twice: as the converter counted them (the
summary line) and as the server sampled the cache folder at each shard request, against the
budget. Pick ``--mbps`` below the machine's conversion rate so that the link is the
bottleneck, as on a real link (2 shared cores: ~40 MB/s; an H200 box: 200).

    PYTHONPATH=$PWD python scripts/bench_hub.py --size-gb 1.5 --mbps 20 --budget-shards 4
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from quantize.data.fixtures import write_synthetic_fp8  # noqa: E402
from tests.hub_server import FakeHub, client_env  # noqa: E402

REPO = "bench/glm-experts-fp8"
DOWNLOAD = """
import sys
from huggingface_hub import HfApi, hf_hub_download
for f in sorted(s.rfilename for s in HfApi().model_info(sys.argv[1]).siblings):
    hf_hub_download(sys.argv[1], f)
"""


def timed(cmd: list[str], env: dict) -> tuple[float, str]:
    t = time.perf_counter()
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - t
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return seconds, r.stdout


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gb", type=float, default=1.5, help="FP8 bytes of the checkpoint")
    ap.add_argument("--experts-per-shard", type=int, default=2,
                    help="experts per shard (75.5 MB of FP8 each)")
    ap.add_argument("--mbps", type=float, default=20.0, help="link bandwidth, MB/s (1e6 bytes)")
    ap.add_argument("--budget-shards", type=int, default=4,
                    help="--source-budget in shards (at least 2: a shard and its partner)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out-dir", default=None, help="also write the numbers here as JSON")
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-hub-"))
    hidden, inter = 6144, 2048
    shard_fp8 = 3 * hidden * inter * args.experts_per_shard
    n_shards = max(2, round(args.size_gb * 1e9 / shard_fp8))
    src = write_synthetic_fp8(work / "src", n_shards, args.experts_per_shard, hidden, inter,
                              fast=True)
    sizes = {p.name: p.stat().st_size for p in src.glob("*.safetensors")}
    total = sum(sizes.values())
    budget = sum(sorted(sizes.values())[-args.budget_shards:])
    raw: dict = {"shards": n_shards, "bytes": total, "mbps": args.mbps, "budget": budget,
                 "cores": len(os.sched_getaffinity(0)), "load": os.getloadavg()[0]}
    print(f"source: {n_shards} shards, {total / 1e9:.2f} GB (synthetic GLM-5.3-Flash experts, "
          f"block FP8); link {args.mbps:g} MB/s -> {total / args.mbps / 1e6:.1f} s of transfer; "
          f"{raw['cores']} cores, load average {raw['load']:.1f}")
    with FakeHub(lifetime=7200) as hub:
        hub.serve_folder(REPO, src)
        hub.bandwidth = args.mbps * 1e6
        t_dl, _ = timed([sys.executable, "-c", DOWNLOAD, REPO], client_env(hub, work / "hf-dl"))
        shutil.rmtree(work / "hf-dl")
        hub.watch = work / "hf-build"
        hub.samples.clear()
        cmd = [sys.executable, "-m", "quantize.cli", "nvfp4", "--src", REPO, "--out",
               str(work / "out-hub"), "--quiet", "--device", args.device, "--no-showcase",
               "--source-budget", str(budget), "--workers", str(args.workers)]
        n_log, t0 = len(hub.log), time.monotonic()
        t_build, out = timed(cmd, client_env(hub, work / "hf-build"))
        t_end = t0 + t_build
        sampled = max((s["on_disk"] + s["size"] for s in hub.samples), default=0)
        sent = [(t, e) for t, e in zip(hub.times[n_log:], hub.log[n_log:])
                if e.get("file", "").endswith(".safetensors") and (e.get("full") or e.get("sent"))]
        first_get = min(t for t, e in sent if e.get("full"))
        last_byte = max(t for t, e in sent if e.get("sent"))
    m = re.search(r"peak ([\d.]+) MiB of shards on disk", out)
    counted = float(m[1]) * 2**20 if m else float("nan")
    t_local, _ = timed([sys.executable, "-m", "quantize.cli", "nvfp4", "--src", str(src), "--out",
                        str(work / "out-local"), "--quiet", "--device", args.device,
                        "--workers", str(args.workers)], dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))))
    same = all((work / "out-hub" / s).read_bytes() == (work / "out-local" / s).read_bytes()
               for s in sizes)
    start, span, tail = first_get - t0, last_byte - first_get, t_end - last_byte
    raw.update(start_s=start, download_span_s=span, tail_s=tail)
    raw.update(download_s=t_dl, build_s=t_build, local_convert_s=t_local, ratio=t_build / t_dl,
               peak_counted=counted, peak_sampled=sampled, same_bytes=same)
    print(f"  download alone (hf_hub_download)    : {t_dl:7.1f} s ({total / t_dl / 1e6:.1f} MB/s)")
    print(f"  Hub -> finished build (quantize)    : {t_build:7.1f} s  ratio {t_build / t_dl:.3f} "
          "(goal <= 1.1)")
    print(f"    of which: {start:.1f} s before the first shard request (start-up, listing, "
          f"headers, pre-flight), {span:.1f} s from it to the last shard byte, {tail:.1f} s after "
          "it (the last shard's conversion, check, manifest)")
    print(f"  conversion alone from a local folder: {t_local:7.1f} s  (download then convert: "
          f"{t_dl + t_local:.1f} s, {(t_dl + t_local) / t_dl:.2f}x)")
    print(f"  peak source bytes on disk: {counted / 2**20:.1f} MiB counted by the converter, "
          f"{sampled / 2**20:.1f} MiB sampled by the server; budget {budget / 2**20:.1f} MiB "
          f"({args.budget_shards} shards), checkpoint {total / 2**20:.1f} MiB")
    print(f"  build from the Hub byte-identical to the local build: {'yes' if same else 'NO'}")
    if args.out_dir:
        Path(args.out_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.out_dir) / "bench_hub.json").write_text(json.dumps(raw, indent=1))
    if not args.workdir:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
