"""One error type for everything a user can get wrong (config, flags, requests), and the
checks every layer runs on what users hand it."""

import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any


class DsakvError(ValueError):
    """A user-facing error: the CLI prints it as one `error:` line and exits 2. `param`:
    the request field at fault, where there is one (an HTTP error's `param`)."""

    def __init__(self, message: str = "", param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLong(DsakvError):
    """A prompt of `tokens` tokens (at least) where `limit` fit: the context less the one
    kept for the output, or under HiSparse the device's latent pool. With `max_tokens`
    (the output the client asked for) it fits alone but not with them: `limit` is then the
    context, for both. Its counts are data for the APIs that word it their own way
    (Anthropic's: what Claude Code reads to compact a conversation)."""

    def __init__(
        self,
        message: str,
        tokens: int,
        limit: int,
        max_tokens: int = 0,
        param: str | None = None,
    ) -> None:
        super().__init__(message, param)
        self.tokens, self.limit, self.max_tokens = tokens, limit, max_tokens

    def __reduce__(self) -> tuple:
        # (copied and pickled whole, counts included: the default passes the message alone)
        return type(self), (str(self), self.tokens, self.limit, self.max_tokens, self.param)


class ConfigError(DsakvError):
    """A model config or layer-plan override is invalid."""


def one_line(e: BaseException, named: bool = True) -> str:
    """`e` on one line, to quote in a message of ours: "Type: what it says" (just what it
    says unless `named`), a multi-line error's line breaks and indents collapsed."""
    return " ".join((f"{type(e).__name__}: {e}" if named else str(e)).split())


def is_int(x: object) -> bool:
    """An int, not a bool (a count, a token id, a page: True is not 1 here)."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_list(x: object) -> bool:
    """A list, tuple or other sequence, but not text or bytes (which are sequences too)."""
    return isinstance(x, Sequence) and not isinstance(x, (str, bytes, bytearray))


def is_number(x: object) -> bool:
    """An int or float, not a bool (JSON's numbers; True is not 1 here)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


# What may decode to a lone surrogate: its escape (a str may hold one raw too: `_unwritable`;
# text decoded from UTF-8 cannot). A literal first: the search skips ahead by it.
_ESCAPED_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"the number {text[:32]} is past a double's range")
    return value


def load_json(
    text: str | bytes, message: str, error: type[DsakvError] = DsakvError, strict: bool = False
) -> Any:
    """`json.loads(text)`, every way it refuses text as one `error`, "`message`: why": not
    JSON, and past its limits (an integer of over 4,300 digits, nesting deeper than the
    recursion limit), where it raises a ValueError or RecursionError that were tracebacks.
    `strict` (a client's request): also what Python takes but RFC 8259 JSON cannot hold,
    which no answer could quote back (Starlette's JSON, a batch's output file): NaN and
    Infinity, a number past a double's range (1e999), a lone surrogate ("\\ud800"), text
    not UTF-8. Taken, it was a 500, or stored and then every read of it one. The error's
    `param`: the object's field that holds it, where one does."""
    try:
        if not strict:
            return json.loads(text)
        raw = isinstance(text, str) and _unwritable(text)
        if isinstance(text, bytes):
            text = text.decode("utf-8-sig")  # (as json.loads decodes it, less UTF-16 and -32)
        obj = json.loads(text, parse_constant=_no_constant, parse_float=_finite)
        if raw or _ESCAPED_SURROGATE.search(text):  # (a pair decodes to one character)
            json.dumps(obj, ensure_ascii=False).encode()
        return obj
    except RecursionError:
        reason = "nested too deeply"
    except UnicodeEncodeError as e:
        reason = f"a lone surrogate {ascii(e.object[e.start])} is not text"
    except ValueError as e:  # JSONDecodeError, or the digit limit ("...; use sys.set_...")
        reason = str(e).split(";")[0]
    raise error(f"{message}: {reason}", _field_refused(text) if strict else None)


def _field_refused(text: str | bytes) -> str | None:
    """The field of a JSON object (`text`, as Python reads it) whose value holds what strict
    JSON refuses (`load_json`), named as a request's error names it; None: none does."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return None
    for key, value in obj.items() if isinstance(obj, dict) else ():
        if _unwritable(key):
            return None  # (a name no answer can quote back is no param)
        todo = [value]
        while todo:
            x = todo.pop()
            if isinstance(x, (dict, list)):
                todo += [*x, *x.values()] if isinstance(x, dict) else x
            elif _unwritable(x) or isinstance(x, float) and not math.isfinite(x):
                return key
    return None


def _unwritable(x: Any) -> bool:
    """A str holding a lone surrogate, which no UTF-8 text can."""
    if isinstance(x, str):
        try:
            x.encode()
        except UnicodeEncodeError:
            return True
    return False


def load_object(
    source: str | Mapping[str, Any], known: Sequence[str], name: str = ""
) -> Mapping[str, Any]:
    """A JSON-object flag's value (JSON text or a mapping) with only `known` keys; one
    ConfigError otherwise: not JSON, not an object, an unknown key. `name` (the flag) starts
    its message; without it the caller's wrapping names it."""
    subject, has = (f"{name} is ", f"{name} has ") if name else ("", "")
    text = isinstance(source, str)
    raw = load_json(source, f"{subject}not valid JSON", ConfigError) if text else source
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{name} must be a JSON object, got {raw!r}".lstrip())
    unknown = sorted(str(k) for k in raw if k not in known)
    if unknown:
        raise ConfigError(f"{has}unknown key(s) {', '.join(unknown)} (known: {', '.join(known)})")
    return raw
