"""One error type for everything a user can get wrong (config, flags, requests)."""


class DsakvError(ValueError):
    """A user-facing error: the CLI prints it as one `error:` line and exits 2. `param`:
    the request field at fault, where there is one (an HTTP error's `param`)."""

    def __init__(self, message: str = "", param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ConfigError(DsakvError):
    """A model config or layer-plan override is invalid."""
