"""Text at a prompt's edges: an output after a token-id prompt that ends inside a UTF-8
character, and one cut inside a character, read as vLLM's detokenizer reads them
(`TokenTexts`) offline, over HTTP, streamed or not; a text prompt too long for the context
whatever its tokens, refused before it is tokenized (`Engine.prompt_ids`)."""

# ruff: noqa: F811 - the tests take the imported fixtures by their names

from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import replace

import httpx
import pytest

from dsakv.engine import LLM, EngineConfig, SamplingParams
from dsakv.errors import DsakvError

from .conftest import flat_logprobs
from .serving import TIMEOUT, serving

# The completions tests' model, engine and server, their fixtures imported.
from .test_completions_api import ENGINE_ARGS, MODEL, model_dir, reference, served  # noqa: F401

HI = list(b"hi ")
SUN = list("日".encode())  # e6 97 a5: three tokens of the byte-level tokenizer


def _added(tok, prompt: list[int], output: list[int]) -> str:
    """What `output` adds to `prompt`'s text (each decoded whole), less a last character
    it leaves unfinished."""
    before = tok.decode(prompt, skip_special_tokens=True)
    whole = tok.decode(prompt + output, skip_special_tokens=True)
    return whole[len(os.path.commonprefix([before, whole])) :].rstrip("\ufffd")


def _prompts(n: int) -> list[list[int]]:
    """Random bytes ending inside a character (a 2-, 3- or 4-byte one's first bytes)."""
    rng = random.Random(5)
    ends = [[0xC3], [0xE6], [0xE6, 0x97], [0xF0, 0x9F], [0xF0, 0x9F, 0x98]]
    return [[rng.randrange(256) for _ in range(rng.randint(1, 12))] + ends[i % 5] for i in range(n)]


@pytest.fixture(scope="module")
def decoding_whole(model_dir):
    """The model with its outputs decoded whole each token, as for a tokenizer that has no
    fast backend to stream them."""
    with LLM(str(model_dir), **ENGINE_ARGS) as llm:
        llm.engine._decodes_whole = True
        yield llm


