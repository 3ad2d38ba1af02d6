"""Issue 17 kind 4: the gate never passes garbage (degenerate / empty / same completions, a KV
dtype that collapses, a loss that grows with context), answers end at end-of-text, k/v scales
read whatever the prefix."""

import json

import pytest
import torch
from safetensors.torch import save_file

from eval.degenerate import degenerate_summary
from eval.gate import gate_checks, gate_passed, load_thresholds
from eval.harness import cut_at_stop, end_markers, in_process_lm, stop_at_end
from eval.kvcache import kl_by_length, kv_cache_factory, scales_from_build
from eval.passkey import grid_summary, score
from eval.report import gate_lines, gate_reason
from quantize.archs import KVScaleName, kv_scale_of


def _failed(checks):
    return {c["name"]: c for c in checks if not c["passed"]}


# ---- broken output fails, named ------------------------------------------------------------

def test_same_completion_for_every_prompt_fails_naming_the_check():
    t = load_thresholds()
    texts = ["I cannot help with that."] * 8  # fluent, so not "degenerate" per text
    d = degenerate_summary(texts, prompts=[f"gsm8k:{i}" for i in range(8)])
    assert d["degenerate"] == 0 and d["same"] == {"text": "I cannot help with that.", "prompts": 8}
    assert d["same_rate"] == 1.0 and d["empty"] == 0
    checks = gate_checks({"degenerate": {"build": d}}, t)
    assert [c["name"] for c in checks] == ["degenerate.rate", "degenerate.empty.rate", "degenerate.same.rate"]
    assert list(_failed(checks)) == ["degenerate.same.rate"] and not gate_passed(checks)
    c = _failed(checks)["degenerate.same.rate"]
    assert c["severity"] == "fail" and c["limit"] == 0.25 and c["by"] == pytest.approx(0.75)
    assert c["detail"] == "8 different prompts of 8 got the same completion 'I cannot help with that.'"
    assert gate_reason(checks, True) == "degenerate.same.rate 1 (limit <= 0.25)"
    assert gate_lines({"gate": {"checks": checks}}) == [
        "FAIL degenerate.same.rate: 1 (limit <= 0.25, off by 0.75) 8 different prompts of 8 got the "
        "same completion 'I cannot help with that.'"]


def test_same_completion_counts_different_prompts_only():
    # one prompt asked 3 times (same answer) and 3 other prompts with their own answers
    d = degenerate_summary(["42", "42", "42", "7", "8", "9"], prompts=["a", "a", "a", "b", "c", "d"])
    assert d["same"] == {"text": "42", "prompts": 1} and d["same_rate"] == 0.0
    d = degenerate_summary([" 12345.", "12345.", " 54321."])  # stripped: two prompts share one
    assert d["same"] == {"text": "12345.", "prompts": 2} and d["same_rate"] == pytest.approx(2 / 3)
    ok = degenerate_summary([f"The answer is {i}." for i in range(10)])
    assert ok["same_rate"] == 0.0 and ok["same"]["prompts"] == 1
    checks = gate_checks({"degenerate": {"build": ok}}, load_thresholds())
    assert gate_passed(checks) and checks[-1]["detail"] == "no two different prompts of 10 got the same completion"
    with pytest.raises(ValueError, match="2 prompt ids for 3 completions"):
        degenerate_summary(["a", "b", "c"], prompts=["x", "y"])


def test_empty_completions_fail():
    t = load_thresholds()
    d = degenerate_summary(["", "  \n", "", "#### 18", "", "", "\n", "It is 5."])
    assert d["empty"] == 6 and d["empty_rate"] == 0.75 and d["rate"] == 0.0
    checks = gate_checks({"degenerate": {"build": d}}, t)
    f = _failed(checks)
    assert list(f) == ["degenerate.empty.rate"] and not gate_passed(checks)
    assert f["degenerate.empty.rate"]["detail"] == "6 of 8 completions empty"
    assert f["degenerate.empty.rate"]["limit"] == 0.10 and f["degenerate.empty.rate"]["severity"] == "fail"
    # all empty: fails; nothing is "the same completion" (empty ones are counted as empty)
    d = degenerate_summary(["", ""])
    assert d["same"] == {"text": None, "prompts": 0} and d["same_rate"] == 0.0
    assert list(_failed(gate_checks({"degenerate": {"build": d}}, t))) == ["degenerate.empty.rate"]


