"""Tool-call and reasoning parsers for chat completions: GLM-4.5/4.7/5, DeepSeek-V3.2 and
DeepSeek-V3.1 (whose markup DeepSeek-V3.2-Exp's chat template writes).

Both are incremental: `feed` takes each new piece of generated text and returns what is
settled (text that could still turn out to start a tag is held back); a non-streamed
response is the same parser fed the whole text at once, so streamed and non-streamed
results cannot disagree. Malformed or cut-off markup never raises: a call whose name was
read is closed with the arguments read so far (cut by max_tokens: left open, with the
argument being written when the cut came as far as it got), everything else stays content.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Container, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import regex

from dsakv.engine.chat_format import DSML
from dsakv.errors import DsakvError

from .protocol import new_id

TOOL_PARSERS = ("glm47", "glm45", "deepseekv32", "deepseekv31")
REASONING_PARSERS = ("glm45", "deepseek-v3")
# model_type -> (tool-call parser, reasoning parser) used when the server is not told.
DEFAULT_PARSERS = {
    "glm_moe_dsa": ("glm47", "glm45"),
    "deepseek_v32": ("deepseekv32", "deepseek-v3"),
}
# vLLM's names for the same parsers (in its DeepSeek-V3.2 launch commands)
_VLLM_TOOL_PARSERS = {"deepseek_v32": "deepseekv32", "deepseek_v31": "deepseekv31"}
_VLLM_REASONING_PARSERS = {"deepseek_v3": "deepseek-v3"}
THINK_START, THINK_END = "<think>", "</think>"
_TEXT = "text"  # the parser state outside any tool-call markup


def resolve_parsers(
    model_type: str,
    tool_parser: str | None,
    reasoning_parser: str | None,
    chat_template: str | None = None,
) -> tuple[str | None, str | None]:
    """The parser names to use: "auto" (or None) picks the model type's default, "none"
    turns a parser off, vLLM's names are dsakv's (SGLang's); anything unknown is a
    `DsakvError`. A DeepSeek-V3.2 model whose `chat_template` writes DeepSeek-V3.1's
    tool-call markup (V3.2-Exp's does; V3.2 ships none) defaults to that markup's parser."""
    defaults = DEFAULT_PARSERS.get(model_type, (None, None))
    if model_type == "deepseek_v32" and chat_template and _V31_CALLS in chat_template:
        defaults = ("deepseekv31", defaults[1])
    out = []
    for name, known, vllm, default, what in (
        (tool_parser, TOOL_PARSERS, _VLLM_TOOL_PARSERS, defaults[0], "tool-call"),
        (reasoning_parser, REASONING_PARSERS, _VLLM_REASONING_PARSERS, defaults[1], "reasoning"),
    ):
        name = vllm.get(name, name)
        if name in (None, "auto"):
            out.append(default)
        elif name == "none":
            out.append(None)
        elif name in known:
            out.append(name)
        else:
            choices = ", ".join((*known, "auto", "none"))
            raise DsakvError(f"unknown {what} parser {name!r} (choose from {choices})")
    return out[0], out[1]


# --- tool-call formats ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Rule:
    """One markup element a state accepts: `kind` says what a match means ("start" a call
    named `name`, an "arg" `key`/`value`, a whole "json" argument object, the call's "end",
    "start_end" for a call without arguments, or "skip"), `next` the state after it."""

    pattern: regex.Pattern[str]
    kind: str
    next: str


@dataclass(frozen=True)
class ToolFormat:
    """A model's tool-call markup: the trigger that opens it, and per state the rules that may
    follow (tried in order: the first full match is taken). `structural_tag` names
    xgrammar's builtin grammar for the same format. `partial` matches (whole) what is left
    of an open call's arguments when max_tokens cut them, after any proper prefix of one of
    `tags` at the end is taken off: the argument being written, its `key` (closed when
    `key_end` matched), and the `value` once begun; or `close`, the arguments complete.
    `json_values`: keys and values are written as JSON (JSON-escaped keys, JSON values),
    not as raw text."""

    trigger: str
    first: str
    states: Mapping[str, tuple[_Rule, ...]]
    structural_tag: str
    partial: regex.Pattern[str]
    tags: tuple[str, ...]
    json_values: bool = False


def _rule(pattern: str, kind: str, next: str) -> _Rule:
    return _Rule(regex.compile(pattern, regex.DOTALL), kind, next)


# GLM-4.7/5: <tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value>...</tool_call>;
# GLM-4.5/4.6 put newlines after the name and between pairs (the \s* below). A value
# whose close tag is missing ends at the call's (as vLLM reads it), not at a later call's.
_GLM = ToolFormat(
    trigger="<tool_call>",
    first="name",
    states={
        "name": (
            _rule(r"\s*(?P<name>[^\s<>]+)\s*</tool_call>", "start_end", _TEXT),
            _rule(r"\s*(?P<name>[^\s<>]+)\s*(?=<arg_key>)", "start", "args"),
        ),
        "args": (
            _rule(
                r"\s*<arg_key>\s*(?P<key>[^<>]*?)\s*</arg_key>\s*"
                r"<arg_value>(?P<value>.*?)(?:</arg_value>|(?=</tool_call>))",
                "arg",
                "args",
            ),
            _rule(r"\s*</tool_call>", "end", _TEXT),
        ),
    },
    structural_tag="glm_4_7",
    partial=regex.compile(
        r"\s*<arg_key>\s*(?P<key>[^<>]*?)\s*"
        r"(?:</arg_key>(?P<key_end>)\s*(?:<arg_value>(?P<value>.*))?)?",
        regex.DOTALL,
    ),
    tags=("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "</tool_call>"),
)

_D = DSML
# DeepSeek-V3.2 DSML: parameters with string="true" (raw text) or "false" (JSON); some
# outputs put one JSON object in the invoke instead.
_DEEPSEEK = ToolFormat(
    trigger=f"<{_D}function_calls>",
    first="block",
    states={
        "block": (
            _rule(rf'\s*<{_D}invoke\s+name="(?P<name>[^"<>]*)"\s*>', "start", "invoke"),
            _rule(rf"\s*</{_D}function_calls>", "skip", _TEXT),
        ),
        "invoke": (
            _rule(
                rf'\s*<{_D}parameter\s+name="(?P<key>[^"<>]*)"\s+string="(?P<string>true|false)"'
                rf"\s*>(?P<value>.*?)(?:</{_D}parameter>|(?=</{_D}invoke>))",
                "arg",
                "invoke",
            ),
            _rule(rf"\s*(?P<json>\{{.*?\}})\s*</{_D}invoke>", "json", "block"),
            _rule(rf"\s*</{_D}invoke>", "end", "block"),
        ),
    },
    structural_tag="deepseek_v3_2",
    partial=regex.compile(
        rf'\s*<{_D}parameter\s+name="(?P<key>[^"<>]*)(?:"(?P<key_end>)'
        rf'(?:\s+string="(?P<string>true|false)"\s*>(?P<value>.*)|[^<>]*))?',
        regex.DOTALL,
    ),
    tags=(f"<{_D}parameter", f"</{_D}parameter>", f"</{_D}invoke>"),
)

# DeepSeek-V3.1 (and V3.2-Exp's chat template): one JSON arguments object per call,
# <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>name<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...
# <｜tool▁calls▁end｜>. The object is read member by member (each given out when complete,
# as the other formats' arguments); anything else up to the call's end tag (or, that tag
# missing, up to the next call or the block's end) ends the call with the members read.
_V31_CALLS, _V31_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
_V31_CALL, _V31_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
_V31_SEP = "<｜tool▁sep｜>"
_JSON_CHARS = r'(?:[^"\\]++|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*+'  # a JSON string's inside
_JSON = (  # (regex's recursion: `jval` is one JSON value, whitespace around it included;
    # Python's True, False and None too, which the model writes at times and vLLM passes on)
    rf'(?(DEFINE)(?P<jstr>"{_JSON_CHARS}")(?P<jval>\s*(?:(?&jstr)|true|false|null|True|False|None'
    r"|-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][-+]?\d+)?"
    r"|\{\s*(?:(?&jstr)\s*:(?&jval)(?:,\s*(?&jstr)\s*:(?&jval))*)?\}"
    r"|\[\s*(?:(?&jval)(?:,(?&jval))*)?\])\s*))"
)
_V31 = ToolFormat(
    trigger=_V31_CALLS,
    first="block",
    states={
        "block": (
            _rule(rf"\s*{_V31_CALL}\s*(?P<name>[^\s<>]+)\s*{_V31_SEP}", "start", "args"),
            _rule(rf"\s*{_V31_CALLS_END}", "skip", _TEXT),
        ),
        "args": (
            _rule(
                rf'{_JSON}\s*[{{,]?\s*"(?P<key>{_JSON_CHARS})"\s*:(?P<value>(?&jval))(?=[,}}])',
                "arg",
                "args",
            ),
            _rule(  # (possessive, no tag crossed: a rescan per piece fed stays cheap)
                rf"(?:[^<]++|<(?!{_V31_CALL[1:]}|{_V31_CALL_END[1:]}|{_V31_CALLS_END[1:]}))*+"
                rf"(?:{_V31_CALL_END}|(?={_V31_CALL}|{_V31_CALLS_END}))",
                "end",
                "block",
            ),
        ),
    },
    structural_tag="deepseek_v3_1",
    partial=regex.compile(
        r'\s*[{,]?\s*(?:"(?P<key>(?:[^"\\]|\\.)*\\?)'
        r'(?:"(?P<key_end>)\s*(?::(?P<value>.*))?)?|(?P<close>\}).*)',
        regex.DOTALL,
    ),
    tags=(_V31_CALL_END, _V31_CALL, _V31_CALLS_END),
    json_values=True,
)

TOOL_FORMATS = {"glm47": _GLM, "glm45": _GLM, "deepseekv32": _DEEPSEEK, "deepseekv31": _V31}


def _partial_suffix(text: str, tags: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


def _held_back(text: str, trigger: str) -> int:
    """How much of `text`'s end to hold back: a possible start of `trigger`, and the
    whitespace before it (dropped if a call follows, so content is not just a newline)."""
    keep = _partial_suffix(text, [trigger])
    head = text[: len(text) - keep]
    return keep + len(head) - len(head.rstrip())


def _declared_types(schema: Any) -> set[str]:
    t = schema.get("type") if isinstance(schema, dict) else None
    return {t} if isinstance(t, str) else set(t) if isinstance(t, list) else set()


def _typed(raw: str, is_string: bool) -> Any:
    """A raw argument value as JSON: strings stay as written; anything else is parsed, as
    JSON or else a Python literal (`True`, `None`, `{'k': 1}`: vLLM's `_deserialize`), and
    kept as its text when it is neither."""
    if is_string:
        return raw
    raw = raw.strip()
    try:
        return json.loads(raw)
    except ValueError:
        pass
    try:
        value = ast.literal_eval(raw)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return raw
    try:
        json.dumps(value)  # (a set, bytes or complex has no JSON form)
    except (TypeError, ValueError):
        return raw
    return value


_LITERALS = ("true", "false", "null")
_PY_LITERAL = regex.compile(r'"(?:[^"\\]|\\.)*+"?|\b(?:True|False|None)\b')  # (strings kept)


def _as_json_literal(m: regex.Match[str]) -> str:
    """Python's True/False/None (outside strings) as JSON's, so a value mixing both parses."""
    return {"True": "true", "False": "false", "None": "null"}.get(m[0], m[0])


def _partial_value(raw: str, is_string: bool) -> str:
    """JSON text for the start of a value cut off at `raw`: a string left unterminated;
    else JSON as written (a number, a container or literal begun), a JSON string begun
    (read as the whole value will be: `_json_string`), or a string begun."""
    if not is_string:
        value = _typed(raw, False)
        if not isinstance(value, str):
            return json.dumps(value, ensure_ascii=False)
        raw = raw.lstrip()
        if raw.startswith('"'):
            return json.dumps(_json_string(raw[1:]), ensure_ascii=False)[:-1]
        if raw[:1] in tuple('{["-0123456789') or any(w.startswith(raw) for w in _LITERALS):
            return raw
    return json.dumps(raw, ensure_ascii=False)[:-1]


def _json_string(inside: str) -> str:
    """The text of a JSON string from the `inside` of its quotes, as far as it reads (an
    escape cut off at the end, a surrogate pair's first half, or the close quote, left
    out); as written if it never does."""
    for end in range(len(inside), max(len(inside) - 7, -1), -1):
        try:
            text = json.loads(f'"{inside[:end]}"')
        except ValueError:
            continue
        return text[:-1] if text and "\ud800" <= text[-1] <= "\udbff" else text
    return inside


@dataclass
class ToolCallDelta:
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class ToolCallParser:
    """Incremental parser of one response's tool calls in `fmt`. `tools` maps each tool's
    name to its parameters schema, which types the argument values. `forced`: a grammar
    forces the calls (`tool_choice` required or named), so text can only end inside markup
    when it was cut off."""

    def __init__(
        self, fmt: ToolFormat, tools: Mapping[str, Any] | None = None, forced: bool = False
    ) -> None:
        self.fmt = fmt
        self.tools = dict(tools or {})
        self.forced = forced
        self.content = ""
        self.calls: list[dict[str, Any]] = []  # OpenAI tool_calls, arguments as JSON text
        self._buf = ""
        self._state = _TEXT
        self._open = False  # a call is open (its arguments object not yet closed)
        self._args = 0  # arguments written into the open call
        self._block_calls = 0  # calls started since the last trigger

    def feed(self, text: str, final: bool = False, cut: bool = False) -> ToolCallDelta:
        """Consume `text`; return the settled content and tool-call deltas. `final` flushes
        whatever was held back: a call that ends mid-markup is closed with the arguments that
        were complete, and its partial markup dropped. `cut` (with `final`: the generation
        hit max_tokens) leaves such a call's arguments as far as they were written instead,
        unclosed JSON as OpenAI reports a call cut off (the argument being written included,
        so a client sees what the model wrote); `cut` or `forced` also drops a trigger cut
        off, or left alone, at the end; a response that stopped there by itself keeps it as
        content."""
        self._buf += text
        out = ToolCallDelta()
        pos = 0
        drop = final and (cut or self.forced)
        while True:
            if self._state == _TEXT:
                i = self._buf.find(self.fmt.trigger, pos)
                if i < 0:
                    rest, trigger = self._buf[pos:], self.fmt.trigger
                    cut_off = drop and _partial_suffix(rest, [trigger])
                    keep = _held_back(rest, trigger) if cut_off or not final else 0
                    out.content += rest[: len(rest) - keep]
                    pos = len(self._buf) - keep  # (one cut off stays, never given out: `held`)
                    break
                out.content += self._buf[pos:i].rstrip()  # the call's lead-in whitespace
                pos = i + len(self.fmt.trigger)
                self._state, self._block_calls = self.fmt.first, 0
                continue
            step = self._match(pos)
            if step is None and not final:
                break  # could still become valid markup: wait for more text
            if step is None:  # the text ends inside markup (max_tokens): a call cut off,
                if self._open or self._buf[pos:].strip() or drop:  # not content; an open
                    if self._open and cut:  # call keeps the arguments written
                        self._emit_partial(self._buf[pos:], out)
                    elif self._open:
                        self._close(out)
                    pos, self._state = len(self._buf), _TEXT
                    break
                step = False  # only the trigger: text, as below
            if step is False:  # malformed: not a call after all
                if self._open:
                    self._close(out)
                elif self._block_calls == 0:
                    out.content += self.fmt.trigger  # not a call after all: show it as text
                self._state = _TEXT
                continue
            m, rule = step
            self._apply(m, rule, out)
            pos, self._state = m.end(), rule.next
        self._buf = self._buf[pos:]
        self.content += out.content
        out.tool_calls = _merge(out.tool_calls)
        return out

    def _match(self, pos: int) -> tuple[regex.Match[str], _Rule] | None | bool:
        """The full match at `pos`, None if one may still come, False if none can."""
        waiting = False
        for rule in self.fmt.states[self._state]:
            m = rule.pattern.match(self._buf, pos, partial=True)
            if m is None:
                continue
            if m.partial:
                waiting = True
            elif rule.kind != "json" or self._json_args(m["json"]) is not None:
                return m, rule
        return None if waiting else False

    def _json_args(self, text: str) -> dict[str, Any] | None:
        if self._args:
            return None
        try:
            obj = json.loads(text)
        except ValueError:
            return None
        return obj if isinstance(obj, dict) else None

    def _apply(self, m: regex.Match[str], rule: _Rule, out: ToolCallDelta) -> None:
        if rule.kind in ("start", "start_end"):
            call = {
                "id": new_id("call_", 24),
                "type": "function",
                "function": {"name": m["name"], "arguments": ""},
            }
            self.calls.append(call)
            out.tool_calls.append({"index": len(self.calls) - 1, **json.loads(json.dumps(call))})
            self._open, self._args = True, 0
            self._block_calls += 1
            if rule.kind == "start_end":
                self._close(out)
        elif rule.kind == "arg":
            is_string, raw = self._raw_value(m)
            value = _typed(raw, is_string)
            sep = ", " if self._args else "{"
            self._emit(
                out,
                f"{sep}{json.dumps(self._key(m['key']), ensure_ascii=False)}: "
                f"{json.dumps(value, ensure_ascii=False)}",
            )
            self._args += 1
        elif rule.kind == "json":
            self._emit(out, json.dumps(self._json_args(m["json"]), ensure_ascii=False))
            self._open = False
        elif rule.kind == "end":
            self._close(out)

    def _key(self, raw: str) -> str:
        return _json_string(raw) if self.fmt.json_values else raw

    def _raw_value(self, m: regex.Match[str]) -> tuple[bool, str]:
        """Whether the value of the argument `m` is a string, and its text to read."""
        if self.fmt.json_values:  # (JSON whatever the schema says, as written)
            return False, _PY_LITERAL.sub(_as_json_literal, m["value"])
        name = self.calls[-1]["function"]["name"]
        schema = self.tools.get(name) or {}
        prop = (schema.get("properties") or {}).get(m["key"])
        # A string parameter keeps its value as written (whitespace included), as vLLM
        # and SGLang: DSML's string="false" on one is still text, as vLLM coerces it.
        # Under a forcing grammar GLM's whitespace around a value is layout (xgrammar's
        # glm_xml allows it around an enum's "Rome"), so the value is read as it does.
        is_string = _declared_types(prop) == {"string"} or m.groupdict().get("string") == "true"
        raw = m["value"]
        if self.forced and "string" not in m.groupdict():
            raw = raw.strip()
        return is_string, raw

    def _close(self, out: ToolCallDelta) -> None:
        self._emit(out, "}" if self._args else "{}")
        self._open = False

    def _emit_partial(self, rest: str, out: ToolCallDelta) -> None:
        """Leave the open call cut off by max_tokens unclosed, its arguments written on as far
        as `rest` (its markup after the last complete argument) went: a DSML JSON body as
        written (as the whole body reads when only its close tag was cut), else the argument
        begun, key and value, as JSON text cut at the same point."""
        self._open = False
        rest = rest[: len(rest) - _partial_suffix(rest, self.fmt.tags)]
        json_body = not self.fmt.json_values and not self._args
        if json_body and rest.lstrip().startswith("{"):
            body = self._json_args(rest)  # (only its close markup cut off)
            self._emit(out, rest.lstrip() if body is None else json.dumps(body, ensure_ascii=False))
            return
        m = self.fmt.partial.fullmatch(rest)
        if m is None:
            return
        if m.groupdict().get("close") is not None:  # (a JSON object closed: only its markup cut)
            self._close(out)
            return
        key = json.dumps(self._key(m["key"]), ensure_ascii=False)
        fragment = (", " if self._args else "{") + (key if m["key_end"] is not None else key[:-1])
        if m["value"] is not None:
            is_string, raw = self._raw_value(m)
            fragment += ": " + _partial_value(raw, is_string)
        self._emit(out, fragment)

    def _emit(self, out: ToolCallDelta, fragment: str) -> None:
        self.calls[-1]["function"]["arguments"] += fragment
        out.tool_calls.append({"index": len(self.calls) - 1, "function": {"arguments": fragment}})


def _merge(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fold consecutive deltas of the same call into one (one entry per index per chunk)."""
    merged: list[dict[str, Any]] = []
    for d in deltas:
        if merged and merged[-1]["index"] == d["index"]:
            merged[-1]["function"]["arguments"] += d["function"]["arguments"]
        else:
            merged.append(d)
    return merged


# --- reasoning --------------------------------------------------------------------------------


class ReasoningParser:
    """Splits reasoning (before `</think>`) from content. Reasoning starts at once when the
    prompt already ended with `<think>`, or when the output opens with `<think>`; `stop_tags`
    also end it but stay in the content (GLM may go straight to a `<tool_call>`)."""

    def __init__(self, in_reasoning: bool, stop_tags: Sequence[str] = ()) -> None:
        self._state = "reasoning" if in_reasoning else "start"
        self._stop_tags = tuple(stop_tags)
        self._buf = ""
        self.reasoning = ""
        self.seen = in_reasoning  # a reasoning section was opened

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """Consume `text`; return the settled (reasoning, content) pieces."""
        self._buf += text
        reasoning = content = ""
        if self._state == "start":
            stripped = self._buf.lstrip()
            if stripped.startswith(THINK_START):
                self._buf = stripped[len(THINK_START) :]
                self._state, self.seen = "reasoning", True
            elif not final and THINK_START.startswith(stripped):
                return "", ""
            else:
                self._state = "content"
        if self._state == "reasoning":
            tags = (THINK_END, *self._stop_tags)
            hits = [(i, t) for t in tags if (i := self._buf.find(t)) >= 0]
            if hits:
                i, tag = min(hits)
                reasoning = self._buf[:i]
                self._buf = self._buf[i + (len(tag) if tag == THINK_END else 0) :]
                self._state = "content"
            else:
                keep = 0 if final else _partial_suffix(self._buf, tags)
                reasoning, self._buf = (
                    self._buf[: len(self._buf) - keep],
                    self._buf[len(self._buf) - keep :],
                )
        if self._state == "content":
            content, self._buf = self._buf, ""
        self.reasoning += reasoning
        return reasoning, content

    @property
    def done(self) -> bool:
        """Whether the output is past its reasoning (or never had any)."""
        return self._state == "content"


def reasoning_mode(prompt: str, reasoning: bool) -> str:
    """Where a response to `prompt` starts, as xgrammar's structural tags name it: "enabled"
    (the prompt opened a reasoning block, which the output must close first), "auto" (it may
    open one: `reasoning` is on and the prompt did not close one) or "disabled"."""
    tail = prompt.rstrip()
    if tail.endswith(THINK_START):
        return "enabled"
    if reasoning and not tail.endswith(THINK_END):
        return "auto"
    return "disabled"


def reasoning_parser(name: str | None, prompt: str) -> ReasoningParser | None:
    """The reasoning parser `name` for a response to `prompt` (None: no reasoning split)."""
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise DsakvError(f"unknown reasoning parser {name!r}")
    stop_tags = (_GLM.trigger,) if name == "glm45" else ()
    return ReasoningParser(prompt.rstrip().endswith(THINK_START), stop_tags)


# --- both together ----------------------------------------------------------------------------


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def parts(self, opened: Container[int]) -> Iterator[tuple[str, Any]]:
        """Its parts in the order the model wrote them, for APIs that stream each as its own
        item: ("reasoning", text), the ("call", delta)s of the calls in `opened` (indices
        already started: one update may hold a call's close and the text after it), then
        ("content", text), then the calls it starts."""
        if self.reasoning:
            yield "reasoning", self.reasoning
        yield from (("call", c) for c in self.tool_calls if c["index"] in opened)
        if self.content:
            yield "content", self.content
        yield from (("call", c) for c in self.tool_calls if c["index"] not in opened)


class ChatOutputParser:
    """Reasoning split first, then tool calls in what follows the reasoning. Without
    `parallel_tool_calls`, only the first call is kept (its deltas are those of index 0), as
    vLLM filters them: a model that calls more anyway has the others dropped."""

    def __init__(
        self,
        reasoning: ReasoningParser | None = None,
        tools: ToolCallParser | None = None,
        parallel_tool_calls: bool = True,
    ) -> None:
        self.reasoning_parser, self.tool_parser = reasoning, tools
        self.parallel_tool_calls = parallel_tool_calls
        self.content = ""

    def feed(self, text: str, final: bool = False, cut: bool = False) -> ChatDelta:
        """`cut`: the generation ended at max_tokens (see `ToolCallParser.feed`)."""
        reasoning, content = "", text
        if self.reasoning_parser is not None:
            reasoning, content = self.reasoning_parser.feed(text, final)
        calls: list[dict[str, Any]] = []
        if self.tool_parser is not None:
            d = self.tool_parser.feed(content, final, cut)
            content, calls = d.content, d.tool_calls
            if not self.parallel_tool_calls:
                calls = [c for c in calls if c["index"] == 0]
        self.content += content
        return ChatDelta(reasoning, content, calls)

    @property
    def reasoning(self) -> str | None:
        r = self.reasoning_parser
        return r.reasoning if r is not None and (r.seen or r.reasoning) else None

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        calls = self.tool_parser.calls if self.tool_parser is not None else []
        return calls if self.parallel_tool_calls else calls[:1]

    @property
    def held(self) -> int:
        """How many of the last characters fed it has not given out: held back (a tag that
        may be beginning, the whitespace before it, markup being read), or, once the text
        ended cut off, a trigger it dropped."""
        parsers = (self.reasoning_parser, self.tool_parser)
        return sum(len(p._buf) for p in parsers if p is not None)


# --- constrained tool calls ------------------------------------------------------------------

_MAX_WHITESPACE = 4  # bounds whitespace runs inside constrained calls (no endless layout)


def tool_call_structural_tag(
    parser: str,
    tools: list[dict[str, Any]],
    tool_choice: str | dict[str, Any],
    prompt: str,
    reasoning: bool,
    parallel_tool_calls: bool = True,
) -> str:
    """xgrammar's structural tag (JSON text) forcing `tool_choice` ("required" or a named
    function) in `parser`'s own markup, arguments constrained by each tool's schema. When the
    prompt leaves a reasoning block open (or reasoning is on and may open one), the grammar
    lets it finish first."""
    import xgrammar

    try:
        tag = xgrammar.get_model_structural_tag(
            TOOL_FORMATS[parser].structural_tag,
            tools=tools,
            tool_choice=tool_choice,
            reasoning=reasoning_mode(prompt, reasoning),
            parallel_tool_calls=parallel_tool_calls,
            max_whitespace_cnt=_MAX_WHITESPACE,
        )
    except (ValueError, TypeError) as e:
        raise DsakvError(f"cannot build a tool-call grammar: {e}") from None
    return json.dumps(_calls_only(tag.model_dump(exclude_none=True)), ensure_ascii=False)


def _calls_only(node: Any) -> Any:
    """xgrammar's GLM tag forces the first call, then allows free text after the calls (a
    model rambled to max_tokens after them, all of it content); as vLLM's "required" does,
    allow only further calls, back to back as GLM writes them, then the end."""
    if isinstance(node, list):
        return [_calls_only(x) for x in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "triggered_tags" and node.get("at_least_one"):
        return {
            "type": "tags_with_separator",
            "tags": node["tags"],
            "separator": "",
            "at_least_one": True,
            "stop_after_first": node.get("stop_after_first", False),
        }
    return {k: _calls_only(v) for k, v in node.items()}
