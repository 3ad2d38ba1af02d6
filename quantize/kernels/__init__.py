"""Number crunching only: tensors in, tensors out. No tensor names, no format names.

Nothing in this package imports from the rest of the project. The names users pick from
live here (importing them loads no torch):
"""

BACKENDS = ("auto", "reference", "inductor", "triton")
"""NVFP4 kernel backends (``--kernel``), :func:`quantize.kernels.fused.choose_backend`."""

SCALE_METHODS = ("rtn", "mse", "mse-act")
"""Block-scale methods (``--scales``): round-to-nearest, the least-squares search
(:mod:`quantize.kernels.scale_search`), the search weighted by calibration activations."""
