"""Exception types shared across layers (kept import-light for the CLI)."""


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupt or incompatible."""
