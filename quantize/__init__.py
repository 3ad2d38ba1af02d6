"""spark-quant: stream FP8 checkpoints to NVFP4 builds that engines load."""

__version__ = "0.1.0"

__all__ = ["__version__", "convert", "load_recipe", "Target", "SparkQuantError", "SourceError",
           "RecipeError", "FormatError", "OutputError"]

from quantize.errors import FormatError, OutputError, RecipeError, SourceError, SparkQuantError  # noqa: E402
from quantize.recipe import Target, load_recipe  # noqa: E402


def convert(*args, **kwargs):
    """See :func:`quantize.pipeline.convert` (imported lazily to keep ``import quantize`` light)."""
    from quantize.pipeline import convert as _convert

    return _convert(*args, **kwargs)
