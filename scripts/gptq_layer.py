"""Time our GPTQ (calibrate.gptq) on one decoder layer of a source folder; prints JSON.

The layers before ``--layer`` run unquantized to reach it. Stages (seconds): capture
(embeddings, per-layer inputs), load (filling layers from the source, every layer up to the
target), propagate (forward of the layers before the target), hessians (the target's forward
with the X^T X hooks), solve (GPTQ of its NVFP4 Linears, experts batched), write (its results).

    python scripts/gptq_layer.py --src SRC --layer 3 --device cuda --dtype bfloat16 \\
        --samples 128 --seq-len 512 --recipe spark-mixed
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    import torch

    from calibrate.gptq import gptq_layer

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--src", required=True)
    p.add_argument("--layer", type=int, required=True)
    p.add_argument("--dataset", default="random", help="calibration set (random needs no tokenizer)")
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--recipe", default="weight-only")
    p.add_argument("--format", default="compressed-tensors")
    p.add_argument("--act-order", action="store_true")
    p.add_argument("--scales", default="rtn", choices=["rtn", "mse", "mse-act"])
    p.add_argument("--work", help="keep the layer's results here (default: a temporary folder)")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    r = gptq_layer(a.src, a.layer, dataset=a.dataset, samples=a.samples, seq_len=a.seq_len, work=a.work,
                   device=a.device, dtype=getattr(torch, a.dtype), recipe=a.recipe, fmt=a.format,
                   act_order=a.act_order, scales=a.scales, progress=False)
    r["wall_s"] = round(time.perf_counter() - t0, 1)
    if a.device.startswith("cuda"):
        r["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    print(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
