"""Kernel-only throughput: FP8 block weights -> NVFP4, fast path against the reference.

No disk: one GLM-5.3-Flash expert weight set (gate, up [2048, 6144], down [6144, 2048],
random e4m3 bytes, 128x128 block scales) in memory, quantized repeatedly; prints G elements/s
(median of the repeats, compilation excluded), CPU seconds per G elements on CPU, the ratio,
and whether the bytes are identical.

    python scripts/bench_kernels.py --device cpu --threads 2
    python scripts/bench_kernels.py --device cuda
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from quantize.kernels.fused import prepare_fp8  # noqa: E402
from quantize.kernels.nvfp4 import global_scale_from_amax  # noqa: E402

SHAPES = [(2048, 6144), (2048, 6144), (6144, 2048)]


def weights(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, k in SHAPES:
        b = torch.randint(0, 0x7F, (n, k), generator=g, dtype=torch.uint8)
        b |= torch.randint(0, 2, (n, k), generator=g, dtype=torch.uint8) << 7
        out.append((b.view(torch.float8_e4m3fn), torch.rand(n // 128, k // 128, generator=g) * 1e-3))
    return out


def run(ws, backend: str, device: torch.device):
    res = []
    for w, s in ws:
        p = prepare_fp8(w, s, (128, 128), backend=backend, device=device)
        res.append(p.quantize(global_scale_from_amax(p.amax.cpu())))
    return res


def timed(ws, backend, device, repeats):
    run(ws, backend, device)  # compile / warm up
    walls, cpus = [], []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        out = run(ws, backend, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return out, statistics.median(walls), statistics.median(cpus)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    fast = "triton" if dev.type == "cuda" else "inductor"
    ws = weights()
    el = sum(n * k for n, k in SHAPES) / 1e9
    if dev.type == "cuda":  # weights already on the device: time the arithmetic, not PCIe
        ws = [(w.to(dev), s.to(dev)) for w, s in ws]
    a, t_fast, c_fast = timed(ws, fast, dev, args.repeats)
    b, t_ref, c_ref = timed(ws, "reference", dev, max(1, args.repeats // 2))
    same = all(torch.equal(x[0], y[0]) and torch.equal(x[1].view(torch.uint8), y[1].view(torch.uint8))
               for x, y in zip(a, b))
    print(f"{dev.type}, {torch.get_num_threads()} threads, {el:.3f} G elements per repeat")
    print(f"  {fast:9s}: {el / t_fast:8.3f} G elements/s ({el / c_fast:.3f} per CPU second)")
    print(f"  reference: {el / t_ref:8.3f} G elements/s ({el / c_ref:.3f} per CPU second)")
    print(f"  ratio {fast} / reference: {t_ref / t_fast:.1f} (wall), {c_ref / c_fast:.1f} (CPU); "
          f"bytes identical: {same}")


if __name__ == "__main__":
    main()