# ---- KV parity: per length, collapse, GSM8K parity ---------------------------------------

def _kv(mean_kl, by_length, pk_len_mean=None, degenerate=None, gsm8k_paired=None):
    r = {"scales": "default 1.0", "kl": {"mean_kl": mean_kl},
         "kl_by_length": [{"length": L, "from": f, "mean_kl": k, "top1_agree": 0.9, "tokens": L - f + 1}
                          for f, L, k in by_length]}
    if pk_len_mean is not None:
        r["passkey"] = {"mean": sum(pk_len_mean) / len(pk_len_mean), "lengths": [1024, 2048, 4096],
                        "length_mean": pk_len_mean}
    if degenerate is not None:
        r["degenerate"] = degenerate
    if gsm8k_paired is not None:
        r["gsm8k_paired"] = gsm8k_paired
    return r


def test_kl_at_the_longest_context_fails_even_when_the_mean_passes():
    t = load_thresholds()
    assert t["kv_parity"]["fp8_max_mean_kl"] == 0.05
    # mean over the 512-token windows 0.02 and over lengths (0.01 + 0.02 + 0.09) / 3 = 0.04: both
    # within 0.05; the 2049..4096 bucket is 0.09
    fp8 = _kv(0.02, [(1, 1024, 0.01), (1025, 2048, 0.02), (2049, 4096, 0.09)])
    checks = gate_checks({"kv_parity": {"dtypes": {"fp8": fp8}}}, t)
    assert [c["name"] for c in checks] == ["kv_parity.fp8.mean_kl", "kv_parity.fp8.kl@1024",
                                           "kv_parity.fp8.kl@2048", "kv_parity.fp8.kl@4096",
                                           "kv_parity.fp8.collapse"]
    f = _failed(checks)
    assert list(f) == ["kv_parity.fp8.kl@4096"] and not gate_passed(checks)
    assert f["kv_parity.fp8.kl@4096"]["by"] == pytest.approx(0.04)
    assert f["kv_parity.fp8.kl@4096"]["detail"] == ("context 2049..4096 tokens (2048 predictions), "
                                                    "top-1 0.900, vs bf16 KV")


def test_a_collapsed_nvfp4_cache_fails_although_nvfp4_only_warns():
    t = load_thresholds()
    assert t["kv_parity"]["nvfp4_severity"] == "warn"
    # KL 0.2 mean (a warn-level cost), 3.5 nats at 4k: a broken cache
    nv = _kv(0.2, [(1, 1024, 0.1), (1025, 4096, 3.5)])
    checks = gate_checks({"kv_parity": {"dtypes": {"nvfp4": nv}}}, t)
    f = _failed(checks)
    assert f["kv_parity.nvfp4.kl@4096"]["severity"] == "warn"
    assert f["kv_parity.nvfp4.collapse"]["severity"] == "fail" and f["kv_parity.nvfp4.collapse"]["value"] == 3.5
    assert not gate_passed(checks)
    assert gate_reason(checks, True) == "kv_parity.nvfp4.collapse 3.5 (limit <= 1)"
    # "!!!!" from the nvfp4 cache fails too (it used to take nvfp4_severity = warn)
    bang = degenerate_summary(["!" * 40] * 3 + ["#### 18"], prompts=["a", "b", "c", "d"])
    checks = gate_checks({"kv_parity": {"dtypes": {"nvfp4": _kv(0.1, [], degenerate=bang)}}}, t)
    f = _failed(checks)
    assert {n: c["severity"] for n, c in f.items()} == {"kv_parity.nvfp4.degenerate.rate": "fail",
                                                        "kv_parity.nvfp4.degenerate.same.rate": "fail"}
    assert f["kv_parity.nvfp4.degenerate.rate"]["detail"] == "3 of 4 completions degenerate (repeat 3)"


