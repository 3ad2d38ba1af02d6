"""GSM8K through lm-eval: both extraction filters, per-sample records, paired comparison.

The task is ``spark_gsm8k`` (:mod:`eval.harness`): lm-eval's own ``gsm8k.yaml`` prompt,
filters and metric on the local 1319-problem test set. Two filters are always reported
(lm-eval ``tasks/gsm8k/gsm8k.yaml``, ``filters/extraction.py`` ``RegexFilter``):

- ``strict-match``: the first ``#### N`` in the completion; no marker -> ``[invalid]``;
- ``flexible-extract``: the last number-like token anywhere in the completion.

Strict-match measures format compliance as much as arithmetic (field case FC-29,
lm-evaluation-harness PR #2034): a build is compared with its baseline filter by filter,
on the same problems with the same prompt settings, and a strict-only drop is a formatting
finding, not a quantization regression.
"""

import math

__all__ = ["FILTERS", "apply_filters", "gsm8k_items", "gsm8k_summary", "paired_compare"]

FILTERS = ("strict-match", "flexible-extract")


def apply_filters(task, completions: list[str], docs: list[dict]) -> dict[str, list[str]]:
    """Run the task's own filter pipelines on raw completions.

    Args:
        task: the lm-eval ``Task`` (:func:`eval.harness.load_task`).
        completions: one completion per doc.
        docs: the matching documents.

    Returns:
        ``{filter name: [extracted answer per completion]}``; a miss is ``"[invalid]"``.
    """
    from lm_eval.api.instance import Instance

    out = {}
    for ens in task._filters:
        insts = [Instance(request_type="generate_until", doc=d, arguments=("", {}), idx=0,
                          metadata=(task.config.task, i, 1)) for i, d in enumerate(docs)]
        for inst, c in zip(insts, completions):
            inst.resps = [c]
        ens.apply(insts)
        out[ens.name] = [inst.filtered_resps[ens.name] for inst in insts]
    return out


def gsm8k_items(samples: list[dict]) -> list[dict]:
    """Per-problem records from lm-eval's ``samples[task]`` (one entry per doc and filter).

    Returns:
        list sorted by ``doc_id`` of ``{"doc_id", "id", "target", "response",
        "strict-match": answer, "flexible-extract": answer, "correct": {filter: 0/1}}``.
    """
    by_doc: dict[int, dict] = {}
    for s in samples:
        item = by_doc.setdefault(s["doc_id"], {
            "doc_id": s["doc_id"], "id": s["doc"].get("id"),
            "target": s["target"].split("####")[-1].strip(),
            "response": s["resps"][0][0], "correct": {}})
        item[s["filter"]] = s["filtered_resps"][0]
        item["correct"][s["filter"]] = int(s["exact_match"])
    return [by_doc[k] for k in sorted(by_doc)]


def gsm8k_summary(items: list[dict]) -> dict:
    """Accuracy per filter with its binomial standard error, ``n`` and the strict/flexible gap."""
    n = len(items)
    out = {"n": n}
    for f in FILTERS:
        acc = sum(i["correct"][f] for i in items) / n if n else float("nan")
        out[f] = {"acc": acc, "stderr": math.sqrt(acc * (1 - acc) / n) if n else float("nan")}
    out["strict_flexible_gap"] = out["flexible-extract"]["acc"] - out["strict-match"]["acc"]
    return out


def paired_compare(base: list[dict], test: list[dict], flt: str) -> dict:
    """Paired accuracy difference ``test - base`` on the problems both ran.

    Standard error of the mean of per-problem differences d_i in {-1, 0, 1}:
    ``se = sqrt((b + c - (c - b)^2 / n) / (n (n - 1)))`` with ``b`` problems only the baseline
    solved and ``c`` only the build solved (the paired t / McNemar setting).

    Returns:
        ``{"n", "base_acc", "test_acc", "delta", "only_base", "only_test", "se", "ci95"}``,
        ``ci95`` = ``[delta - 1.96 se, delta + 1.96 se]``.

    Raises:
        ValueError: the two runs share no problem.
    """
    b_map = {i["doc_id"]: i["correct"][flt] for i in base}
    t_map = {i["doc_id"]: i["correct"][flt] for i in test}
    common = sorted(set(b_map) & set(t_map))
    n = len(common)
    if not n:
        raise ValueError("baseline and build GSM8K runs share no problem")
    only_base = sum(1 for k in common if b_map[k] and not t_map[k])
    only_test = sum(1 for k in common if t_map[k] and not b_map[k])
    delta = (only_test - only_base) / n
    var = (only_base + only_test - (only_test - only_base) ** 2 / n) / (n * (n - 1)) if n > 1 else 0.0
    se = math.sqrt(max(var, 0.0))
    return {"n": n, "base_acc": sum(b_map[k] for k in common) / n,
            "test_acc": sum(t_map[k] for k in common) / n, "delta": delta,
            "only_base": only_base, "only_test": only_test, "se": se,
            "ci95": [delta - 1.96 * se, delta + 1.96 * se]}
