"""What `spec export` raises: a draft an engine cannot serve as trained, or an export that failed
its self-check. Both are user-facing (the CLI prints one line and exits 1)."""

from spec_cli.errors import ArtifactError


class ExportError(ArtifactError):
    """The draft cannot be exported for this engine without serving differently than it was trained."""


class ExportCheckError(ExportError):
    """The written folder, read back with the engine's loading rules, does not reproduce the checkpoint."""
