"""Error types and findings. Each names what it is about (tensor, shard, key); errors also
subclass a stdlib type."""

from dataclasses import dataclass


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


class CalibrationError(SparkQuantError, ValueError):
    """Calibration statistics are missing, incomplete or do not match the source."""


class DataError(SparkQuantError, RuntimeError):
    """A data set cannot be loaded: unknown or unreachable name, or its package is missing."""


LEVELS = ("error", "warning", "info")


@dataclass(frozen=True)
class Finding:
    """One result of a pre-flight or verify check.

    ``level``: ``error`` (stops the run), ``warning`` (reported, recorded in the manifest
    notes) or ``info``; ``kind``: the check family (``config``, ``index``, ``header``,
    ``fp8``, ``scale``, ``layout``, ``output``, ...); the message names the tensor, shard or
    key, which are also kept as fields.
    """

    level: str
    kind: str
    message: str
    tensor: str | None = None
    shard: str | None = None
    key: str | None = None

    def render(self) -> str:
        return f"{self.level}: [{self.kind}] {self.message}"

    @classmethod
    def of(cls, err: SparkQuantError, kind: str, level: str = "error") -> "Finding":
        """A finding from a raised error, keeping what it names."""
        return cls(level, kind, str(err), err.tensor, err.shard, err.key)


def render_findings(findings: list[Finding], per_kind: int = 25) -> str:
    """Findings sorted by level then kind, at most ``per_kind`` lines of each (level, kind),
    then a count of the rest."""
    lines, shown = [], {}
    ordered = sorted(findings, key=lambda f: LEVELS.index(f.level))
    for f in ordered:
        k = (f.level, f.kind)
        shown[k] = shown.get(k, 0) + 1
        if shown[k] <= per_kind:
            lines.append(f.render())
    lines += [f"{lvl}: [{kind}] ... and {n - per_kind} more"
              for (lvl, kind), n in shown.items() if n > per_kind]
    return "\n".join(lines)


def raise_findings(findings: list[Finding], what: str) -> None:
    """Raise one error listing every error-level finding (all kinds at once), if any.

    The exception is an :class:`OutputError` when every error is about the output folder,
    else a :class:`SourceError`; its ``tensor`` / ``shard`` / ``key`` are the first error's.

    Raises:
        SourceError, OutputError.
    """
    errors = [f for f in findings if f.level == "error"]
    if not errors:
        return
    cls = OutputError if all(f.kind == "output" for f in errors) else SourceError
    first = errors[0]
    raise cls(f"{len(errors)} problem(s) in {what}:\n" + render_findings(errors),
              tensor=first.tensor, shard=first.shard, key=first.key)
