"""Load builds in vLLM and compare them with our own dequantized reference, in vLLM too.

    python scripts/engine_check.py BUILD... [--source SRC] [--json] [--prompts N]
        [--kv-cache-dtype fp8] [--speculative mtp]

Run where vLLM is installed (vLLM 0.26 on the H200 machine: torch 2.11, transformers 5.17, this
repo on PYTHONPATH, no network; docs/formats.md §B.3.7). For each build:

1. our reference: the build dequantized by our own kernels (``eval.models.dequantized_build_state``)
   written as a bf16 safetensors checkpoint with the build's config minus
   ``quantization_config`` (a temporary folder);
2. BUILD, the reference and (``--source``) the FP8 source each loaded in vLLM with
   ``enforce_eager``, token-id prompts from a fixed seed, full-vocabulary prompt logprobs and
   8 greedy tokens;
3. mean / max |delta logprob| over every position and vocabulary entry, top-1 agreement of the
   prompt positions, agreement of the greedy tokens; which quantization method and kernel vLLM
   chose per module kind (its log lines, and each module's ``quant_method`` when the model is
   reachable in-process).

``--kv-cache-dtype fp8`` runs every model (build, reference, source) with an fp8 KV cache, so
the comparison isolates the weights; ``--speculative mtp`` loads the MTP layer as a draft
(``speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 1}``) and reports the
acceptance rate from ``llm.get_metrics()`` when the engine exposes it. Exit status 1 when a
build did not load.

vLLM is imported inside functions only, so this module imports (and its helpers are tested)
on a machine without vLLM.
"""

import argparse
import gc
import json
import logging
import math
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

__all__ = ["write_reference_folder", "make_prompts", "compare_logprobs", "greedy_agreement",
           "parse_kernel_lines", "module_kinds", "run_vllm", "main"]

MAX_TOKENS = 8


# ---- parts that need no vLLM -----------------------------------------------------------