def test_kv_passkey_per_length_and_gsm8k_parity():
    t = load_thresholds()
    bf16 = {"passkey": {"mean": 1.0, "lengths": [1024, 2048, 4096], "length_mean": [1.0, 1.0, 1.0]}}
    # mean drop 0.0667 passes 0.10; at 4096 the drop is 0.2
    fp8 = _kv(0.01, [], pk_len_mean=[1.0, 1.0, 0.8],
              gsm8k_paired={"flexible-extract": {"n": 50, "base_acc": 0.6, "test_acc": 0.3, "delta": -0.3,
                                                 "only_base": 15, "only_test": 0, "se": 0.066, "ci95": [0, 0]},
                            "strict-match": {"n": 50, "base_acc": 0.5, "test_acc": 0.5, "delta": 0.0,
                                             "only_base": 0, "only_test": 0, "se": 0.0, "ci95": [0, 0]}})
    checks = gate_checks({"kv_parity": {"dtypes": {"bf16": bf16, "fp8": fp8}}}, t)
    names = [c["name"] for c in checks]
    assert names == ["kv_parity.fp8.mean_kl", "kv_parity.fp8.collapse", "kv_parity.fp8.passkey.drop",
                     "kv_parity.fp8.passkey.drop@1024", "kv_parity.fp8.passkey.drop@2048",
                     "kv_parity.fp8.passkey.drop@4096", "kv_parity.fp8.gsm8k.flexible-extract.drop",
                     "kv_parity.fp8.gsm8k.strict-match.drop"]
    f = _failed(checks)
    assert list(f) == ["kv_parity.fp8.passkey.drop@4096", "kv_parity.fp8.gsm8k.flexible-extract.drop"]
    assert f["kv_parity.fp8.passkey.drop@4096"]["detail"] == "mean over depths at 4096 tokens: bf16 KV 1.000 -> fp8 0.800"
    g = f["kv_parity.fp8.gsm8k.flexible-extract.drop"]
    assert g["value"] == pytest.approx(0.3) and g["limit"] == pytest.approx(1.96 * 0.066) and g["severity"] == "fail"


def test_grid_summary_means_per_length():
    recs = [{"length": L, "depth": d, "correct": c, "tokens": L}
            for L, d, c in ((100, 0, 1), (100, 50, 1), (200, 0, 1), (200, 50, 0))]
    assert grid_summary(recs)["length_mean"] == [1.0, 0.5]


def test_kl_by_length_buckets_each_context_on_its_own():
    from tests.eval.test_eval_kvcache import tiny_llama

    model = tiny_llama()

    class Tok:
        def encode(self, t, add_special_tokens=False):
            return [ord(c) % 128 for c in t]

    texts = ["".join(chr(97 + (i * 7) % 26) for i in range(300))]
    ref = kv_cache_factory(model.config, "bf16")
    same = kl_by_length(model, Tok(), texts, [64, 16, 32], ref, ref)
    assert [(b["length"], b["from"], b["tokens"]) for b in same] == [(16, 1, 16), (32, 17, 16), (64, 33, 32)]
    assert all(b["mean_kl"] == 0.0 and b["top1_agree"] == 1.0 for b in same)
    nv = kl_by_length(model, Tok(), texts, [16, 32, 64], ref, kv_cache_factory(model.config, "nvfp4"))
    assert all(b["mean_kl"] > 0 for b in nv)
    # the buckets are the per-position KL of one 65-token window, split at 16 / 32
    from eval.kl import teacher_forced_kl

    whole = teacher_forced_kl(model, model, Tok(), texts, 65, 65, ref_cache=ref,
                              test_cache=kv_cache_factory(model.config, "nvfp4"))
    assert sum(b["mean_kl"] * b["tokens"] for b in nv) / 64 == pytest.approx(whole["mean_kl"], rel=1e-6)
    with pytest.raises(ValueError, match="the KL texts give 300 tokens; KV parity at 400 tokens of context needs 401"):
        kl_by_length(model, Tok(), texts, [400], ref, ref)


# ---- answers end at end-of-text --------------------------------------------------------

def test_answer_after_end_of_text_is_not_extracted():
    stops = ["<|endoftext|>", "<|user|>"]
    assert cut_at_stop("18 - 3 = 15.<|endoftext|>Question: ... #### 42", stops) == "18 - 3 = 15."
    assert cut_at_stop("#### 7<|user|>x<|endoftext|>", stops) == "#### 7"
    assert cut_at_stop("no marker #### 9", stops) == "no marker #### 9"
    assert score(" 12345.", 12345, stops) == 1
    assert score("<|endoftext|> 12345.", 12345, stops) == 0  # the key came after the end
    assert score("<|endoftext|> 12345.", 12345) == 1  # (what reading past the marker gave)

    class FakeLM:
        def generate_until(self, requests):
            return ["The answer is 5.<|user|>Q: 6+6? #### 12", " 54321.", "<|endoftext|>#### 3"]

    lm = stop_at_end(FakeLM(), stops)
    assert lm.generate_until([None] * 3) == ["The answer is 5.", " 54321.", ""]