@pytest.mark.parametrize("whole", [False, True], ids=["incremental", "whole"])
def test_an_output_is_what_it_adds_to_the_prompts_text(reference, decoding_whole, whole):
    """The token finishing the character a token-id prompt left unfinished outputs it whole
    (not U+FFFD); one that does not leaves the prompt its U+FFFD; a character the output
    leaves unfinished is left out (vLLM's). Decoded as the tokens come or whole each token,
    the text is the same."""
    llm = decoding_whole if whole else reference

    def text(prompt: list[int] | str, **params) -> str:
        return llm.generate([prompt], SamplingParams(temperature=0, **params))[0].text

    assert text(HI + SUN[:2], max_tokens=1, allowed_token_ids=(SUN[2],)) == "日"
    assert text(HI + SUN[:1], max_tokens=1, allowed_token_ids=(SUN[1],)) == ""
    assert text(HI + SUN[:2], max_tokens=2, allowed_token_ids=(ord("{"),)) == "{{"
    assert text("x", max_tokens=4, grammar=("regex", "日本")) == "日"  # 本 cut unfinished
    prompts = _prompts(10)
    params = [
        SamplingParams(max_tokens=8, temperature=2.0, seed=i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    outs = llm.generate(prompts, params)
    texts = [o.text for o in outs]
    assert texts == [_added(llm.tokenizer, p, o.token_ids) for p, o in zip(prompts, outs)]
    assert any(not t.isascii() for t in texts)  # characters the prompts left were finished


def test_a_tokenizer_cleaning_up_spaces_still_streams_text_that_only_grows(model_dir, tmp_path):
    """A tokenizer that asks to clean up spaces (forced on, as transformers 5 ignores the ask
    for BPE) rewrites text already out ("a " then "." is "a."): the server cut each delta at
    the characters sent, dropping the "." and sending the space twice. An output's text is
    now decoded without the clean-up (vLLM's), so each step only adds to it."""
    path = shutil.copytree(model_dir, tmp_path / "cleaning")
    config = json.loads((path / "tokenizer_config.json").read_text())
    force = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
    config |= {"clean_up_tokenization_spaces": True, force: True}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    want = "a . b , c n't d !"
    with LLM(str(path), **ENGINE_ARGS) as llm:
        assert llm.tokenizer.decode(llm.tokenizer.encode(want)) != want  # it does clean up
        for whole in (False, True):
            llm.engine._decodes_whole = whole
            sp = SamplingParams(
                max_tokens=30, temperature=0, grammar=("regex", want.replace(".", r"\."))
            )
            req = llm.engine.add_request("abc", sp)
            texts = []
            while not req.finished:
                llm.engine.step()
                texts.append(req.output_text)
            assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), texts
            assert texts[-1] == want


@pytest.fixture(scope="module")
def with_bos(model_dir, tmp_path_factory) -> tuple[str, int]:
    """The model under a tokenizer that adds a BOS to a text (as DeepSeek-V3.2's does); its
    chat template writes one too. Returns the model's path and the BOS id."""
    path = shutil.copytree(model_dir, tmp_path_factory.mktemp("bos") / "m")
    tok = json.loads((path / "tokenizer.json").read_text())
    bos = "<|bos|>"
    bos_id = next(t["id"] for t in tok["added_tokens"] if t["content"] == bos)
    first, a, b = ({"SpecialToken": {"id": bos, "type_id": 0}},) + tuple(
        {"Sequence": {"id": s, "type_id": i}} for i, s in enumerate("AB")
    )
    tok["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [first, a],
        "pair": [first, a, b],
        "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
    }
    (path / "tokenizer.json").write_text(json.dumps(tok))
    return str(path), bos_id


def test_a_text_prompt_gets_the_tokenizers_bos_and_a_chat_prompt_the_templates(with_bos):
    """As vLLM and SGLang tokenize them: a completion's text with its tokenizer's special
    tokens (a BOS), unless `add_special_tokens` is false; a chat prompt without, as its
    template writes the BOS. dsakv added none to a text, so DeepSeek-V3.2's completions ran
    without the BOS every vLLM and SGLang completion has; a streamed chat reported two."""
    path, bos = with_bos
    text, messages = "hi there", [{"role": "user", "content": "hi"}]
    greedy = SamplingParams(max_tokens=1, temperature=0)
    with LLM(path, **ENGINE_ARGS) as llm:
        plain = llm.tokenizer.encode(text, add_special_tokens=False)
        assert llm.generate(text, greedy)[0].prompt_token_ids == [bos, *plain]
        assert llm.generate([plain], greedy)[0].prompt_token_ids == plain  # ids as given
        out = llm.chat(messages, greedy)[0]
        assert out.prompt_token_ids[0] == bos and out.prompt_token_ids.count(bos) == 1
        assert out.prompt == llm.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
    with serving(EngineConfig(model=path, **ENGINE_ARGS)) as (base, _):
        body = {"prompt": text, "max_tokens": 1, "return_token_ids": True}
        choice = _post(base, "/v1/completions", body)["choices"][0]
        assert choice["prompt_token_ids"] == [bos, *plain]
        body["add_special_tokens"] = False
        assert _post(base, "/v1/completions", body)["choices"][0]["prompt_token_ids"] == plain
        out = _post(base, "/generate", {"text": text, "sampling_params": {"max_new_tokens": 1}})
        assert out["meta_info"]["prompt_tokens"] == len(plain) + 1
        out = _post(base, "/generate", {"text": "", "sampling_params": {"max_new_tokens": 1}})
        assert out["meta_info"]["prompt_tokens"] == 1  # (the BOS: as /v1/completions runs it)
        assert _post(base, "/tokenize", {"prompt": text})["tokens"] == [bos, *plain]
        body = {"prompt": text, "add_special_tokens": False}
        assert _post(base, "/tokenize", body)["tokens"] == plain
        chat = _post(base, "/tokenize", {"messages": messages})["tokens"]
        assert chat[0] == bos and chat.count(bos) == 1
        body = {"messages": messages, "max_tokens": 1, "return_token_ids": True}
        plain = _post(base, "/v1/chat/completions", body)
        assert plain["usage"]["prompt_tokens"] == len(chat) and plain["prompt_token_ids"] == chat
        # streamed, the ids reported are those run too, not the text's BOS on the template's
        assert _sse(base, "/v1/chat/completions", body)[0]["prompt_token_ids"] == chat


def _sse(base: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", base + path, json={**body, "stream": True}, timeout=TIMEOUT) as r:
        assert r.status_code == 200, r.read()
        events = [x[6:] for x in r.iter_lines() if x.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(x) for x in events[:-1]]


def _post(base: str, path: str, body: dict) -> dict:
    r = httpx.post(base + path, json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()


def test_streamed_or_not_over_http_the_text_is_the_offline_one(base, reference):
    """/v1/completions and /generate, streamed or not, give a token-id prompt's output the
    offline text, and its logprob tokens join to it."""
    for i, prompt in enumerate(_prompts(5)):
        params = SamplingParams(max_tokens=8, temperature=2.0, seed=i, ignore_eos=True)
        offline = reference.generate([prompt], params)[0]
        want = _added(reference.tokenizer, prompt, offline.token_ids)
        assert offline.text == want
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 2.0, "seed": i}
        body |= {"ignore_eos": True, "logprobs": 1}
        choice = _post(base, "/v1/completions", body)["choices"][0]
        assert choice["text"] == want == "".join(choice["logprobs"]["tokens"])
        chunks = _sse(base, "/v1/completions", body)
        assert "".join(c["choices"][0]["text"] for c in chunks) == want
        sp = {"max_new_tokens": 8, "temperature": 2.0, "sampling_seed": i, "ignore_eos": True}
        body = {"input_ids": prompt, "sampling_params": sp}
        out, last = _post(base, "/generate", body), _sse(base, "/generate", body)[-1]
        assert (out["output_ids"], out["text"], last["text"]) == (offline.token_ids, want, want)


def test_a_top_logprobs_text_follows_the_prompt_too(base, reference):
    """A top logprob's text is what its token would have added after the prompt: one that
    finishes the character the prompt left unfinished reads as that character."""
    prompt = HI + SUN[:2]
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    (c,) = reference.generate([prompt], params)[0].outputs
    top = flat_logprobs(c.logprobs, c.token_ids, k=5)[0]
    want = {_added(reference.tokenizer, prompt, [t]) for t, _ in top}
    assert any(not key.isascii() for key in want)  # (read alone, each was U+FFFD)
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 5}
    choice = _post(base, "/v1/completions", body)["choices"][0]
    assert set(choice["logprobs"]["top_logprobs"][0]) == want


def _counting(monkeypatch, tokenizer) -> list[str]:
    """Every text `tokenizer.encode` is called on, from now on."""
    seen: list[str] = []
    encode = tokenizer.encode

    def counted(text, *args, **kwargs):
        seen.append(text)
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", counted)
    return seen


def _byte_fallback_tokenizer():
    """A Llama / Mistral-style tokenizer: Metaspace, bytes as `<0xNN>` tokens (id 3 + byte),
    a ByteFallback decoder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{i:02X}>": 3 + i for i in range(256)}}
    vocab.update({"▁": 259, "a": 260, "b": 261, "▁a": 262})
    tok = Tokenizer(models.BPE(vocab, [("▁", "a")], byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
         decoders.Strip(" ", 1, 0)]
    )  # fmt: skip
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def test_byte_fallback_tails_and_ends():
    """A byte-fallback decoder reads a lone byte token as its byte, and a run of them that
    is not UTF-8 as one U+FFFD per byte. A prompt ending in bytes 1C B6 then "a" made
    tokenizers' DecodeStream raise "Invalid prefix" as the output's decoder took the
    prompt's tail (inside the engine's step: every running request failed); the stream
    starts afresh at that token instead (vLLM). An output of 日 then one byte of the next
    character ends as "b日", not "" (its four bytes decode as four U+FFFDs)."""
    from dsakv.engine.detokenizer import TokenTexts

    tok, byte = _byte_fallback_tokenizer(), lambda x: 3 + x
    out = [261, byte(0xE6), byte(0x97), byte(0xA5), byte(0xE6)]
    texts = TokenTexts(tok, True, prompt=[260, 261, byte(0x1C), byte(0xB6), 260])
    assert [texts.step(t) for t in out] == ["b", "", "", "日", ""]
    assert texts.text(out, end=True) == "b日"
    assert texts.shares(out, end=True) == ["b", "", "", "日", ""]
    # A stray continuation byte: decoded whole, é's bytes read U+FFFD too; the shares (the
    # logprobs' tokens) stay what streamed, joining to the output's text.
    out = [byte(0xC3), byte(0xA9), byte(0xA9), 260]
    assert TokenTexts(tok, True, prompt=[260, 261]).shares(out, end=True) == ["", "é", "", "a"]


def _vllm_text(tok, prompt: list[int], output: list[int]) -> str:
    """vLLM's text of `output` (its fast incremental detokenizer): tokenizers' DecodeStream
    primed with the prompt's last tokens, started afresh where it raises "Invalid prefix"."""
    from tokenizers.decoders import DecodeStream

    backend, stream = tok.backend_tokenizer, [DecodeStream(skip_special_tokens=True)]

    def step(t: int) -> str:
        try:
            return stream[0].step(backend, t) or ""
        except Exception as e:
            assert str(e).startswith("Invalid prefix"), e
            stream[0] = DecodeStream(skip_special_tokens=True)
            return stream[0].step(backend, t) or ""

    for t in prompt[-4:]:
        step(t)
    return "".join(step(t) for t in output)


