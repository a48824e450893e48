"""One error type for everything a user can get wrong (config, flags, requests)."""


class DsakvError(ValueError):
    """A user-facing error: the CLI prints it as one `error:` line and exits 2."""


class ConfigError(DsakvError):
    """A model config or layer-plan override is invalid."""
