"""User-facing error types.

Library code raises these; the CLI turns each into one line that says what went wrong and what to
do next, and exits 1. Anything else that escapes is a bug and is reported as such.
"""


class SpecError(Exception):
    """An error the user can fix. `hint` says how."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def one_line(self) -> str:
        return f"{self.message}; {self.hint}" if self.hint else self.message


class ConfigError(SpecError):
    """Bad options or config file."""


class DataError(SpecError):
    """Chat data that cannot be read or yields nothing usable."""


class TargetError(SpecError):
    """A target model or tokenizer that cannot be loaded or used."""


class ArtifactError(SpecError):
    """An artifact that is missing, corrupt, or made from different inputs."""


class AssetError(SpecError):
    """A built-in asset that cannot be found or installed."""


class ExportError(ArtifactError):
    """The draft cannot be exported for this format's serving engine without serving differently than it
    was trained."""


class ExportCheckError(ExportError):
    """The written folder, read back with its serving engine's loading rules, does not reproduce the
    checkpoint."""


def listing(problems: list[str], shown: int = 3) -> str:
    """The first problems, joined for a one-line error, and how many more there are."""
    more = f" (+{len(problems) - shown} more)" if len(problems) > shown else ""
    return "; ".join(problems[:shown]) + more


class TrainingError(SpecError):
    """Training cannot go on (a non-finite loss); the last good checkpoint is kept."""


_FULL_TEXTS = ("No space left on device", "os error 28", "Disk quota exceeded", "os error 122")


def is_disk_full(exc: BaseException) -> bool:
    """ENOSPC / EDQUOT, also as safetensors' own error (its Rust writer says "os error 28")."""
    import errno

    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return isinstance(exc, Exception) and any(text in str(exc) for text in _FULL_TEXTS)