def test_an_invalid_byte_run_ends_as_it_streamed(model_dir, tmp_path):
    """A byte-fallback decoder reads a run of bytes that is not UTF-8 (é, then a stray
    continuation byte) as one U+FFFD per byte, é's too. The finished text was the whole
    output decoded again: "éa" streamed ended as "���a", and a stream's last delta (the
    server cuts the final text where the stream had got to) spliced the two. It ends as it
    streamed, as vLLM's, with a stop token's text dropped from it."""
    path = shutil.copytree(model_dir, tmp_path / "m")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (path / name).unlink(missing_ok=True)
    tok = _byte_fallback_tokenizer()
    tok.save_pretrained(path)
    byte, a = (lambda x: 3 + x), 260
    prompt, allowed = [a, 261, a, 261], [byte(0xC3), byte(0xA9), a]
    with LLM(str(path), **ENGINE_ARGS) as llm:
        for seed in range(12):
            params = SamplingParams(max_tokens=10, seed=seed, allowed_token_ids=allowed)
            stop = replace(params, stop_token_ids=(a,), min_tokens=3)
            outs = llm.generate([prompt, prompt], [params, stop], use_tqdm=False)
            for out in (o.outputs[0] for o in outs):
                ids = list(out.token_ids)
                shown = ids[:-1] if out.stop_reason == a else ids
                assert out.text == _vllm_text(tok, prompt, shown), (seed, ids)


