"""Benchmark the streaming converter; every ratio below is measured in this one run.

On one synthetic block-FP8 checkpoint shaped like GLM-5.3-Flash routed experts (gate/up
[2048, 6144], down [6144, 2048], 128x128 blocks, 8 experts a shard), generated here, it prints:

- a plain sequential read + write (+ fsync) of the same files: the machine's I/O rate;
- spark-quant with the fast kernel (``--kernel auto``: inductor on CPU, Triton on CUDA):
  seconds, G elements/s, GB/s of source, CPU seconds, peak RSS and peak GPU memory, the ratio
  to the plain read + write, and where the time went (busy seconds of each stage in its
  thread: reader, quantizer, writer), beside the kernel alone on the same weights;
- the plain-PyTorch reference (``--kernel reference``) on the first ``--reference-gb`` of the
  same shards, the ratio of G elements/s, and whether the shards both wrote are byte-identical;
- llm-compressor ``model_free_ptq`` (scheme NVFP4A16, ``FP8BlockDequantizer`` so that it
  reads the block FP8 source, ignore ``lm_head`` and embeddings) on the first ``--llmc-gb``,
  run with ``--llmc-python`` (its own environment: it pins transformers <= 5.17); without
  that option the line says it was not run;
- the demo (SmolLM2-135M as block FP8), if it is built;
- peak RSS at 4 and at 16 shards of equal size (flat: FC-04);
- a projection of the time for a 306 GiB checkpoint;
- with ``--scaling 1,2,4,8``: the conversion at each worker count (each worker owns
  cores / N cores; quantize/convert/parallel.py), its rate, ratio to the plain read + write
  above and to the first count, CPU seconds, the workers' start-up, and whether its shards
  equal the first count's byte for byte.

``--scales M`` (a ``--scales`` method other than ``rtn``) converts the same source once more
with that block-scale method and prints its time over the RTN run's and the squared error of
its weights over RTN's (issue 15's rule: the search is the default where it costs at most 1.3x).

``--out-dir DIR`` writes the printed table to ``DIR/bench_convert_<device>.txt`` and the raw
numbers to ``DIR/bench_convert_<device>.json`` as well.

    python scripts/bench_convert.py --device cpu --size-gb 4 --reference-gb 1 \\
        --llmc-python /work/venv-llmc/bin/python --llmc-gb 0.3

Scaling on a 16-core box (32 shards, so 1, 2, 4, 8 and 16 workers get equal shares):

    python3 scripts/bench_convert.py --device cpu --size-gb 9.66 --workers 1 \
        --scaling 1,2,4,8,16 --reference-gb 0.3 --skip-rss --out-dir "$OUT"

On a bare GPU box whose python lacks compressed-tensors (the writer's schema classes), carry
the wheels listed in ``DEVICE_WHEELS`` (``pip download --no-deps`` them into ``.whl/``, a
folder .gitignore ignores) and run, in one command of about 3-6 minutes for 4 GB:

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \\
    PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 scripts/bench_convert.py --device cuda \\
        --size-gb 4 --out-dir "$OUT"
"""

import argparse
import importlib.util
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from quantize.data.fixtures import write_synthetic_fp8
from quantize.kernels import SCALE_METHODS

INDEX = "model.safetensors.index.json"
GIB_306 = 306 * 2**30
DEVICE_WHEELS = ("compressed-tensors==0.20.1", "pydantic==2.14.4", "pydantic-core==2.50.5",
                 "loguru==0.7.3", "annotated-types==0.8.0", "typing-inspection==0.4.5",
                 "typing-extensions==4.16.0")
"""What a python with torch, triton, safetensors, numpy and tqdm (the GPU image here) lacks
to run the converter with the compressed-tensors writer."""

