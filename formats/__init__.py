"""Bytes, tensor names, scale direction and config keys of checkpoint layouts.

No scale math here beyond packing, renaming and reciprocals; the numbers come from
``quantize.kernels``. Output writers are picked from ``WRITERS`` by their on-disk name.
"""

from enum import Enum
from types import ModuleType

__all__ = ["FORMATS", "OutputFormat", "SCHEMES", "get_writer"]


class OutputFormat(str, Enum):
    """Target checkpoint layouts; values are the names users pass to ``--format``."""

    COMPRESSED_TENSORS = "compressed-tensors"
    MODELOPT = "modelopt"


FORMATS = tuple(f.value for f in OutputFormat)
"""``--format`` names, the default first."""

SCHEMES = ("w4a16", "w4a4")
"""``--scheme`` names: weight-only NVFP4, or NVFP4 weights and activations (input scales)."""


def get_writer(name: str) -> ModuleType:
    """The writer module for ``name``: ``NVFP4_ORDER`` (the arithmetic order its kernels run),
    ``nvfp4_weight_scalar`` / ``nvfp4_input_scalar`` (the one scalar of each it stores, from an
    amax), ``emit_nvfp4``, ``emit_fp8_block``, ``emit_mxfp8``, ``emit_kv_scales``,
    ``output_specs`` / ``kv_scale_specs`` (names, dtypes, shapes it writes),
    ``quantization_config``, ``extra_files``.

    Raises:
        ValueError: unknown name, listing the valid ones.
    """
    from formats import compressed_tensors, modelopt

    writers = {OutputFormat.COMPRESSED_TENSORS: compressed_tensors, OutputFormat.MODELOPT: modelopt}
    try:
        return writers[OutputFormat(name)]
    except ValueError:
        raise ValueError(f"unknown output format {name!r} (valid: "
                         f"{', '.join(f.value for f in OutputFormat)})") from None