def _word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "<eot>": 1, **{f"w{i}": i for i in range(2, 128)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="w2"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", additional_special_tokens=["<eot>"])
    return tok


def test_end_markers_and_in_process_decode_cut(tmp_path):
    from tests.eval.test_eval_kvcache import tiny_llama

    tok = _word_tokenizer()
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 1]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 0}))
    assert end_markers(tok, tmp_path) == ([0, 1], ["<eos>", "<eot>"])
    assert end_markers(tok) == ([0], ["<eos>"])
    lm = in_process_lm(tiny_llama(), tok, batch_size=1, end_ids=[0, 1])
    # lm-eval decodes with skip_special_tokens=True: without the cut "<eot>" would vanish and
    # "w42" after it would be read as part of the answer
    assert lm.tok_decode([5, 6, 1, 42]) == "w5 w6"
    assert lm.tok_decode([5, 6, 0, 0]) == "w5 w6"
    plain = in_process_lm(tiny_llama(), tok, batch_size=1)
    assert plain.tok_decode([5, 6, 1, 42]) == "w5 w6 w42"
    assert lm.tok_decode(0, skip_special_tokens=False) == "<eos>"  # lm-eval's own eos lookup


# ---- k/v scales through the architecture map ------------------------------------------------

def test_kv_scale_names_whatever_the_prefix():
    assert kv_scale_of("model.language_model.layers.12.self_attn.k_scale") == KVScaleName(
        12, "k", "model.language_model.layers.12.self_attn")
    assert kv_scale_of("model.layers.3.self_attn.v_proj.v_scale") == KVScaleName(3, "v", "model.layers.3.self_attn")
    assert kv_scale_of("language_model.model.layers.0.self_attn.attn.k_scale").layer == 0
    for name in ("model.layers.3.self_attn.k_proj.v_scale", "model.layers.0.self_attn.k_proj.input_scale",
                 "model.layers.0.mlp.k_scale", "model.visual.blocks.0.attn.k_scale",
                 "model.vision_tower.layers.0.self_attn.k_scale", "model.layers.0.self_attn.k_proj.weight_scale"):
        assert kv_scale_of(name) is None, name


def test_scales_from_a_multimodal_build(tmp_path):
    save_file({"model.language_model.layers.0.self_attn.k_scale": torch.tensor([0.5]),
               "model.language_model.layers.0.self_attn.v_scale": torch.tensor(0.25),
               "model.language_model.layers.1.self_attn.k_proj.k_scale": torch.tensor(2.0),
               "model.visual.blocks.0.attn.k_scale": torch.tensor([9.0]),
               "model.language_model.layers.0.mlp.down_proj.weight": torch.zeros(2, 2)},
              str(tmp_path / "model.safetensors"))
    assert scales_from_build(tmp_path) == {0: (0.5, 0.25), 1: (2.0, 1.0)}


@pytest.mark.parametrize("tensors,message", [
    ({"model.layers.0.self_attn.k_scale": torch.tensor([0.0])},
     "model.layers.0.self_attn.k_scale (model.safetensors): a KV-cache scale must be one finite value > 0, got [0.0]"),
    ({"model.layers.0.self_attn.v_scale": torch.tensor([float("nan")])},
     "model.layers.0.self_attn.v_scale (model.safetensors): a KV-cache scale must be one finite value > 0, got [nan]"),
    ({"model.layers.0.self_attn.k_scale": torch.tensor([0.5]),
      "model.layers.0.self_attn.k_proj.k_scale": torch.tensor(0.25)},
     "layer 0 has two k_scales: model.layers.0.self_attn.k_proj.k_scale = 0.25 and "
     "model.layers.0.self_attn.k_scale = 0.5"),
])
def test_bad_stored_scales_are_refused(tmp_path, tensors, message):
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError) as e:
        scales_from_build(tmp_path)
    assert str(e.value) == message
