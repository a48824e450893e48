"""Token ids to text and back, as the output streams: `TokenTexts` (incremental, after the
prompt's last tokens, as vLLM's detokenizer), `alternative_texts` (what each logprob
alternative would have added) and `chars_per_token` (the bound that refuses a text too
long to fit before it is tokenized)."""

from __future__ import annotations

import json
import os
from typing import Any

from tokenizers.decoders import DecodeStream
from tokenizers.models import BPE


class TokenTexts:
    """A text decoded token by token (tokenizers' `DecodeStream`; each token alone where
    the tokenizer is not a fast one), each token's share kept when asked (`keep`). A token
    holding part of a character adds "" and the one completing it the whole character, so
    the shares join to the text, text offsets index into it and chat `bytes` rebuild it;
    decoded alone, every such token read U+FFFD.

    An output's (`prompt` given) is what it adds to the text of the prompt's last tokens
    (`prompt_tail`), which the stream starts after, as vLLM primes its detokenizer: a
    character the prompt leaves unfinished is the output's, whole, once its first tokens
    finish it (as a U+FFFD it stays the prompt's). The text ends, as vLLM's, without a
    character the output leaves unfinished (`text`)."""

    def __init__(
        self, tokenizer: Any, skip: bool, keep: bool = True, prompt: list[int] | None = None
    ) -> None:
        self.tokenizer, self.skip = tokenizer, skip
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        self.stream = DecodeStream(skip_special_tokens=skip) if self.backend else None
        self.texts: list[str] | None = [] if keep else None
        self.output = prompt is not None
        self.tail = [] if prompt is None else prompt_tail(tokenizer, prompt)
        self.tail_text = _decode(tokenizer, self.tail, skip)
        for t in self.tail if self.stream is not None else ():
            self._advance(t)
        # Where the tail ends inside a character, the stream holds its bytes back for the
        # output's first text, as a U+FFFD where the output does not finish it: the first
        # tokens are kept until the stream outputs, and `text` says what they add instead.
        unfinished = self.tail_text.endswith("\ufffd") and self.stream is not None
        self.first: list[int] | None = [] if unfinished else None

    def step(self, token: int) -> str:
        """The text `token` adds (and keeps)."""
        if self.stream is None:
            text = _decode(self.tokenizer, [token], self.skip)
        else:
            text = self._advance(token)
            if self.first is not None:
                self.first.append(token)
                if text:
                    text, self.first = self.text(self.first), None
        if self.texts is not None:
            self.texts.append(text)
        return text

    def _advance(self, token: int) -> str:
        """`token` through the stream. A byte-fallback decoder reads a lone byte token as
        its byte but a run of them that is not UTF-8 as U+FFFDs, so its text can stop
        extending what the stream emitted, and the stream raises: as vLLM, a fresh stream
        takes the token (one request's text, rather than the step, pays)."""
        try:
            return self.stream.step(self.backend, token) or ""
        except Exception as e:
            if not str(e).startswith("Invalid prefix encountered"):
                raise
            self.stream = DecodeStream(skip_special_tokens=self.skip)
            return self.stream.step(self.backend, token) or ""

    def text(self, ids: list[int], end: bool = False) -> str:
        """The text of `ids`, decoded whole: what they add to the tail's text (past where
        the two part). With `end`, an output's as it ends: without the last tokens whose
        text ends in a character left unfinished (vLLM's decoder holds them back, and so
        never outputs them; whole tokens, as a byte-fallback decoder reads every byte of
        such a run as a U+FFFD, the character before it too)."""
        text = self._added(ids)
        if end and self.output:
            for n in range(1, min(_HELD, len(ids)) + 1):
                if not text.endswith("\ufffd"):
                    break
                text = self._added(ids[:-n])
        return text.rstrip("\ufffd") if end and self.output else text

    def _added(self, ids: list[int]) -> str:
        whole = _decode(self.tokenizer, self.tail + ids, self.skip)
        return whole[len(os.path.commonprefix([self.tail_text, whole])) :]

    def shares(self, ids: list[int], start: int = 0, end: bool = False) -> list[str]:
        """The kept texts of `ids[start:]`, where `ids` are every token of the text so far
        (any not stepped yet are stepped now); with `end`, the text ends there and what the
        stream still holds back of it (`text`: a prompt's unfinished character) goes to its
        last token, where it extends what streamed (an invalid byte run decoded whole does
        not)."""
        for t in ids[len(self.texts) :]:
            self.step(t)
        out = self.texts[start : len(ids)]
        if end and out and self.stream is not None:
            kept, whole = "".join(self.texts[: len(ids)]), self.text(ids, end=True)
            if whole.startswith(kept):
                out[-1] += whole[len(kept) :]
        return out


def _decode(tokenizer: Any, ids: list[int], skip: bool) -> str:
    """`ids`' text with no clean-up of spaces, whatever the tokenizer asks: an output's
    text only ever grows (a clean-up rewrites text already streamed: "a " then "." is
    "a."), as vLLM's detokenizer, which never cleans up, gives it."""
    return tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


# The fewest and most prompt tokens an output is decoded after (vLLM's)
_TAIL = (4, 24)
# The most last tokens an ending output drops for a character left unfinished (UTF-8's
# longest, then U+FFFDs are stripped)
_HELD = 4


