"""Number crunching only: tensors in, tensors out. No tensor names, no format names.

Nothing in this package imports from the rest of the project. The names users pick from
live here (importing them loads no torch):
"""

BACKENDS = ("auto", "reference", "inductor", "triton")
"""NVFP4 kernel backends (``--kernel``), :func:`quantize.kernels.fused.choose_backend`."""

SCALE_METHODS = ("rtn", "4over6", "mse", "mse-act")
"""Block-scale methods (``--scales``): round-to-nearest; Four Over Six (per block the amax to 6
or to 4, whichever errs less); the least-squares search over Four Over Six and the
neighbouring e4m3 codes (:mod:`quantize.kernels.scale_search`); the same search weighted by
calibration activations. Every method runs in both arithmetic orders and in every kernel."""