PROBE = """
import json, sys, time
t0 = time.perf_counter()
import torch
import formats.compressed_tensors  # the writer's imports (compressed-tensors, transformers)
from quantize.kernels.fused import MIN_COMPILED_ELEMENTS, choose_backend, prepare_fp8
from quantize.kernels.nvfp4 import global_scale_from_amax
from quantize.kernels.scale_search import METHOD_CANDIDATES
from quantize.convert.pipeline import convert

def peak_rss():  # VmHWM is reset by exec, unlike ru_maxrss
    status = open("/proc/self/status").read()
    return int(status.split("VmHWM:")[1].split()[0]) * 1024

def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()

src, out, device, kernel, workers, alone = sys.argv[1:7]
scales = sys.argv[7] if len(sys.argv) > 7 else "rtn"
dev = torch.device(device)
backend = choose_backend(kernel, dev, MIN_COMPILED_ELEMENTS)
cands = METHOD_CANDIDATES[scales]
# one-time costs, reported apart: imports, CUDA context, kernel compilation (disk-cached), of
# the kernel variant this run uses (a search compiles its own, larger one). Triton specializes
# integer arguments on divisibility by 16, so the warm-up weight has rows, columns and a scale
# grid stride that are multiples of 16, as the experts' [2048, 6144] / [6144, 2048] have; the
# inductor graphs keep a last dimension of 16 static, so both of the experts' scale grids
# ([16, 48] and [48, 16]) are warmed.
for cols in (4096, 2048):
    w = torch.zeros(256, cols, dtype=torch.float8_e4m3fn)
    prepare_fp8(w, torch.ones(2, cols // 128), (128, 128), backend, device=dev,
                candidates=cands).quantize(torch.ones(1))
startup = time.perf_counter() - t0

def cpu():  # this process and its workers, user + system
    import resource
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime

c0, w0 = cpu(), time.perf_counter()
s = convert(src, out, progress=False, device=device, kernel=kernel, workers=int(workers),
            scales=scales)
c1, wall = cpu(), time.perf_counter() - w0  # wall: with the workers' start-up
gpu = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
import resource
worker_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # largest worker

# the kernel alone on one expert's weights (in memory, host to host like the converter)
g = torch.Generator().manual_seed(0)
ws = []
for n, k in ((2048, 6144), (2048, 6144), (6144, 2048)):
    b = torch.randint(0, 0x7F, (n, k), generator=g, dtype=torch.uint8)
    ws.append((b.view(torch.float8_e4m3fn), torch.rand(n // 128, k // 128, generator=g) * 1e-4))
def once():
    for wq, sc in ws:
        p = prepare_fp8(wq, sc, (128, 128), backend, device=dev, candidates=cands)
        p.quantize(global_scale_from_amax(p.amax.cpu()))
    sync()
kernel_rate = None
if alone == "1":
    once()
    times = []
    for _ in range(5):
        t = time.perf_counter(); once(); times.append(time.perf_counter() - t)
    kernel_rate = sum(wq.numel() for wq, _ in ws) / sorted(times)[2] / 1e9
print(json.dumps({"peak_rss": peak_rss(), "peak_gpu": gpu, "seconds": s.seconds, "wall": wall,
                  "peak_rss_worker": max(peak_rss(), worker_rss),
                  "startup": startup, "elements": s.elements_quantized, "bytes_in": s.bytes_in,
                  "cpu_seconds": c1 - c0, "stages": getattr(s, "stage_seconds", {}),
                  "stages_cpu": getattr(s, "stage_cpu_seconds", {}), "backend": backend,
                  "graphs_compiled": getattr(s, "graphs_compiled", []),
                  "kernel_gelem_s": kernel_rate}))
"""

LLMC = """
import json, sys, time
from compressed_tensors.entrypoints.convert import FP8BlockDequantizer
from llmcompressor import model_free_ptq

src, out, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
t0 = time.perf_counter()
model_free_ptq(src, out, scheme="NVFP4A16", ignore=["lm_head", "re:.*embed_tokens$"],
               max_workers=workers, device="cpu",
               converter=FP8BlockDequantizer(targets=["re:.*_proj$"]))
print(json.dumps({"seconds": time.perf_counter() - t0}))
"""