def write_reference_folder(build: str | Path, out: str | Path) -> Path:
    """Write the build dequantized by our own kernels as a bf16 checkpoint vLLM loads unquantized.

    ``out`` gets ``model.safetensors`` (every tensor of :func:`eval.models.dequantized_build_state`
    in bfloat16, float32 tensors kept float32, on-disk names, MTP layers included) and
    ``config.json`` (the build's, without ``quantization_config`` at top level or in
    ``text_config``). Activation and KV-cache scales are not written.

    Returns:
        ``out``.
    """
    import torch
    from safetensors.torch import save_file

    from eval.models import dequantized_build_state
    from quantize import archs

    build, out = Path(build), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = dequantized_build_state(build, torch.bfloat16)
    tensors = {n: (t if t.dtype in (torch.float32, torch.bfloat16) else t.to(torch.bfloat16)).contiguous()
               for n, t in state.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((build / "config.json").read_text())
    cfg.pop("quantization_config", None)
    archs.text_config(cfg).pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for extra in ("generation_config.json",):
        if (build / extra).exists():
            (out / extra).write_text((build / extra).read_text())
    return out


def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``n`` token-id prompts of ``length`` ids in ``[1, vocab)`` from a fixed seed."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(length)] for _ in range(n)]


def compare_logprobs(a: list, b: list) -> dict:
    """Compare two runs' full-vocabulary prompt logprobs.

    Args:
        a, b: per prompt, a float array [positions, vocab] of log-probabilities (the first
            prompt position, which vLLM gives none, left out).

    Returns:
        ``{"mean_abs": float, "max_abs": float, "top1": float, "positions": int}``: mean and
        max |a - b| over every position and vocabulary entry (nats), the fraction of positions
        whose argmax agrees.

    Raises:
        ValueError: prompt counts or shapes differ.
    """
    import numpy as np

    if len(a) != len(b):
        raise ValueError(f"{len(a)} prompts vs {len(b)}")
    total, count, worst, agree, positions = 0.0, 0, 0.0, 0, 0
    for x, y in zip(a, b):
        x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
        if x.shape != y.shape:
            raise ValueError(f"logprob shapes {x.shape} vs {y.shape}")
        with np.errstate(invalid="ignore"):
            d = np.where(x == y, 0.0, np.abs(x - y))  # equal -inf entries differ by 0
        total += float(d.sum())
        count += d.size
        worst = max(worst, float(d.max()) if d.size else 0.0)
        agree += int((x.argmax(-1) == y.argmax(-1)).sum())
        positions += x.shape[0]
    return {"mean_abs": total / count if count else math.nan, "max_abs": worst,
            "top1": agree / positions if positions else math.nan, "positions": positions}


def greedy_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of greedy tokens equal position by position (over the shorter of each pair)."""
    same = total = 0
    for x, y in zip(a, b):
        n = min(len(x), len(y))
        same += sum(1 for i in range(n) if x[i] == y[i])
        total += max(len(x), len(y))
    return same / total if total else math.nan


_KERNEL_LINES = (
    # (pattern, kind), first match per line wins; the lines vLLM 0.26 logs.
    (re.compile(r"Using (?P<v>\w+) for NVFP4 GEMM"), "linear"),
    (re.compile(r"Selected (?P<v>\w+) for (?P<w>\w+)"), "linear_fp8"),
    (re.compile(r"Using '?(?P<v>[\w-]+)'? (?:NvFp4|NVFP4|Fp8|FP8|MxFp8|MXFP8) MoE backend"), "moe"),
    (re.compile(r"Using (?P<v>\w+) MLA prefill backend"), "mla_prefill"),
    (re.compile(r"Using (?P<v>[\w-]+) KV cache format"), "kv_cache"),
    (re.compile(r"Using (?P<v>[\w-]+) attention backend"), "attention"),
    (re.compile(r"Detected ModelOpt (?P<v>[\w ]+?) checkpoint(?: \(quant_algo=(?P<w>\w+)\))?"), "method"),
    (re.compile(r"(?P<v>Marlin requires thread-tile padding)"), "warning"),
    (re.compile(r"(?P<v>w1_weight_(?:global_scale|scale_2) must match w3_weight_(?:global_scale|scale_2))"),
     "warning"),
    (re.compile(r"(?P<v>In (?:NVFP4|W4A16_NVFP4) linear, the (?:weight global|global weight) scale)"), "warning"),
    (re.compile(r"(?P<v>Found [kv]_scale in the checkpoint)"), "warning"),
    (re.compile(r"(?P<v>Using KV cache scaling factor 1\.0)"), "warning"),
)


def parse_kernel_lines(lines) -> dict[str, list[str]]:
    """What vLLM's log says it picked: ``{kind: [value, ...]}`` in first-seen order, kinds
    ``linear`` (NVFP4 GEMM kernel), ``linear_fp8`` ("Selected <Kernel> for <Method>"), ``moe``,
    ``mla_prefill``, ``kv_cache``, ``attention``, ``method`` (ModelOpt detection) and
    ``warning`` (padding, fused-scale mismatch, KV-scale lines that should be absent); e.g.
    "Using MarlinNvFp4LinearKernel for NVFP4 GEMM" -> ``{"linear": ["MarlinNvFp4LinearKernel"]}``."""
    out: dict[str, list[str]] = {}
    for line in lines:
        for pat, kind in _KERNEL_LINES:
            m = pat.search(line)
            if m:
                value = m["v"] + (f" ({m['w']})" if "w" in pat.groupindex and m["w"] else "")
                seen = out.setdefault(kind, [])
                if value not in seen:
                    seen.append(value)
                break
    return out


def module_kinds(named_modules) -> dict[str, list[str]]:
    """``{kind: [quant_method class, ...]}`` of vLLM modules (``(name, module)`` pairs): kinds
    ``lm_head`` (ParallelLMHead / name ending lm_head), ``moe`` (FusedMoE classes), ``attention``
    (modules named ``attn`` or classes containing "Attention" with a ``quant_method``),
    ``linear`` (everything else with a ``quant_method``)."""
    out: dict[str, list[str]] = {}
    for name, mod in named_modules:
        qm = getattr(mod, "quant_method", None)
        if qm is None:
            continue
        cls = type(mod).__name__
        if name.endswith("lm_head") or "LMHead" in cls:
            kind = "lm_head"
        elif "FusedMoE" in cls or cls.endswith(("MoE", "Experts")):
            kind = "moe"
        elif "Attention" in cls or name.endswith(".attn"):
            kind = "attention"
        else:
            kind = "linear"
        seen = out.setdefault(kind, [])
        if type(qm).__name__ not in seen:
            seen.append(type(qm).__name__)
    return out


# ---- vLLM ------------------------------------------------------------------------------

class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        try:
            self.lines.append(record.getMessage())
        except Exception:  # noqa: BLE001 (a log line must never break the run)
            pass


def _reach_model(llm):
    """The in-process torch model of a vLLM ``LLM``, or None (several vLLM layouts tried)."""
    chains = ("llm_engine.model_executor.driver_worker.worker.model_runner.model",
              "llm_engine.model_executor.driver_worker.model_runner.model",
              "llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.model",
              "llm_engine.engine_core.model_executor.driver_worker.worker.model_runner.model")
    for chain in chains:
        obj = llm
        try:
            for part in chain.split("."):
                obj = getattr(obj, part)
            return obj
        except AttributeError:
            continue
    return None


def _free(llm=None):
    import torch

    del llm
    gc.collect()
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    except Exception:  # noqa: BLE001 (older / newer vLLM without it)
        pass
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _vocab(folder: Path) -> int:
    from quantize import archs

    return int(archs.text_config(json.loads((folder / "config.json").read_text()))["vocab_size"])


def run_vllm(model: str | Path, prompts: list[list[int]], vocab: int, *, kv_cache_dtype: str = "auto",
             speculative: str | None = None, max_model_len: int = 128) -> dict:
    """Load ``model`` in vLLM and run ``prompts`` (token ids).

    Returns:
        ``{"loaded": bool, "error": str | None, "version": str, "logprobs": [array [P-1, V]],
        "greedy": [[int]], "log_kernels": {...}, "modules": {...}, "metrics": {...}}``; on a
        load or run failure ``loaded`` False and ``error`` the exception's last line.
    """
    import os

    import numpy as np

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # model reachable in-process
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # the H200 payload has no flashinfer
    import vllm
    from vllm import LLM, SamplingParams

    cap = _Capture()
    vlog = logging.getLogger("vllm")
    vlog.addHandler(cap)
    res = {"loaded": False, "error": None, "version": vllm.__version__, "logprobs": [], "greedy": [],
           "log_kernels": {}, "modules": {}, "metrics": {}}
    llm = None
    try:
        kwargs = dict(model=str(model), enforce_eager=True, max_model_len=max_model_len, dtype="bfloat16",
                      skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 30, max_logprobs=vocab,
                      gpu_memory_utilization=0.3, seed=0)
        if kv_cache_dtype != "auto":
            kwargs["kv_cache_dtype"] = kv_cache_dtype
        if speculative == "mtp":
            kwargs["speculative_config"] = {"method": "mtp", "num_speculative_tokens": 1}
            kwargs["disable_log_stats"] = False  # the acceptance counters live in the stats
        llm = LLM(**kwargs)
        res["loaded"] = True
        model_obj = _reach_model(llm)
        if model_obj is not None:
            res["modules"] = module_kinds(model_obj.named_modules())
        toks = [{"prompt_token_ids": list(p)} for p in prompts]
        try:
            outs = llm.generate(toks, SamplingParams(prompt_logprobs=vocab, max_tokens=MAX_TOKENS,
                                                     temperature=0, seed=0), use_tqdm=False)
        except Exception as exc:  # noqa: BLE001 (e.g. prompt logprobs refused with speculation)
            msg = str(exc).strip().splitlines()
            res["logprobs_error"] = f"{type(exc).__name__}: {msg[-1] if msg else ''}"
            outs = llm.generate(toks, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, seed=0),
                                use_tqdm=False)
        for o in outs:
            rows = []
            for pos in (o.prompt_logprobs or [])[1:]:
                row = np.full(vocab, -np.inf, dtype=np.float32)
                for tid, lp in pos.items():
                    row[int(tid)] = lp.logprob
                rows.append(row)
            if o.prompt_logprobs is not None:
                res["logprobs"].append(np.stack(rows) if rows else np.zeros((0, vocab), np.float32))
            res["greedy"].append(list(o.outputs[0].token_ids))
        try:
            for m in llm.get_metrics():
                name = getattr(m, "name", "")
                if "spec_decode" in name:
                    res["metrics"][name] = getattr(m, "value", None) if hasattr(m, "value") else \
                        getattr(m, "values", None)
        except Exception:  # noqa: BLE001 (metrics are optional)
            pass
    except Exception as exc:  # noqa: BLE001 (reported as a row, not a traceback)
        msg = str(exc).strip().splitlines()
        res["error"] = f"{type(exc).__name__}: {msg[-1] if msg else ''}"
    finally:
        vlog.removeHandler(cap)
        res["log_kernels"] = parse_kernel_lines(cap.lines)
        _free(llm)
    return res


def _acceptance(metrics: dict) -> float | None:
    acc = metrics.get("vllm:spec_decode_num_accepted_tokens")
    draft = metrics.get("vllm:spec_decode_num_draft_tokens")
    try:
        return float(acc) / float(draft) if draft else None
    except (TypeError, ValueError):
        return None


def _row(name: str, r: dict, ref: dict | None, src: dict | None) -> dict:
    row = {"build": name, "engine": f"vllm {r['version']}", "loaded": r["loaded"], "error": r["error"],
           "kernels": r["log_kernels"], "modules": r["modules"],
           "mtp_acceptance": _acceptance(r["metrics"])}
    if r.get("logprobs_error"):
        row["logprobs_error"] = r["logprobs_error"]
    for tag, other in (("vs_reference", ref), ("vs_source", src)):
        if r["loaded"] and other and other["loaded"]:
            lp = (compare_logprobs(r["logprobs"], other["logprobs"])
                  if r["logprobs"] and other["logprobs"] else
                  {"mean_abs": math.nan, "max_abs": math.nan, "top1": math.nan, "positions": 0})
            row[tag] = {**lp, "greedy": greedy_agreement(r["greedy"], other["greedy"])}
    if ref is not None and not ref["loaded"]:
        row["reference_error"] = ref["error"]
    return row


def _print(row: dict) -> None:
    kinds = ", ".join(f"{k}={'/'.join(v)}" for k, v in sorted({**row["kernels"], **{
        f"{k}(qm)": v for k, v in row["modules"].items()}}.items())) or "-"
    line = f"{row['build']}: {row['engine']} loaded={'yes' if row['loaded'] else 'no'}"
    if not row["loaded"]:
        print(f"{line} ({row['error']})")
        return
    print(f"{line} kernels: {kinds}")
    for tag in ("vs_reference", "vs_source"):
        c = row.get(tag)
        if c:
            print(f"  {tag}: mean|dlogprob| {c['mean_abs']:.4f} max {c['max_abs']:.3f} "
                  f"top1 {c['top1']:.3f} greedy {c['greedy']:.3f} ({c['positions']} positions)")
    if "logprobs_error" in row:
        print(f"  no prompt logprobs: {row['logprobs_error']}")
    if "reference_error" in row:
        print(f"  reference did not load: {row['reference_error']}")
    if row["mtp_acceptance"] is not None:
        print(f"  MTP acceptance {row['mtp_acceptance']:.3f}")


def _emit(row: dict, as_json: bool) -> None:
    """Print one build's row as soon as it is measured (a run killed later keeps its rows)."""
    if as_json:
        print(json.dumps(row, default=str), flush=True)
    else:
        _print(row)
        sys.stdout.flush()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("builds", nargs="+")
    ap.add_argument("--source", help="FP8 source folder, loaded in vLLM as a second reference")
    ap.add_argument("--json", action="store_true", help="print raw numbers, one JSON object per build and line")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"))
    ap.add_argument("--speculative", choices=("mtp",))
    a = ap.parse_args(argv)
    if a.prompts < 1 or a.prompt_len < 2:
        ap.error("--prompts must be >= 1 and --prompt-len >= 2")
    opts = dict(kv_cache_dtype=a.kv_cache_dtype, speculative=a.speculative)
    sources: dict[int, dict] = {}  # per vocabulary size (the prompts depend on it)
    rows = []
    for b in a.builds:
        build = Path(b)
        if not (build / "config.json").exists():
            rows.append({"build": b, "engine": "vllm", "loaded": False, "error": "no config.json",
                         "kernels": {}, "modules": {}, "mtp_acceptance": None})
            _emit(rows[-1], a.json)
            continue
        vocab = _vocab(build)
        prompts = make_prompts(a.prompts, a.prompt_len, vocab)
        r = run_vllm(build, prompts, vocab, **opts)
        with tempfile.TemporaryDirectory(prefix="engine-ref-") as tmp:
            ref = run_vllm(write_reference_folder(build, tmp), prompts, vocab, **opts)
        if a.source and vocab not in sources:
            sources[vocab] = run_vllm(a.source, prompts, vocab, **opts)
        rows.append(_row(b, r, ref, sources.get(vocab)))
        _emit(rows[-1], a.json)
    return 0 if all(r["loaded"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