def prompt_tail(tokenizer: Any, prompt: list[int]) -> list[int]:
    """The last prompt tokens an output is decoded after (`TokenTexts`): the fewest, from 4,
    whose text starts at a character (no U+FFFD but where it ends unfinished); the last 24
    where none do (vLLM takes the whole prompt then, decoding all of it each request)."""
    lo, hi = _TAIL
    for n in range(min(lo, len(prompt)), min(hi, len(prompt)) + 1):
        text = _decode(tokenizer, prompt[len(prompt) - n :], False).rstrip("\ufffd")
        if text and "\ufffd" not in text:
            return prompt[len(prompt) - n :]
    return prompt[max(len(prompt) - hi, 0) :]


# Normalizers that keep every character, or compose a few into one: NFC and NFKC up to 4
# (the longest canonical decomposition); others may drop some.
_COMPOSES = {"NFC": 4, "NFKC": 4, "NFD": 1, "NFKD": 1}
# Pre-tokenizers that keep every character (others drop whitespace or delimiters)
_KEEPS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}


def chars_per_token(tokenizer: Any) -> int | None:
    """The most characters of a text that one of its tokens stands for: its longest token,
    as stored or decoded alone (added tokens too), times the most characters the normalizer
    composes into one. None where no such bound holds: not a fast BPE tokenizer, or one
    that may drop characters (a normalizer or pre-tokenizer that removes some, an added
    token that takes the spaces beside it, unknown characters fused or dropped)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not isinstance(backend.model, BPE):
        return None
    composes = 1
    for step in _steps(backend.normalizer, "normalizers"):
        if step["type"] not in _COMPOSES:
            return None
        composes *= _COMPOSES[step["type"]]
    pre = _steps(backend.pre_tokenizer, "pretokenizers")
    if any(p["type"] not in _KEEPS or p.get("behavior") == "Removed" for p in pre):
        return None
    bpe, byte_level = backend.model, any(p["type"] == "ByteLevel" for p in pre)
    if not (bpe.byte_fallback or byte_level or (bpe.unk_token and not bpe.fuse_unk)):
        return None
    if any(t.lstrip or t.rstrip for t in backend.get_added_tokens_decoder().values()):
        return None
    vocab = backend.get_vocab(with_added_tokens=True)
    decoded = backend.decode_batch([[i] for i in vocab.values()], skip_special_tokens=False)
    return max(map(len, [*vocab, *decoded]), default=1) * composes


def _steps(part: Any, key: str) -> list[dict[str, Any]]:
    """A normalizer's or pre-tokenizer's steps, as their JSON (a `Sequence`'s flattened)."""
    if part is None:
        return []
    todo, out = [json.loads(part.__getstate__())], []
    while todo:
        step = todo.pop()
        if step["type"] == "Sequence":
            todo += step[key]
        else:
            out.append(step)
    return out


# Tokens of context an alternative is decoded after (`alternative_texts`): more than any
# character needs (4 bytes).
_CONTEXT = 6


def output_logprob_texts(
    tokenizer: Any, req: Any, kept: TokenTexts, start: int, end: int
) -> tuple[list[str], list[list[str]]]:
    """The texts of a request's output tokens `start:end` (`kept`'s shares of its output
    text) and of each one's logprob alternatives (after the prompt's last tokens too, as
    the output's own texts): what the server's logprobs and the offline `Logprob`s say."""
    texts = kept.shares(req.output_ids, start, end=req.finished)
    tops = [[t for t, _ in top] for top in req.top_logprobs[start:end]]
    n = len(req.prompt_ids)
    lo = max(n + start - _CONTEXT, 0)
    skip = req.params.skip_special_tokens
    return texts, alternative_texts(
        tokenizer, req.ids(lo, n + end), n + start - lo, tops, skip, texts
    )


def prompt_logprob_texts(tokenizer: Any, req: Any) -> tuple[list[str], list[list[str]]]:
    """The texts of a request's prompt tokens and their logprob alternatives, echoed as
    given (special tokens' text included)."""
    p = req.prompt_ids
    texts = TokenTexts(tokenizer, skip=False).shares(p, end=True)
    tops = [[t for t, _ in top or ()] for top in req.prompt_top_logprobs]
    return texts, alternative_texts(tokenizer, p, 0, tops, False, texts)


def alternative_texts(
    tokenizer: Any,
    ids: list[int],
    start: int,
    alternatives: list[list[int]],
    skip: bool,
    chosen: list[str],
) -> list[list[str]]:
    """The text each alternative at positions `start..` would have added after the tokens
    before it (the last few, decoded in one batch), as `TokenTexts` counts: "" for part of
    a character. The chosen token's is its own text (`chosen`), so the top-1's key is the
    token's (lm-eval's greedy check)."""
    seqs: list[list[int]] = []
    for i, alts in zip(range(start, len(ids)), alternatives):
        ctx = ids[max(0, i - _CONTEXT) : i]
        seqs += [ctx, *(ctx + [t] for t in alts)]
    decoded = iter(tokenizer.batch_decode(seqs, skip_special_tokens=skip))
    out = []
    for i, alts, mine in zip(range(start, len(ids)), alternatives, chosen):
        before = next(decoded)  # (may start with U+FFFD: a window cut mid-character)
        texts = []
        for t in alts:
            s = next(decoded).rstrip("\ufffd")
            texts.append(mine if t == ids[i] else s[len(os.path.commonprefix([before, s])) :])
        out.append(texts)
    return out
