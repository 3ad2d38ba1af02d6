"""Element and scale formats used by NVFP4 and block FP8.

Sources: OCP Microscaling spec v1.0 (e2m1, e4m3, e8m0); NVIDIA's NVFP4 definition as
implemented in compressed-tensors ``compressors/nvfp4/helpers.py`` (kE2M1ToFloat) and
nvidia-modelopt ``quantization/qtensor/nvfp4_tensor.py`` (e2m1_values).
"""

import numpy as np
import torch

E2M1_MAX = 6.0
"""Largest e2m1 magnitude (code 0b0111)."""

E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn value (byte 0x7E); 0x7F / 0xFF are NaN."""

E4M3_MIN_SUBNORMAL = 2.0**-9
"""Smallest positive float8_e4m3fn value (byte 0x01)."""

NVFP4_GROUP_SIZE = 16
"""Elements along K that share one e4m3 block scale."""

NVFP4_GLOBAL_NUMERATOR = E4M3_MAX * E2M1_MAX
"""6 * 448 = 2688: global scale = 2688 / amax (compressed-tensors direction)."""

CT_ZERO_BLOCK_SCALE = 0.125
"""compressed-tensors replaces a zero e4m3 block scale by this value
(``quantization/utils/helpers.py`` ``_get_dtype_eps`` for float8_e4m3fn)."""

E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float32)
"""Magnitudes of e2m1 codes 0..7; code | 0x8 is the negative."""

E2M1_LUT = torch.cat([E2M1_VALUES, -E2M1_VALUES])
"""All 16 e2m1 codes to float32 (code 8 is -0.0)."""

# Rounding thresholds for |x| -> e2m1 code, nearest with ties to the even code:
# a threshold marked ">" means a tie goes down, ">=" means a tie goes up.
# Same table as compressed-tensors ``cast_to_fp4`` and modelopt ``_cast_fp4``.
E2M1_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True),
                   (2.5, False), (3.5, True), (5.0, False))


def count_bytes(t: torch.Tensor, value: int, mask: int = 0xFF) -> int:
    """Number of bytes ``b`` of the CPU tensor ``t`` (any 1-byte dtype, e.g. e4m3 block
    scales) with ``b & mask == value``: ``count_bytes(s, 0x7F, 0x7F)`` counts e4m3 NaN codes,
    ``count_bytes(s, 0x01)`` scales at the e4m3 floor 2^-9. Counted through numpy, whose
    byte compares are vectorized (torch's uint8 compare + sum runs tens of times slower on CPU).
    """
    b = t.contiguous().view(torch.uint8).numpy()
    return int(np.count_nonzero((b & mask if mask != 0xFF else b) == value))
