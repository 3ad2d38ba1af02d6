"""Calibration (layer-streamed activation statistics). See issue 5."""