# (group shown, thread, stage names as quantize.convert.pipeline's StageClock records them)
STAGES = [
    ("read", "reader", ["read"]),
    ("dequant + quantize", "reader", ["dequant + amax"]),
    ("dequant + quantize", "quantizer", ["quantize"]),
    ("write + sha256", "writer", ["write + sha256", "scale stats"]),
    ("other", "writer", ["ledger"]),
    ("other", "main", ["pre-flight", "finish (index, config, check, manifest)"]),
]


class Report:
    """Prints lines and keeps them (and raw numbers) for ``--out-dir``."""

    def __init__(self):
        self.lines: list[str] = []
        self.raw: dict = {}

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)

    def save(self, folder: str | None, device: str) -> None:
        if not folder:
            return
        d = Path(folder)
        d.mkdir(parents=True, exist_ok=True)
        (d / f"bench_convert_{device}.txt").write_text("\n".join(self.lines) + "\n")
        (d / f"bench_convert_{device}.json").write_text(json.dumps(self.raw, indent=1) + "\n")


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


def drop_caches() -> bool:
    """Best effort: make the next run read from disk (needs root). True when it worked."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def child_cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_json(cmd: list[str]) -> dict:
    """Run ``cmd``; its last stdout line is JSON. Adds ``cpu_seconds`` (the whole process,
    children included) unless the command measured its own."""
    c0 = child_cpu_seconds()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                           [str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])))
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd[:3])} failed:\n{r.stderr[-4000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out.setdefault("cpu_seconds", child_cpu_seconds() - c0)
    return out


def run_convert(src: Path, out: Path, device: str, kernel: str = "auto", workers: int = 1,
                kernel_alone: bool = True, scales: str = "rtn") -> dict:
    return run_json([sys.executable, "-c", PROBE, str(src), str(out), device, kernel, str(workers),
                     "1" if kernel_alone else "0", scales])


def weight_mse(src: Path, out: Path, shard: str) -> float:
    """Sum over the NVFP4 weights of output ``shard`` of the squared error of the dequantized
    build against the dequantized FP8 source (compressed-tensors layout)."""
    from safetensors import safe_open

    from quantize.kernels.fp8 import dequantize_fp8_block
    from quantize.kernels.nvfp4 import dequantize_nvfp4

    total = 0.0
    with safe_open(str(out / shard), "pt") as o, safe_open(str(src / shard), "pt") as f:
        for name in o.keys():  # noqa: SIM118 (safe_open has no __iter__)
            if not name.endswith(".weight_packed"):
                continue
            m = name[: -len(".weight_packed")]
            w = dequantize_fp8_block(f.get_tensor(m + ".weight"),
                                     f.get_tensor(m + ".weight_scale_inv").float(), (128, 128))
            q = dequantize_nvfp4(o.get_tensor(name), o.get_tensor(m + ".weight_scale"),
                                 o.get_tensor(m + ".weight_global_scale"))
            total += float(((q - w) ** 2).sum())
    return total


def subset(src: Path, dst: Path, gb: float) -> tuple[Path, int]:
    """The first shards of ``src`` (at least one, about ``gb`` GB) as their own checkpoint
    (hard links, a filtered index, config.json with that many layers); returns it and its
    number of shards."""
    index = json.loads((src / INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    per = (src / shards[0]).stat().st_size
    keep = shards[: max(1, min(len(shards), round(gb * 1e9 / per)))]
    dst.mkdir(parents=True)
    for s in keep:
        os.link(src / s, dst / s)
    wm = {k: v for k, v in index["weight_map"].items() if v in keep}
    (dst / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = len(keep)  # the synthetic checkpoint has one layer a shard
    (dst / "config.json").write_text(json.dumps(config))
    return dst, len(keep)


def filesystem(path: Path) -> str:
    """``type on mount point`` of the file system holding ``path`` (tmpfs means RAM, not a disk)."""
    best = ("?", "?")
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            _, mnt, fstype = line.split()[:3]
            if str(path.resolve()).startswith(mnt.rstrip("/") + "/") and len(mnt) >= len(best[0]):
                best = (mnt, fstype)
    except OSError:
        pass
    return f"{best[1]} on {best[0]}"


def same_shards(a: Path, b: Path, shards: list[str]) -> bool:
    return all((a / s).read_bytes() == (b / s).read_bytes() for s in shards)


def stage_table(say: Report, r: dict) -> None:
    """Where the time of one conversion went: busy seconds of each stage in its thread (the
    reader, the quantizer and the writer overlap), the thread's idle rest, and a verdict."""
    st, cpu = r.get("stages") or {}, r.get("stages_cpu") or {}
    if not st:
        say("    (no per-stage times: this tree's converter does not record them)")
        return
    loop = st.get("shard loop (wall)", r["seconds"])
    say(f"    time by stage, seconds ({r['seconds']:.1f} s in all; the shard loop {loop:.1f} s "
        "runs three threads at once)")
    say(f"      {'stage':20s} {'thread':10s} {'busy':>7s} {'of loop':>8s} {'thread CPU':>10s}")
    groups: dict[str, float] = {}
    busy_by_thread: dict[str, float] = {}
    for group, thread, names in STAGES:
        wall = sum(st.get(n, 0.0) for n in names)
        c = sum(cpu.get(n, 0.0) for n in names)
        groups[group] = groups.get(group, 0.0) + wall
        if thread != "main":
            busy_by_thread[thread] = busy_by_thread.get(thread, 0.0) + wall
        say(f"      {' / '.join(names)[:20]:20s} {thread:10s} {wall:7.2f} {wall / loop:8.0%} {c:10.2f}")
    waits = {n: st.get(n, 0.0) for n in ("wait for read", "wait for write")}
    say(f"      quantizer waiting: {waits['wait for read']:.2f} s for the reader, "
        f"{waits['wait for write']:.2f} s for the writer")
    say("      groups: " + ", ".join(f"{k} {v:.2f} s" for k, v in groups.items())
        + f"; outside the shard loop {r['seconds'] - loop:.2f} s")
    busiest = max(busy_by_thread, key=busy_by_thread.get)
    say(f"      busiest thread: {busiest} ({busy_by_thread[busiest] / loop:.0%} of the loop) — "
        "the stage that bounds the throughput")


