"""The interface every NVFP4 kernel backend returns: one weight, ready to quantize.

Its own module so that the dispatcher (:mod:`quantize.kernels.fused`) and the backends it
dispatches to (:mod:`quantize.kernels.triton_nvfp4`) both import it without importing each other.
"""

import torch

__all__ = ["Prepared"]


class Prepared:
    """One weight ready to quantize: ``amax`` (max |w|, 0-dim float32; NaN or inf when the
    weight holds non-finite values), then ``quantize(scalar)`` ->
    ``(packed uint8 [N, K/2], block_scale float8_e4m3fn [N, K/16])`` on the CPU, where
    ``scalar`` is the global scale (order ``global``, float32 [1]) or ``scale_2`` (order
    ``scale_2``, 0-dim float32) of the tensor or its fused group."""

    amax: torch.Tensor
    order: str = "global"

    def quantize(self, scalar: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _scalar(self, scalar: torch.Tensor) -> torch.Tensor:
        return scalar.to(torch.float32).reshape(() if self.order == "scale_2" else (1,))
