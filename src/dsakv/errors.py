"""One error type for everything a user can get wrong (config, flags, requests), and the
checks every layer runs on what users hand it."""


class DsakvError(ValueError):
    """A user-facing error: the CLI prints it as one `error:` line and exits 2. `param`:
    the request field at fault, where there is one (an HTTP error's `param`)."""

    def __init__(self, message: str = "", param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ConfigError(DsakvError):
    """A model config or layer-plan override is invalid."""


def is_int(x: object) -> bool:
    """An int, not a bool (a count, a token id, a page: True is not 1 here)."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: object) -> bool:
    """An int or float, not a bool (JSON's numbers; True is not 1 here)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)
