"""Calibration: layer-streamed activation statistics for W4A4, FP8 KV scales and the
activation-weighted scale search.

``calibrate(src, dataset)`` tokenizes a calibration set (``calibrate.data``), runs the source
one decoder layer at a time through its transformers classes (``calibrate.layerwise``) and
returns :class:`formats.calib_stats.CalibStats`.
"""

import gc
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from calibrate.data import CalibSet, build_calib_set, check_dataset
from formats.calib_stats import CalibStats
from formats.sources import read_config
from quantize.base.errors import SourceError

__all__ = ["calibrate", "calibrate_sequences", "CalibStats"]


def _tokenizer(folder: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, TypeError):
        return None


def calibrate_sequences(src: str | Path, calib: CalibSet, *, all_experts: bool = False,
                        channels: bool = True, dtype: torch.dtype = torch.float32,
                        device: str = "cpu", progress: bool = True) -> CalibStats:
    """Record statistics of ``calib`` through the source, one decoder layer at a time.

    Args:
        src: source folder (block FP8, compressed-tensors FP8 or dense).
        calib: token sequences (``calibrate.data.build_calib_set``).
        all_experts: also run every routed expert on every token, for statistics only.
        channels: record per-input-channel mean of x^2 (for ``--scales mse-act``).
        dtype, device: compute dtype and device of the streamed layers.

    Returns:
        CalibStats with input amax of every Linear in the decoder layers (experts by
        expert), KV amax per attention layer, routed tokens per expert, and ``meta``.

    Raises:
        SourceError: from the source reader. RuntimeError / ValueError: the checkpoint does
        not fit the transformers classes of its config (names the tensors).
    """
    from calibrate.layerwise import StreamedModel
    from calibrate.observers import LayerObserver
    from formats.sources import open_source
    from quantize import archs
    from quantize.base.memory import bound_allocator, release_freed_memory

    t0 = time.perf_counter()
    bound_allocator()
    source = open_source(src)
    try:
        model = StreamedModel(source, dtype=dtype, device=device)
        hidden, kwargs = model.capture(calib.sequences)
        carried: list[dict] = [{} for _ in hidden]
        input_amax: dict[str, float] = {}
        sq_sum: dict[str, torch.Tensor] = {}
        counts: dict[str, int] = {}
        stats = CalibStats()
        bar = tqdm(total=model.n_layers, desc="calibrate", unit="layer", disable=not progress)
        for i in range(model.n_layers):
            layer = model.load_layer(i, all_experts)
            modules = {f"{layer.prefix}.{n}" for n in layer.disk_module} | set(layer.disk_module.values())
            with LayerObserver(layer, input_amax, sq_sum, counts, channels) as obs:
                model.run_layer(layer, hidden, kwargs, carried, on_cache=obs.on_cache)
            attn = obs.attention_name()
            if obs.kv_seen and attn:
                stats.kv_amax[attn] = {"k": obs.k_amax, "v": obs.v_amax,
                                       "mla": archs.is_mla_attention(attn, modules)}
            stats.expert_tokens.update(obs.expert_tokens())
            del layer
            gc.collect()  # a filled layer holds reference cycles (hooks, modules): free it now
            release_freed_memory()
            bar.update(1)
        bar.close()
    finally:
        source.close()
    stats.input_amax = input_amax
    stats.channel_sq_mean = {m: sq_sum[m] / counts[m] for m in sq_sum}
    stats.meta = dict(calib.meta, source=str(Path(src).resolve()), all_experts=all_experts,
                      dtype=str(dtype).replace("torch.", ""), device=device,
                      seconds=round(time.perf_counter() - t0, 2))
    return stats


def check_calibration_source(src: Path) -> dict:
    """The source's config.json, checked before transformers reads it (pre-flight's checks of
    the config, :func:`formats.sources.read_config`) plus a ``model_type``: calibration builds
    the model with transformers' own classes, which pick them by it.

    Raises:
        SourceError: naming the folder, config.json or the key.
    """
    from quantize import archs

    if not src.is_dir():
        raise SourceError(f"source folder {src} does not exist")
    cfg = read_config(src)
    if archs.missing_model_type(cfg):
        raise SourceError(f"{src / 'config.json'} has no model_type: calibration builds the model "
                          "with transformers' classes, which are chosen by it", key="model_type")
    return cfg


def calibrate(src: str | Path, dataset: str, *, samples: int = 128, seq_len: int = 512,
              seed: int = 0, chat_template: bool = True, tokenizer=None, **kwargs) -> CalibStats:
    """Tokenize ``dataset`` with the source's tokenizer and run :func:`calibrate_sequences`.

    Args:
        dataset: built-in name, local path or ``datasets`` name (``calibrate.data``).
        tokenizer: overrides the tokenizer found in ``src``.
        kwargs: passed to :func:`calibrate_sequences`.
    """
    from quantize import archs

    check_dataset(dataset)  # a missing local file is named before the tokenizer loads
    src = Path(src)
    cfg = check_calibration_source(src)
    tok = tokenizer if tokenizer is not None else _tokenizer(src)
    vocab = archs.text_config(cfg).get("vocab_size")
    calib = build_calib_set(dataset, tok, samples=samples, seq_len=seq_len, seed=seed,
                            chat_template=chat_template, vocab_size=vocab)
    return calibrate_sequences(src, calib, **kwargs)
