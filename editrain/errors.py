"""Exception types shared across layers (kept import-light for the CLI)."""


class ConfigError(ValueError):
    """A configuration value (or combination) that cannot work."""


class RunDirError(ConfigError):
    """A run directory this job may not use (another run's, locked by another job)."""


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupt or incompatible."""
