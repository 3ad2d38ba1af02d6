"""Triton NVFP4 kernel (RTN and block-scale search, both orders) against the plain-PyTorch
reference, byte for byte, on random FP8 weights of a few shapes with edge blocks.

Prints one line per case (shape, FP8 block, order, candidate set, weighted or not: OK or the
number of differing bytes) and exits 1 if any case differs. On the H200:

    PYTHONPATH=$HOME/sq:$PWD python3 scripts/check_triton_search.py

With ``TRITON_INTERPRET=1`` it runs the kernel in Triton's CPU interpreter instead (small
shapes only; slow), with the interpreter's float32 -> e4m3 cast replaced by torch's: the
interpreter's own cast does not round to nearest even (it never carries into the exponent).
"""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch

from quantize.kernels.fp8 import dequantize_fp8_block
from quantize.kernels.nvfp4 import global_scale_from_amax, scale_2_from_amax
from quantize.kernels.scale_search import CANDIDATE_SETS, quantize_nvfp4_search

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
WIDE = ((6, 0), (4, 0), (6, -1), (6, -3), (6, 2), (4, -2), (4, 3), (6, -16), (4, 16))
SHAPES = ([(40, 128, (1, 32)), (20, 304, (128, 128)), (33, 96, (1, 96))] if INTERPRET else
          [(256, 512, (128, 128)), (200, 304, (128, 128)), (576, 160, (128, 128)),
           (48, 96, (1, 96)), (48, 96, (48, 96)), (40, 128, (1, 32)), (2048, 6144, (128, 128)),
           (6144, 2048, (128, 128))])


def _patch_interpreter_fp8_cast():
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    orig = interpreter._convert_float

    def convert(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.float8e4nv:
            t = torch.from_numpy(np.ascontiguousarray(input).astype(np.float32))
            return t.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return orig(input, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = convert


def random_fp8(n, k, g):
    b = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    b[(b & 0x7F) == 0x7F] = 0x7E  # no NaN codes
    b[0, :16] = 0x00  # an all-zero block
    b[1, :16] = 0x80  # all -0
    b[2, :16] = torch.arange(16, dtype=torch.uint8) | 0x80  # subnormal negative ramp
    b[3, 16:32] = 0x01  # smallest subnormals only
    b[4, :] = 0x01
    b[4, 0] = 0x7E  # 448 beside blocks that underflow (FC-11b)
    return b.view(torch.float8_e4m3fn)


def main() -> int:
    if INTERPRET:
        _patch_interpreter_fp8_cast()
    elif not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device (or TRITON_INTERPRET=1 for the CPU interpreter)")
    from quantize.kernels.triton_nvfp4 import fp8_to_nvfp4_triton

    dev = torch.device("cpu" if INTERPRET else "cuda")
    sets = dict(CANDIDATE_SETS, wide=WIDE)
    bad = 0
    for n, k, block in SHAPES:
        g = torch.Generator().manual_seed(n * 7919 + k)
        wq = random_fp8(n, k, g)
        grid = (-(-n // block[0]), -(-k // block[1]))
        scale = torch.rand(grid, generator=g) * 10.0 ** float(torch.randint(-6, 2, (1,), generator=g))
        cw = torch.rand(k, generator=g) ** 4 * 30.0
        cw[::5] = 0.0
        w = dequantize_fp8_block(wq, scale, block)
        amax = w.abs().amax()
        for order in ("global", "scale_2"):
            for group in (False, True):  # a fused group's bigger amax sets the scalar
                a = amax * 3.0 if group else amax
                sc = scale_2_from_amax(a) if order == "scale_2" else global_scale_from_amax(a)
                for name, cands in sets.items():
                    for weighted in ((False,) if name == "rtn" else (False, True)):
                        c = cw if weighted else None
                        want = quantize_nvfp4_search(w, sc, order=order, channel_weight=c,
                                                     candidates=cands)
                        got = fp8_to_nvfp4_triton(wq.to(dev), scale.to(dev), block, sc.to(dev),
                                                  order, cands, c)
                        diff = (int((got[0].cpu() != want[0]).sum())
                                + int((got[1].cpu().view(torch.uint8) != want[1].view(torch.uint8)).sum()))
                        bad += diff > 0
                        print(f"{n}x{k} block {block[0]}x{block[1]} {order:7s} "
                              f"{'group' if group else 'own  '} {name:7s} "
                              f"{'weighted' if weighted else 'plain   '} "
                              f"{'OK' if diff == 0 else f'DIFFER in {diff} bytes'}", flush=True)
    print(f"{bad} case(s) differ" if bad else "all cases byte-identical")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
