"""spark-quant: stream FP8 checkpoints to NVFP4 builds that engines load.

The package is layered; imports run one way, from the top floor down (docs/architecture.md,
enforced by tests/test_layers.py). This file imports nothing, so that any floor can be imported
without loading the floors above it. Entry points: the ``quantize`` command (``quantize.cli``)
and :func:`quantize.convert.pipeline.convert`.
"""

__version__ = "0.1.0"
