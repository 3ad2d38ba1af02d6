"""Error types. Each names what it is about (tensor, shard, key) and subclasses a stdlib type."""


class SparkQuantError(Exception):
    """Base of every error this project raises on purpose."""

    def __init__(self, message: str, *, tensor: str | None = None, shard: str | None = None,
                 key: str | None = None):
        super().__init__(message)
        self.tensor, self.shard, self.key = tensor, shard, key


class SourceError(SparkQuantError, ValueError):
    """The source checkpoint is missing, malformed or inconsistent."""


class FormatError(SparkQuantError, ValueError):
    """A tensor cannot be written in the requested target format."""


class RecipeError(SparkQuantError, ValueError):
    """A recipe is malformed or splits a fused group."""


class OutputError(SparkQuantError, OSError):
    """The output folder cannot be written (or resumed) safely."""


class CheckFailed(SparkQuantError, ValueError):
    """``quantize check`` found errors in a build (each finding names its tensor and rule)."""


class GateFailed(SparkQuantError, ValueError):
    """A build's eval gate is missing or failed, so it is not published."""


class CardError(SparkQuantError, ValueError):
    """The model card's metadata is invalid; ``key`` names the field."""
