"""The peer's GPTQ NVFP4 (llm-compressor), for benchmarks against our own (``calibrate.gptq``).

Models that fit in memory only; ``quantize nvfp4 --method gptq`` is our own, layer-streamed
GPTQ and does not need this.

llm-compressor 0.14.0.1 pins ``compressed-tensors==0.19.0`` and ``transformers<=5.17``
(docs/formats.md §L), which clash with this project's pins, so it lives in its own
environment and runs as a subprocess: ``peer_gptq`` (here) starts
``<python> scripts/peer_gptq.py ...`` with that environment's interpreter. The runner loads the
source through our own reader (FP8 dequantized to float32, ``eval.models.load_source_model``),
tokenizes the calibration set with ``calibrate.data`` (same samples as ``quantize
calibrate``), runs ``oneshot`` with ``GPTQModifier(scheme="NVFP4A16", targets="Linear",
ignore=["lm_head"])`` (llm-compressor fuses the q/k/v and gate/up global scales itself) and
saves a compressed-tensors ``nvfp4-pack-quantized`` build, which loads under
compressed-tensors 0.20.1 + transformers 5.24.

Environment (once)::

    python -m venv .venv-gptq
    echo "$PWD/.venv/lib/python3.11/site-packages" > .venv-gptq/lib/python3.11/site-packages/main.pth
    .venv-gptq/bin/pip install llmcompressor==0.14.0.1   # its pins shadow the main env's

then pass ``--gptq-python .venv-gptq/bin/python`` to ``scripts/calib_sweep.py`` (or set
``SPARK_QUANT_GPTQ_PYTHON``).
Dense (no routed experts) decoder models only.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from quantize import archs

__all__ = ["peer_gptq"]

_REPO = Path(__file__).resolve().parents[1]


def peer_gptq(src: str | Path, out: str | Path, *, dataset: str, samples: int = 128,
                 seq_len: int = 512, seed: int = 0, python: str | None = None,
                 dampening: float = 0.01) -> Path:
    """Write a GPTQ NVFP4A16 build of ``src`` into ``out`` (see the module docstring).

    Args:
        python: interpreter of the llm-compressor environment (default
            ``$SPARK_QUANT_GPTQ_PYTHON``).
        dampening: GPTQ dampening fraction (llm-compressor ``dampening_frac``).

    Returns:
        ``out``.

    Raises:
        RuntimeError: no such environment, or the runner failed (its stderr tail included).
    """
    python = python or os.environ.get("SPARK_QUANT_GPTQ_PYTHON")
    if not python or not Path(python).is_file():
        raise RuntimeError("the peer's GPTQ needs an environment with llm-compressor: pass its python "
                           "(--gptq-python or SPARK_QUANT_GPTQ_PYTHON); see scripts/peer_gptq.py")
    cmd = [python, str(_REPO / "scripts" / "peer_gptq.py"), "--src", str(src), "--out", str(out), "--dataset", dataset,
           "--samples", str(samples), "--seq-len", str(seq_len), "--seed", str(seed),
           "--dampening", str(dampening)]
    env = dict(os.environ, PYTHONPATH=str(_REPO))
    r = subprocess.run(cmd, cwd=_REPO, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"GPTQ runner failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return Path(out)


def _main(argv=None) -> int:  # runs inside the llm-compressor environment
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from transformers import AutoTokenizer

    from calibrate import _tokenizer
    from calibrate.data import build_calib_set
    from eval.models import load_source_model

    p = argparse.ArgumentParser()
    for a in ("--src", "--out", "--dataset"):
        p.add_argument(a, required=True)
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dampening", type=float, default=0.01)
    a = p.parse_args(argv)
    src = Path(a.src)
    tok = _tokenizer(src)
    cfg = json.loads((src / "config.json").read_text())
    calib = build_calib_set(a.dataset, tok, samples=a.samples, seq_len=a.seq_len, seed=a.seed,
                            vocab_size=archs.text_config(cfg).get("vocab_size"))
    ds = Dataset.from_dict({"input_ids": [s[0].tolist() for s in calib.sequences],
                            "attention_mask": [[1] * s.shape[1] for s in calib.sequences]})
    model = load_source_model(src, dtype=torch.float32)
    # oneshot re-reads config.json from name_or_path and refuses a quantized one: point it at
    # the dequantized config (no quantization_config).
    plain = Path(tempfile.mkdtemp(prefix="spark-quant-gptq-"))
    model.config.save_pretrained(plain)
    model.config._name_or_path = str(plain)
    recipe = GPTQModifier(targets="Linear", scheme="NVFP4A16", ignore=["lm_head"],
                          dampening_frac=a.dampening)
    oneshot(model=model, processor=tok, dataset=ds, recipe=recipe, num_calibration_samples=len(calib.sequences),
            max_seq_length=a.seq_len)
    model.save_pretrained(a.out, save_compressed=True)
    (tok or AutoTokenizer.from_pretrained(src)).save_pretrained(a.out)
    (Path(a.out) / "spark_quant_gptq.json").write_text(json.dumps({"calibration": calib.meta,
                                                                   "dampening": a.dampening}))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