def parse_counts(text: str) -> list[int]:
    """``--scaling 1,2,4,8`` -> [1, 2, 4, 8] (each at least 1)."""
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of worker counts: {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"worker counts must be >= 1: {text!r}")
    return counts


def scaling(say: Report, src: Path, work: Path, args, first: dict, t_plain: float) -> None:
    """The conversion at each worker count of ``--scaling`` on the same source (page cache
    dropped before each): rate, ratio to the plain read + write measured in this run, ratio to
    the first count's rate, and whether every shard equals the first count's output."""
    cores = len(os.sched_getaffinity(0))
    counts = list(dict.fromkeys(args.scaling))
    gb = first["bytes_in"] / 1e9
    say(f"  scaling on {cores} cores (each worker owns cores // workers of them; page cache "
        "dropped before each run; 'convert' is rank 0's conversion, 'start-up' the rest of the "
        "wall time: spawning the workers, imports, loading the compiled kernels)")
    say(f"      {'workers':>7s} {'threads':>7s} {'convert':>8s} {'start-up':>8s} {'G el/s':>7s} "
        f"{'GB/s':>6s} {'/ plain':>7s} {'+start':>7s} {'/ ' + str(counts[0]) + ' w':>7s} {'CPU s':>6s} "
        f"{'RSS MiB':>8s} same bytes")
    base_out, base_rate = None, None
    shards = sorted(p.name for p in src.glob("*.safetensors"))
    rows = []
    for w in counts:
        out = work / f"out-scaling-{w}"
        if w == args.workers and base_out is None and w == counts[0] and (work / "out").is_dir():
            r, out = first, work / "out"
        else:
            drop_caches()
            r = run_convert(src, out, args.device, "auto", w, kernel_alone=False)
        rate = r["elements"] / r["seconds"] / 1e9
        if base_out is None:
            base_out, base_rate, same = out, rate, "(reference)"
        else:
            same = "yes" if same_shards(base_out, out, shards) else "NO"
            shutil.rmtree(out)
        start = r.get("wall", r["seconds"]) - r["seconds"]
        rows.append({"workers": w, "threads": max(1, cores // w), "seconds": r["seconds"],
                     "startup": start, "gelem_s": rate, "ratio_plain": t_plain / r["seconds"],
                     "ratio_plain_wall": t_plain / r.get("wall", r["seconds"]),
                     "ratio_first": rate / base_rate,
                     "cpu_seconds": r["cpu_seconds"], "peak_rss": r["peak_rss"], "same": same,
                     "stages": r.get("stages", {}), "stages_cpu": r.get("stages_cpu", {}),
                     "graphs_compiled": r.get("graphs_compiled", [])})
        x = rows[-1]
        say(f"      {w:7d} {x['threads']:7d} {r['seconds']:7.1f}s {start:7.1f}s {rate:7.3f} "
            f"{r['bytes_in'] / 1e9 / r['seconds']:6.3f} {x['ratio_plain']:7.3f} "
            f"{x['ratio_plain_wall']:7.3f} {x['ratio_first']:7.2f} {r['cpu_seconds']:6.0f} "
            f"{r.get('peak_rss_worker', r['peak_rss']) / 2**20:8.0f} {same}")
    say("      busy seconds by stage, summed over the workers (thread CPU seconds in brackets):")
    for x in rows:
        st, c = x["stages"], x["stages_cpu"]
        say(f"      {x['workers']:7d}  " + ", ".join(
            f"{n} {st.get(n, 0.0):.1f} ({c.get(n, 0.0):.1f})"
            for n in ("read", "dequant + amax", "quantize", "write + sha256", "wait for read"))
            + f"; shard loop CPU {c.get('shard loop (process)', 0.0):.1f} s (every thread, OpenMP's "
            f"too), graphs compiled in it per rank {x['graphs_compiled']}")
    say(f"      plain read + write of the same bytes: {t_plain:.1f} s ({gb / t_plain:.3f} GB/s); "
        "'/ plain' is that time over 'convert', '+start' over the whole wall time; RSS is the "
        "largest process's peak (one worker's when there are several)")
    if base_out is not None and base_out != work / "out":
        shutil.rmtree(base_out)
    say.raw["scaling"] = rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--size-gb", type=float, default=4.0, help="FP8 bytes of the checkpoint")
    ap.add_argument("--workers", type=int, default=1, help="processes for spark-quant")
    ap.add_argument("--reference-gb", type=float, default=None,
                    help="run the plain-PyTorch reference on this much (default: all)")
    ap.add_argument("--llmc-python", default=None, help="python of an env with llmcompressor")
    ap.add_argument("--llmc-gb", type=float, default=0.3)
    ap.add_argument("--llmc-workers", type=int, default=1)
    ap.add_argument("--project-cores", type=int, default=16,
                    help="cores of the CPU box in the 306 GiB projection")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out-dir", default=None, help="also write the table and raw numbers here")
    ap.add_argument("--skip-rss", action="store_true", help="skip the 4 / 16 shard RSS runs")
    ap.add_argument("--scaling", type=parse_counts, default=None, metavar="N,N,...",
                    help="also convert at each of these worker counts (e.g. 1,2,4,8) and print "
                         "rate, ratio to the plain read + write and ratio to the first count")
    ap.add_argument("--scales", default="rtn", choices=SCALE_METHODS,
                    help="also convert the same source with this block-scale method and print "
                         "its time / RTN time and its weight squared error / RTN's")
    args = ap.parse_args()
    say = Report()
    if importlib.util.find_spec("compressed_tensors") is None:
        raise SystemExit("compressed-tensors is not installed in this python: install it, or on a "
                         "bare GPU box carry these wheels (pip download --no-deps) and install "
                         "them first: " + " ".join(DEVICE_WHEELS))
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-convert-"))
    hidden, inter, per_shard = 6144, 2048, 8  # GLM-5.3-Flash-sized experts, 8 per shard
    shard_bytes = 3 * hidden * inter * per_shard
    n_shards = max(1, round(args.size_gb * 1e9 / shard_bytes))
    t_gen = time.perf_counter()
    src = write_synthetic_fp8(work / "src", n_shards, per_shard, hidden, inter, fast=True)
    t_gen = time.perf_counter() - t_gen

    import torch

    cores = len(os.sched_getaffinity(0))
    dev_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    say(f"machine: {cores} cores, load average {os.getloadavg()[0]:.1f}, device {dev_name}, "
        f"torch {torch.__version__}, python {sys.version.split()[0]}, {args.workers} worker(s); "
        f"work folder {work} ({filesystem(work)})")

    try:
        cold = drop_caches()
        t_plain = plain_copy(src, work / "copy")
        shutil.rmtree(work / "copy")
        drop_caches()
        r = run_convert(src, work / "out", args.device, "auto", args.workers)
        gb, gel = r["bytes_in"] / 1e9, r["elements"] / 1e9
        rate = gel / r["seconds"]
        say.raw.update(device=args.device, machine=dev_name, cores=cores, gb=gb, gelem=gel,
                       plain_seconds=t_plain, fast=r, generate_seconds=t_gen)
        say(f"synthetic block FP8 (GLM-5.3-Flash expert shapes): {n_shards} shards, {gb:.2f} GB, "
            f"{gel:.2f} G elements, generated in {t_gen:.0f} s (page cache dropped before each "
            f"run: {'yes' if cold else 'no, not root'})")
        say(f"  plain read + write   : {t_plain:7.1f} s  ({gb / t_plain:.3f} GB/s)")
        say(f"  spark-quant ({r.get('backend', 'fast')}): {r['seconds']:7.1f} s  ({rate:.3f} G elements/s, "
            f"{gb / r['seconds']:.3f} GB/s of source; {r['cpu_seconds']:.0f} CPU s = "
            f"{r['elements'] / r['cpu_seconds'] / 1e9:.3f} G elements per CPU second)")
        say(f"    ratio to plain read + write throughput: {t_plain / r['seconds']:.3f} (process "
            f"startup before it, not counted: {r['startup']:.1f} s of imports, CUDA context, "
            "kernel compilation)")
        say(f"    peak RSS {r['peak_rss'] / 2**20:.0f} MiB, peak GPU memory {r['peak_gpu'] / 2**20:.0f} MiB")
        if r.get("kernel_gelem_s"):
            say(f"    the kernel alone on one expert's weights, host to host: "
                f"{r['kernel_gelem_s']:.2f} G elements/s (end to end is "
                f"{rate / r['kernel_gelem_s']:.0%} of it)")
        stage_table(say, r)

        if args.scales != "rtn":
            drop_caches()
            sr = run_convert(src, work / "out-search", args.device, "auto", args.workers, scales=args.scales)
            first = min(p.name for p in src.glob("*.safetensors"))
            mse = weight_mse(src, work / "out-search", first) / weight_mse(src, work / "out", first)
            say.raw.update(search=sr, search_scales=args.scales, search_mse_ratio=mse)
            say(f"  spark-quant --scales {args.scales} ({sr.get('backend', 'fast')}): "
                f"{sr['seconds']:7.1f} s ({sr['elements'] / sr['seconds'] / 1e9:.3f} G elements/s, "
                f"{sr['cpu_seconds']:.0f} CPU s; startup {sr['startup']:.1f} s not counted)")
            say(f"    ratio --scales {args.scales} / rtn, same source, end to end: time "
                f"{sr['seconds'] / r['seconds']:.3f}; weight squared error (shard {first}) "
                f"{mse:.4f}")
            if sr.get("kernel_gelem_s") and r.get("kernel_gelem_s"):
                say(f"    the kernel alone on one expert's weights, host to host: "
                    f"{sr['kernel_gelem_s']:.2f} G elements/s ({sr['kernel_gelem_s'] / r['kernel_gelem_s']:.3f}x rtn's)")
            stage_table(say, sr)
            shutil.rmtree(work / "out-search")
        if args.scaling:
            scaling(say, src, work, args, r, t_plain)

        ref_gb = args.size_gb if args.reference_gb is None else args.reference_gb
        sub, k = subset(src, work / "src-ref", ref_gb)
        drop_caches()
        ref = run_convert(sub, work / "out-ref", args.device, "reference", args.workers)
        ref_rate = ref["elements"] / ref["seconds"] / 1e9
        shards = sorted(p.name for p in sub.glob("*.safetensors"))
        same = same_shards(work / "out", work / "out-ref", shards)
        say.raw.update(reference=ref, reference_shards=k, byte_identical=same)
        say(f"  plain-PyTorch reference, first {k} shards ({ref['bytes_in'] / 1e9:.2f} GB): "
            f"{ref['seconds']:.1f} s ({ref_rate:.4f} G elements/s, "
            f"{ref['elements'] / ref['cpu_seconds'] / 1e9:.4f} per CPU second)")
        say(f"    ratio fast / reference (G elements/s): {rate / ref_rate:.1f}; "
            f"shards byte-identical: {same}")
        stage_table(say, ref)

        if args.llmc_python:
            sub, k = subset(src, work / "src-llmc", args.llmc_gb)
            drop_caches()
            lc = run_json([args.llmc_python, "-c", LLMC, str(sub), str(work / "out-llmc"),
                           str(args.llmc_workers)])
            elements = k * per_shard * 3 * hidden * inter  # every expert weight is quantized
            lc_rate = elements / lc["seconds"] / 1e9
            say.raw.update(model_free_ptq=lc, model_free_ptq_shards=k)
            say(f"  llm-compressor model_free_ptq NVFP4A16 (FP8BlockDequantizer, CPU, "
                f"{args.llmc_workers} worker(s)), first {k} shards: {lc['seconds']:.1f} s "
                f"({lc_rate:.4f} G elements/s, {lc['cpu_seconds']:.0f} CPU s)")
            say(f"    ratio fast / model_free_ptq (G elements/s): {rate / lc_rate:.1f}")
        else:
            say("  llm-compressor model_free_ptq: not run here (no --llmc-python; it needs its own "
                "environment, transformers <= 5.17)")
        shutil.rmtree(work / "out")

        per_cpu_s = r["elements"] / r["cpu_seconds"]
        t306 = GIB_306 / (gb * 1e9 / r["seconds"])
        say(f"projection, 306 GiB of FP8 source: {t306 / 60:.1f} min at this run's rate; "
            f"plain read + write of it here: {GIB_306 / (gb * 1e9 / t_plain) / 60:.1f} min")
        if args.device == "cpu":
            say(f"  lower bound on {args.project_cores} cores (this run's G elements per CPU "
                f"second, perfect scaling, an infinitely fast disk): "
                f"{GIB_306 / (per_cpu_s * args.project_cores) / 60:.1f} min")

        demo = Path(os.environ.get("SPARK_QUANT_CACHE", Path.home() / ".cache/spark-quant")) / "demo-smollm2-135m-fp8-v1"
        if demo.is_dir():
            d = run_convert(demo, work / "demo-out", args.device)
            t_demo = plain_copy(demo, work / "demo-copy")
            say(f"demo (SmolLM2-135M block FP8, {d['bytes_in'] / 1e6:.0f} MB): {d['seconds']:.2f} s, "
                f"{d['elements'] / d['seconds'] / 1e9:.3f} G elements/s; plain read+write {t_demo:.2f} s; "
                f"ratio {t_demo / d['seconds']:.3f}")

        if not args.skip_rss:
            for n in (4, 16):
                s = write_synthetic_fp8(work / f"rss{n}", n, 2, 2048, 1024, fast=True)
                p = run_convert(s, work / f"rss{n}-out", args.device)
                say.raw[f"peak_rss_{n}_shards"] = p["peak_rss"]
                say(f"peak RSS, {n:2d} shards of {3 * 2048 * 1024 * 2 / 2**20:.0f} MiB FP8: "
                    f"{p['peak_rss'] / 2**20:.0f} MiB")
    finally:
        say.save(args.out_dir, args.device)
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
