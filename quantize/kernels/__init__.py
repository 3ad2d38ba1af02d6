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

SCALES_AUTO = "auto"
"""``--scales auto`` (the default): the method of :data:`SCALES_BY_DEVICE` for the device the
conversion runs on."""

SCALES_BY_DEVICE = {"cuda": "mse", "cpu": "rtn"}
"""What ``--scales auto`` runs per device type. The search (``mse``) where it costs nothing
measurable end to end: CUDA (Triton), where a full-width GLM-5.3-Flash MoE layer converted in
0.96x the round-to-nearest time on the H200 (disk-bound; the search kernel alone runs at 0.93x
RTN's rate once compiled). Round-to-nearest where the search is compute-bound: CPU, 5.05x RTN
end to end on 2 cores. docs/formats.md §B.0 "Block-scale search" (the measurements)."""


def resolve_scales(scales: str, device_type: str) -> str:
    """The block-scale method a conversion on ``device_type`` (``cuda`` / ``cpu``) runs for
    ``scales``: one of :data:`SCALE_METHODS` as given, or ``auto`` resolved by
    :data:`SCALES_BY_DEVICE` (any other device type: ``rtn``).

    Raises:
        ValueError: ``scales`` is neither ``auto`` nor one of :data:`SCALE_METHODS`.
    """
    if scales == SCALES_AUTO:
        return SCALES_BY_DEVICE.get(device_type, "rtn")
    if scales not in SCALE_METHODS:
        raise ValueError(f"unknown --scales {scales!r} (valid: auto, {', '.join(SCALE_METHODS)})")
    return scales