def test_a_text_too_long_for_any_tokens_is_refused_untokenized(reference, monkeypatch):
    """More characters than the context's tokens can stand for (`chars_per_token` a token:
    the longest token's, <|observation|>) is the length error, without tokenizing; at the
    bound the text is tokenized and its token count refused; what fits runs."""
    e = reference.engine
    limit, m = e.max_model_len - 1, e.chars_per_token
    assert m == len("<|observation|>")
    seen = _counting(monkeypatch, e.tokenizer)
    sp = SamplingParams(max_tokens=1)
    over = f"prompt has at least {limit + 1} tokens \\({limit * m + 1} characters, at most {m} a"
    with pytest.raises(DsakvError, match=over + rf" token\); at most {limit} fit \(the context"):
        reference.generate(["a" * (limit * m + 1)], sp)
    assert seen == []
    with pytest.raises(DsakvError, match=rf"prompt has {limit * m} tokens; at most {limit} fit"):
        reference.generate(["a" * (limit * m)], sp)
    assert len(seen) == 1
    assert len(reference.generate(["a" * limit], sp)[0].token_ids) == 1


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", lambda text: {"prompt": text}, "prompt"),
        (
            "/v1/chat/completions",
            lambda text: {"messages": [{"role": "user", "content": text}]},
            "messages",
        ),
        ("/generate", lambda text: {"text": text}, "text"),
    ],
    ids=["completions", "chat", "generate"],
)
def test_over_http_a_text_too_long_is_the_length_400(base, served, monkeypatch, path, body, param):
    """Each route that tokenizes a request's text refuses one too long as the engine does,
    with the 400 of a prompt whose tokens do not fit, before tokenizing it."""
    e = served[1].engine
    seen = _counting(monkeypatch, e.tokenizer)
    text = "a" * ((e.max_model_len - 1) * e.chars_per_token + 1)
    r = httpx.post(base + path, json={"model": MODEL, **body(text)}, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    limit, m = e.max_model_len - 1, e.chars_per_token
    at_least = rf"prompt has at least \d+ tokens \(\d+ characters, at most {m} a token\)"
    assert re.fullmatch(at_least + rf"; at most {limit} fit \(.*\)", err["message"]), err
    assert err["param"] == param and seen == []
