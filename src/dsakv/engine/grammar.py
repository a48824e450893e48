"""Structured output with xgrammar: compiled grammars (LRU-cached) and per-step token masks.

A request with `SamplingParams.grammar = (kind, spec)` gets its own `GrammarMatcher`; each
step the engine fills one bitmask row per constrained request, applies the whole batch's
mask to the logits in one call (on the logits' device, CPU or CUDA), and after sampling
advances each matcher with the chosen token. A matcher that accepted a stop token is
terminated: the request finishes with "stop".
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch

from dsakv.errors import DsakvError

# xgrammar's JSON string characters as it prints them: its length-bounded strings' (not
# `"`, `\`, CR, LF) and its unbounded strings' (nor any other control character)
_XGRAMMAR_CHARS = (r"[^\"\\\r\n]", r"[^\0-\x1f\"\\\r\n]")
_JSON_CHAR = r"[^\0-\x1f\"\\\r\n\uD800-\uDFFF]"  # ...and no UTF-16 surrogate
_LOCATION = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


class GrammarError(DsakvError):
    """A grammar or schema that does not compile (the server answers 400)."""


# JSON Schema keywords xgrammar 0.2 accepts and does not enforce (its output may break
# them): refused, as vLLM's xgrammar backend refuses what it cannot enforce.
_UNENFORCED = (
    "uniqueItems",
    "contains",
    "minContains",
    "maxContains",
    "not",
    "if",
    "then",
    "else",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
)
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_DATA = ("enum", "const", "default", "examples", "required")  # values, not schemas


def unenforced_keyword(schema: Any, where: str = "") -> str | None:
    """The first keyword of `schema` (and its subschemas) that structured output would
    accept and not enforce, as "keyword at /path", or None."""
    if isinstance(schema, list):
        for i, s in enumerate(schema):
            if (hit := unenforced_keyword(s, f"{where}/{i}")) is not None:
                return hit
        return None
    if not isinstance(schema, dict):
        return None
    for key in _UNENFORCED:
        if key in schema and not (key == "uniqueItems" and schema[key] is False):
            return f"{key} at {where or '/'}"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return f"allOf of more than one schema at {where or '/'}"
    for key, value in schema.items():
        if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                if (hit := unenforced_keyword(sub, f"{where}/{key}/{name}")) is not None:
                    return hit
        elif key not in _DATA and (hit := unenforced_keyword(value, f"{where}/{key}")):
            return hit
    return None


class GrammarCache:
    """One `GrammarCompiler` for the engine's tokenizer; compiled grammars kept by (kind, spec),
    least recently used dropped beyond `max_entries` (a schema compiles in milliseconds to a
    second; clients tend to resend the same few).

    `compile` may be called from several threads at once (the server compiles a request's
    grammar on a worker thread, so the engine thread then finds it here): the cache is
    locked, the compiling is not (xgrammar's compiler is thread-safe, and releases the GIL)."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: tuple[int, ...],
        max_entries: int = 64,
    ) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        # (xgrammar's own cache keeps every grammar ever compiled, without a limit: ~70 KB
        # a schema on a tiny vocabulary, a server's memory growing with each new one)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()
        self.max_entries = max_entries

    def compile(self, grammar: tuple[str, str]) -> Any:
        """The compiled grammar for (kind, spec); `DsakvError` when it does not compile."""
        with self._lock:
            hit = self._compiled.get(grammar)
            if hit is not None:
                self._compiled.move_to_end(grammar)
                return hit
        kind, spec = grammar
        c = self._compiler
        with _grammar_errors(kind):
            if kind in ("json_schema", "json_object"):
                compiled = c.compile_grammar(_json_ebnf(kind, spec))
            elif kind == "regex":
                compiled = c.compile_regex(spec)
            elif kind == "ebnf":
                compiled = c.compile_grammar(spec)
            elif kind == "structural_tag":
                compiled = c.compile_structural_tag(json.dumps(structural_tag(spec)))
            else:
                raise GrammarError(f"unknown grammar kind {kind!r}")
        with self._lock:
            self._compiled[grammar] = compiled
            self._compiled.move_to_end(grammar)
            if len(self._compiled) > self.max_entries:
                self._compiled.popitem(last=False)
        return compiled

    def compiled(self, grammar: tuple[str, str]) -> bool:
        """Whether `compile` would answer at once (from the cache)."""
        with self._lock:
            return grammar in self._compiled

    def matcher(self, grammar: tuple[str, str]) -> Any:
        """A fresh matcher (one per request: it carries that request's parse state)."""
        return self._xgr.GrammarMatcher(self.compile(grammar))

    def apply(self, logits: torch.Tensor, matchers: list[Any]) -> None:
        """Mask, in place, every token each row's matcher forbids (rows with None are free)."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        xgr = self._xgr
        mask = xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        for i in rows:
            matchers[i].fill_next_token_bitmask(mask, i)
        xgr.apply_token_bitmask_inplace(
            logits, mask.to(logits.device), vocab_size=self.vocab_size, indices=rows
        )

    def apply_drafts(self, logits: torch.Tensor, matcher: Any, drafts: list[int]) -> list[int]:
        """Speculative decoding: mask row j of `logits` (`[1 + len(drafts), V]`) with the
        matcher's state after drafts d1..dj, and return the drafts the grammar allows (a
        prefix; rows past it go unused). The matcher is rolled back to where it was."""
        xgr = self._xgr
        mask = xgr.allocate_token_bitmask(len(drafts) + 1, self.vocab_size)
        matcher.fill_next_token_bitmask(mask, 0)
        ok = 0
        for d in drafts:
            if matcher.is_terminated() or not matcher.accept_token(d):
                break
            ok += 1
            if matcher.is_terminated():  # d completes it: the request stops there
                break
            matcher.fill_next_token_bitmask(mask, ok)
        if ok:
            matcher.rollback(ok)
        xgr.apply_token_bitmask_inplace(
            logits, mask.to(logits.device), vocab_size=self.vocab_size, indices=list(range(ok + 1))
        )
        return drafts[:ok]


@contextlib.contextmanager
def _grammar_errors(kind: str) -> Iterator[None]:
    """xgrammar's (and json's) exceptions for a grammar of `kind` as one-line `GrammarError`s."""
    try:
        yield
    except DsakvError:
        raise
    except json.JSONDecodeError as e:
        raise GrammarError(f"invalid json schema: not JSON ({e})") from None
    except Exception as e:  # xgrammar raises RuntimeError/ValueError subclasses
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        first = _LOCATION.sub("", text)  # "[time] /path/file.cc:94: " means nothing to users
        raise GrammarError(f"invalid {kind.replace('_', ' ')}: {first}") from None


def _json_ebnf(kind: str, spec: str) -> str:
    """A json_schema's (or json_object's: any object, as OpenAI's json_object mode asks)
    grammar as EBNF, without free whitespace (`{"a": 1, "b": [2, 3]}`): a model trained on
    JSON writes it that way anyway, and an unsure one cannot wander off into endless
    whitespace until max_tokens cuts it (an invalid, truncated output). Two fixes: xgrammar
    0.2's length-bounded strings (`maxLength`) admit raw control characters, which JSON
    forbids (`json.loads` rejects the output), and both kinds admit a UTF-16 surrogate
    encoded as UTF-8 (invalid UTF-8: it decodes to three U+FFFD, so a `maxLength` string
    overruns its bound); every JSON string gets one class that admits neither."""
    import xgrammar as xgr

    if kind == "json_object":
        schema, strict = '{"type": "object"}', False
    else:
        hit = unenforced_keyword(json.loads(spec))  # (not JSON: a clear message)
        if hit is not None:
            raise GrammarError(f"invalid json schema: {hit} cannot be enforced")
        schema, strict = spec, True
    g = xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict)
    ebnf = str(g)
    for chars in _XGRAMMAR_CHARS:
        ebnf = ebnf.replace(chars, _JSON_CHAR)
    return ebnf


def structural_tag(spec: str) -> dict[str, Any]:
    """A structural tag (JSON text) in xgrammar's format, each of its plain JSON-schema parts
    whitespace-free as dsakv's `json_schema` is (`_json_ebnf`; a part that sets its own
    `max_whitespace_cnt`, a style, `any_order` or excludes is left as written). The legacy
    format SGLang and vLLM also take (`structures` of begin / schema / end, `triggers` and
    `at_least_one`: free text until a trigger, then that structure) is converted as
    xgrammar converts it, a structure without a schema taking any JSON, as SGLang's."""
    import xgrammar as xgr

    tag = json.loads(spec)
    if not isinstance(tag, dict):
        raise GrammarError("invalid structural tag: not a JSON object")
    if "structures" in tag:
        structures, triggers = tag["structures"], tag.get("triggers")
        if not isinstance(triggers, list) or not all(isinstance(t, str) for t in triggers):
            raise GrammarError("invalid structural tag: triggers must be a list of strings")
        if not isinstance(structures, list) or not all(_is_structure(x) for x in structures):
            raise GrammarError(
                "invalid structural tag: each structure needs a begin and end string and a "
                "schema object (or none)"
            )
        items = [
            xgr.StructuralTagItem(**{**x, "schema": x.get("schema") or {}}) for x in structures
        ]
        at_least_one = tag.get("at_least_one") or False
        if not isinstance(at_least_one, bool):
            raise GrammarError("invalid structural tag: at_least_one must be true or false")
        legacy = xgr.StructuralTag.from_legacy_structural_tag(items, triggers)
        tag = legacy.model_dump(exclude_none=True)
        tag["format"]["at_least_one"] = at_least_one
    if "format" not in tag:
        return tag  # (xgrammar's error names what is missing)
    return {**tag, "format": _compact_json_parts(tag["format"])}


