"""Teacher-forced comparison of two causal LMs on the same token stream.

Both models see exactly the same input windows; at every position we compare their
next-token distributions. KL is in nats (natural log), accumulated in float64.
"""

import math

import torch

__all__ = ["token_windows", "teacher_forced_kl"]


def token_windows(tokenizer, texts: list[str], max_tokens: int = 512,
                  window: int = 256) -> list[torch.Tensor]:
    """Tokenize ``texts`` once and cut the stream into consecutive windows.

    The texts are joined with ``"\\n\\n"`` and encoded once with
    ``tokenizer.encode(text, add_special_tokens=False)`` (no BOS/EOS). The first
    ``max_tokens`` ids are split into windows of ``window`` ids; a final window shorter than
    2 ids is dropped (it has nothing to predict).

    Returns:
        list of int64 tensors of shape [1, L] with 2 <= L <= window.

    Raises:
        ValueError: ``window`` < 2 or ``max_tokens`` < 2, or the text gives fewer than 2 tokens.
    """
    if window < 2 or max_tokens < 2:
        raise ValueError(f"window and max_tokens must be >= 2, got window={window}, max_tokens={max_tokens}")
    ids = list(tokenizer.encode("\n\n".join(texts), add_special_tokens=False))[:max_tokens]
    if len(ids) < 2:
        raise ValueError(f"the texts give {len(ids)} token(s); need at least 2")
    stream = torch.tensor(ids, dtype=torch.long)
    return [w.unsqueeze(0) for w in stream.split(window) if w.numel() >= 2]


def _logits(model, ids: torch.Tensor, cache_factory=None) -> torch.Tensor:
    """Float64 log-probabilities [L-1, V] predicting ids[1:] from ids[:-1] context. With a
    ``cache_factory`` the forward pass runs through that fresh cache (attention then reads
    K/V as the cache stores them, e.g. :func:`eval.kvcache.kv_cache_factory`)."""
    device = next(model.parameters()).device
    if cache_factory is None:
        out = model(input_ids=ids.to(device), use_cache=False)
    else:
        out = model(input_ids=ids.to(device), cache=cache_factory(), use_cache=True)
    return torch.log_softmax(out.logits[0, :-1].to(torch.float64), dim=-1).cpu()


@torch.no_grad()
def teacher_forced_kl(ref_model, test_model, tokenizer, texts: list[str],
                      max_tokens: int = 512, window: int = 256,
                      ref_cache=None, test_cache=None) -> dict:
    """Mean KL(ref || test) of next-token distributions, top-1 agreement and perplexities.

    The stream from :func:`token_windows` is fed window by window (each window starts with
    an empty context; no KV cache across windows). In a window of L ids, positions
    0..L-2 predict ids 1..L-1, so a window scores L-1 tokens.

    Args:
        ref_model, test_model: causal LMs (``model(input_ids=[1, L]).logits`` -> [1, L, V]),
            same vocabulary size V, in eval mode. Each runs on its own parameters' device.
        tokenizer: anything with ``encode(text, add_special_tokens=False) -> list[int]``.
        texts: evaluation texts, e.g. :func:`quantize.data.texts.essay_texts`.
        max_tokens: at most this many ids of the stream are used.
        window: ids per forward pass.
        ref_cache, test_cache: optional zero-argument factories of a transformers ``Cache``
            to run each window through (KV-cache dtype parity: the same model twice, with a
            bf16 and a quantized cache).

    Returns:
        dict with
        ``mean_kl``: mean over scored tokens of sum_v p_ref(v) (log p_ref(v) - log p_test(v)),
        nats per token (>= 0); ``top1_agree``: fraction of scored tokens where both argmaxes
        agree (0..1); ``ppl_ref`` / ``ppl_test``: exp(mean negative log-likelihood of the
        actual next id); ``tokens``: number of scored tokens.

    Raises:
        ValueError: bad ``window``/``max_tokens``, too little text, or the two models'
            vocabulary sizes differ.
    """
    kl_sum = nll_ref = nll_test = 0.0
    agree = tokens = 0
    for ids in token_windows(tokenizer, texts, max_tokens, window):
        lr, lt = _logits(ref_model, ids, ref_cache), _logits(test_model, ids, test_cache)
        if lr.shape != lt.shape:
            raise ValueError(f"vocabulary sizes differ: baseline {lr.shape[-1]} logits, "
                             f"build {lt.shape[-1]}; compare a build with its own source")
        target = ids[0, 1:].unsqueeze(-1)
        kl_sum += float((lr.exp() * (lr - lt)).sum())
        agree += int((lr.argmax(-1) == lt.argmax(-1)).sum())
        nll_ref -= float(lr.gather(-1, target).sum())
        nll_test -= float(lt.gather(-1, target).sum())
        tokens += target.shape[0]
    return {"mean_kl": kl_sum / tokens, "top1_agree": agree / tokens,
            "ppl_ref": math.exp(nll_ref / tokens), "ppl_test": math.exp(nll_test / tokens),
            "tokens": tokens}