def _is_structure(x: Any) -> bool:
    return (
        isinstance(x, dict)
        and isinstance(x.get("begin"), str)
        and isinstance(x.get("end"), str)
        and isinstance(x.get("schema"), dict | None)
    )


def _compact_json_parts(node: Any) -> Any:
    """A format tree with its plain JSON-schema parts as whitespace-free grammars; a JSON
    schema itself is never walked (its `const` or `enum` values are data)."""
    if isinstance(node, list):
        return [_compact_json_parts(x) for x in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") != "json_schema":
        return {k: v if k == "json_schema" else _compact_json_parts(v) for k, v in node.items()}
    plain = {"type", "json_schema", "style", "any_order", "excludes"}
    if (
        node.keys() <= plain
        and node.get("style", "json") == "json"
        and not node.get("any_order")
        and not node.get("excludes")
    ):
        schema = json.dumps(node["json_schema"])
        return {"type": "grammar", "grammar": _json_ebnf("json_schema", schema)}
    return node


REASONING_MODES = ("enabled", "auto", "disabled")


def after_reasoning(
    grammar: tuple[str, str], mode: str, start: str = "<think>", end: str = "</think>"
) -> tuple[str, str]:
    """`grammar` (json_schema, json_object, regex, ebnf or structural_tag) enforced only
    once the output's reasoning block is over, as a structural tag; the reasoning itself is
    free text (as vLLM's reasoning parsers leave it, and SGLang's ReasonerGrammarBackend for
    every kind, structural tags included). `mode` says where the output starts: "enabled",
    inside a block the prompt opened (free text up to `end`, then the grammar); "auto", where
    it may open one (an optional `start` ... `end` first); "disabled": `grammar` as it is
    (also the mode for a grammar that holds the reasoning itself, as a forcing tool_choice's
    does). The inner grammar is checked here (`GrammarError`, as `GrammarCache.compile`
    words it); turning a schema into a grammar can take seconds, so call this off the engine
    thread."""
    if mode not in REASONING_MODES:
        raise ValueError(f"reasoning mode must be one of {REASONING_MODES}, not {mode!r}")
    kind, spec = grammar
    if mode == "disabled":
        return grammar
    import xgrammar as xgr

    answer: Any  # the format that follows the reasoning
    with _grammar_errors(kind):
        if kind in ("json_schema", "json_object"):
            answer = {"type": "grammar", "grammar": _json_ebnf(kind, spec)}
        elif kind == "regex":
            answer = {"type": "grammar", "grammar": str(xgr.Grammar.from_regex(spec))}
        elif kind == "ebnf":
            answer = {"type": "grammar", "grammar": str(xgr.Grammar.from_ebnf(spec))}
        elif kind == "structural_tag":
            tag = structural_tag(spec)
            xgr.Grammar.from_structural_tag(tag)  # (its errors, before taking it apart)
            answer = tag["format"]
        else:
            raise GrammarError(f"unknown grammar kind {kind!r}")
    reasoning: dict[str, Any] = {
        "type": "tag",
        "begin": start if mode == "auto" else "",
        "content": {"type": "any_text", "excludes": [start, end]},
        "end": end,
    }
    if mode == "auto":
        reasoning = {"type": "optional", "content": reasoning}
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "sequence",
            "elements": [reasoning, answer],
        },
    }
    return "structural_tag", json.dumps(tag, ensure_ascii=False)
