"""Structured output (xgrammar): a random tiny model's output under a grammar is valid by
construction; checked with `jsonschema` / `re` through the server, batched, greedy and sampled."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
import torch

from dsakv.engine import LLM, EngineConfig, SamplingParams
from dsakv.engine.grammar import GrammarCache, GrammarError, after_reasoning
from dsakv.errors import DsakvError
from dsakv.models.tiny import write_tiny_model
from dsakv.server import params as params_module

from .serving import TIMEOUT, serving

MODEL = "tiny-json"
ENGINE_ARGS = dict(
    kv_cache_dtype="fp32", index_k_dtype="fp32", num_pages=128, page_size=16, device="cpu"
)
MAX_TOKENS = 160  # every schema below has bounded strings / items / digits, so it ends sooner

SCHEMAS = {
    "required_fields": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "admin": {"type": "boolean"},
        },
        "required": ["name", "age", "admin"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"const": "L"}},
        "required": ["color", "size"],
    },
    "array_bounds": {
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 50},
        "minItems": 2,
        "maxItems": 4,
    },
    "nested": {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": 0, "maximum": 9},
                    "tags": {
                        "type": "array",
                        "items": {"type": "string", "maxLength": 3},
                        "maxItems": 2,
                    },
                },
                "required": ["x", "tags"],
            },
            "ok": {"type": ["boolean", "null"]},
        },
        "required": ["point", "ok"],
    },
    "pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
        "required": ["code"],
    },
    "number": {
        "type": "object",
        "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["score"],
    },
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("json") / MODEL, preset="glm-tiny", seed=2)


@pytest.fixture(scope="module")
def served(model_dir):
    with serving(EngineConfig(model=str(model_dir), **ENGINE_ARGS)) as served:
        yield served


def _schema_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}}


def test_json_schema_outputs_validate_batched(client):
    """Every schema, greedy and two seeds, chat and completions, all in flight at once (one
    batch, one bitmask): each output parses and validates."""

    def run(job):
        name, seed, chat = job
        sampling = dict(temperature=0) if seed is None else dict(temperature=1.0, seed=seed)
        kw = dict(model=MODEL, max_tokens=MAX_TOKENS, response_format=_schema_format(name))
        if chat:  # (GLM thinks unless told not to; the schema is the answer's, after it)
            r = client.chat.completions.create(
                messages=[{"role": "user", "content": f"Give me {name} JSON"}], **kw, **sampling,
                extra_body={"chat_template_kwargs": {"enable_thinking": False}},
            )  # fmt: skip
            return name, r.choices[0].message.content, r.choices[0].finish_reason
        r = client.completions.create(
            prompt=f"{name}:", extra_body={"response_format": kw.pop("response_format")},
            **kw, **sampling,
        )  # fmt: skip
        return name, r.choices[0].text, r.choices[0].finish_reason

    jobs = [(name, seed, chat) for name in SCHEMAS for seed in (None, 1, 2) for chat in (0, 1)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(run, jobs))
    for name, text, reason in results:
        assert reason == "stop", (name, text)
        jsonschema.validate(json.loads(text), SCHEMAS[name])
    # sampled outputs differ from one another: the mask constrains, it does not dictate
    assert len({text for _, text, _ in results}) > len(SCHEMAS)


def test_n_choices_each_follow_the_schema(client):
    r = client.completions.create(
        model=MODEL, prompt="x", n=4, max_tokens=MAX_TOKENS, temperature=1.0, seed=5,
        extra_body={"response_format": _schema_format("required_fields")},
    )  # fmt: skip
    assert len(r.choices) == 4
    for c in r.choices:
        jsonschema.validate(json.loads(c.text), SCHEMAS["required_fields"])


def test_json_object_regex_and_ebnf(client, base):
    # Any object: unbounded, so a random model's output may run past max_tokens; this seed
    # closes it (others give a truncated prefix, equally well-formed so far).
    r = client.completions.create(
        model=MODEL,
        prompt="JSON please:",
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=1,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].text), dict)
    regex = r"(cat|dog)-[0-9]{2,4}"
    for field in ("regex", "guided_regex"):
        body = {"prompt": "pet:", "max_tokens": 20, "temperature": 0, field: regex}
        out = httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT).json()
        assert re.fullmatch(regex, out["choices"][0]["text"]), out
        assert out["choices"][0]["finish_reason"] == "stop"
    choices = ["red", 'say "hi"', "naïve\\", "re"]  # quotes, a backslash, a prefix of another
    for seed in range(4):
        body = {"prompt": "pick:", "max_tokens": 20, "temperature": 1.0, "seed": seed}
        out = httpx.post(
            f"{base}/v1/completions", json={**body, "guided_choice": choices}, timeout=TIMEOUT
        ).json()
        assert out["choices"][0]["text"] in choices, out
    ebnf = 'root ::= "yes" | "no" | "maybe " digit\ndigit ::= [0-9]'
    body = {"prompt": "answer:", "max_tokens": 20, "temperature": 1.0, "seed": 0, "ebnf": ebnf}
    out = httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT).json()
    assert re.fullmatch(r"yes|no|maybe [0-9]", out["choices"][0]["text"]), out


_BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
        "response_format",
    ),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"structured_outputs": {"json": {"type": "nope"}}}, "structured_outputs"),
    ({"regex": "(unclosed"}, "regex"),
    ({"ebnf": "root ::= undefined_rule"}, "ebnf"),
    ({"regex": "a+", "ebnf": 'root ::= "a"'}, "ebnf"),
    ({"guided_choice": []}, "guided_choice"),
    # keywords xgrammar would accept and not enforce
    ({"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json"),
    ({"guided_json": {"properties": {"a": {"not": {"type": "string"}}}}}, "guided_json"),
    ({"guided_json": {"allOf": [{"type": "string"}, {"type": "integer"}]}}, "guided_json"),
    ({"guided_choice": ["a", ""]}, "guided_choice"),
    ({"response_format": {"type": "structural_tag", "format": {"type": "nope"}}},
     "response_format"),
    ({"response_format": {"type": "structural_tag", "structures": [{"begin": "<a>"}],
                          "triggers": ["<a>"]}}, "response_format"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "param"), _BAD, ids=range(len(_BAD)))
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_invalid_grammar_is_a_400(base, path, extra, param):
    body = (
        {"prompt": "x"} if "chat" not in path else {"messages": [{"role": "user", "content": "x"}]}
    )
    r = httpx.post(base + path, json={**body, **extra}, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err


# After "abcdefghij" this grammar allows nothing, not even the end: it cannot be completed.
# (MTP drafts run up to it: the verify that reaches it stops a row short.)
DEAD_END = ("regex", r"abcdefghij[^\s\S]")


@pytest.mark.parametrize("mtp", [False, True], ids=["plain", "mtp"])
def test_a_grammar_with_no_way_on_fails_alone(mtp):
    """Sampling from an all-masked row made the step raise (the whole batch failed); greedy
    appended a token the grammar refused. The request ends alone, with its error."""
    from dsakv.models.tiny import default_model_dir

    extra = {"speculative_algorithm": "mtp"} if mtp else {}
    with LLM(str(default_model_dir("glm-tiny")), **ENGINE_ARGS, **extra) as llm:
        free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        alone = llm.generate(["free text"], free)[0]
        dead = [
            SamplingParams(max_tokens=16, temperature=t, seed=1, grammar=DEAD_END, logprobs=2)
            for t in (0.0, 1.0)
        ]
        outs = llm.generate(["free text", "x", "y"], [free, *dead])
        assert outs[0].token_ids == alone.token_ids and outs[0].finish_reason == "length"
        for o in outs[1:]:
            assert (o.text, o.finish_reason) == ("abcdefghij", "error")
            assert "cannot be completed" in o.error
        llm.engine.check_integrity()


def test_dead_end_grammar_is_a_400_and_nan_free(base, client):
    r = httpx.post(
        f"{base}/v1/completions",
        json={"prompt": "x", "max_tokens": 16, "regex": DEAD_END[1], "logprobs": 3},
        timeout=TIMEOUT,
    )
    assert r.status_code == 400 and "cannot be completed" in r.json()["error"]["message"]
    r = client.completions.create(
        model=MODEL, prompt="x", max_tokens=3, temperature=0, extra_body={"regex": "[ab]{3}"}
    )
    assert re.fullmatch("[ab]{3}", r.choices[0].text)


def test_still_serves_after_bad_grammar(client, served):
    with pytest.raises(openai.BadRequestError, match="invalid regex"):
        client.completions.create(model=MODEL, prompt="x", extra_body={"regex": "[a-"})
    r = client.completions.create(
        model=MODEL, prompt="x", max_tokens=10, temperature=0, extra_body={"regex": "[ab]{3}"}
    )
    assert re.fullmatch("[ab]{3}", r.choices[0].text)


def test_a_slow_grammar_compile_does_not_stall_other_streams(served, base, monkeypatch):
    """Grammars compile off the engine's step loop (vLLM's way): a schema that takes long to
    compile keeps only its own request waiting. Here its compile waits for the test, which
    meanwhile streams another request to its end; compiled on the engine thread (as it was),
    that stream stalled until the compile returned (a 20 s schema froze every stream)."""
    cache = served[1].engine.grammars
    real = cache._compiler
    slow = r"(slow|compile)-[0-9]"  # compiled nowhere else in this module
    started, release = threading.Event(), threading.Event()

    class SlowCompiler:
        def __getattr__(self, name):
            return getattr(real, name)

        def compile_regex(self, spec):
            if spec == slow:
                started.set()
                release.wait(TIMEOUT)
            return real.compile_regex(spec)

    monkeypatch.setattr(cache, "_compiler", SlowCompiler())
    body = {"prompt": "x", "max_tokens": 12, "temperature": 0, "regex": slow}
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(httpx.post, f"{base}/v1/completions", json=body, timeout=TIMEOUT)
        try:
            assert started.wait(TIMEOUT)
            free = {"prompt": "abc", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            with httpx.stream(
                "POST", f"{base}/v1/completions", json={**free, "stream": True}, timeout=10
            ) as r:
                chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            assert not waiting.done()  # its grammar is still compiling
        finally:
            release.set()
        out = waiting.result(TIMEOUT)
    assert out.status_code == 200, out.text
    assert re.fullmatch(slow, out.json()["choices"][0]["text"])


def test_slow_grammars_time_out_and_leave_other_requests_room(served, base, monkeypatch):
    """Six schemas slow to compile (a hostile client's) ran on the threads that also
    tokenize prompts: every request with max_tokens waited behind them (90 s). Grammars
    compile on threads of their own now, and a request waits for its grammar at most
    GRAMMAR_TIMEOUT_S (a 400), the compile left to finish in the background."""
    cache = served[1].engine.grammars
    real = cache._compiler
    slow = [rf"(stuck|{i})-[0-9]" for i in range(6)]
    release = threading.Event()

    class SlowCompiler:
        def __getattr__(self, name):
            return getattr(real, name)

        def compile_regex(self, spec):
            if spec in slow:
                release.wait(TIMEOUT)
            return real.compile_regex(spec)

    monkeypatch.setattr(cache, "_compiler", SlowCompiler())
    monkeypatch.setattr(params_module, "GRAMMAR_TIMEOUT_S", 2.0)
    with ThreadPoolExecutor(6) as pool:
        try:
            stuck = [
                pool.submit(
                    httpx.post,
                    f"{base}/v1/completions",
                    json={"prompt": "x", "max_tokens": 4, "regex": spec},
                    timeout=TIMEOUT,
                )
                for spec in slow
            ]
            time.sleep(0.5)  # (their compiles have started or queued)
            free = {"prompt": "abc", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
            r = httpx.post(f"{base}/v1/completions", json=free, timeout=10)
            assert r.status_code == 200, r.text
            for f in stuck:
                out = f.result(TIMEOUT)
                assert out.status_code == 400, out.text
                assert "did not compile within 2 s" in out.json()["error"]["message"]
        finally:
            release.set()


# --- structured output after reasoning ---------------------------------------------------------

THINK_END = 263  # the tiny tokenizer's `<|reserved_1|>`, made `</think>` by `thinker`
AGE = {
    "type": "object",
    "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    """A client of a server on a GLM-4.7-style tiny model: its generation prompt opens the
    reasoning block (`<|assistant|><think>`), and `</think>` is one token, as in GLM's
    vocabulary, so a logit_bias can make the random model close its reasoning."""
    path = write_tiny_model(tmp_path_factory.mktemp("think") / MODEL, preset="glm-tiny", seed=2)
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    (token,) = [t for t in tokenizer["added_tokens"] if t["id"] == THINK_END]
    token.update(content="</think>", special=False)
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    with serving(EngineConfig(model=str(path), **ENGINE_ARGS)) as (url, _):
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)


AGE_TAG = {
    "type": "structural_tag",
    "format": {
        "type": "tag",
        "begin": "<age>",
        "content": {"type": "regex", "pattern": "[0-9]{1,3}"},
        "end": "</age>",
    },
}


def _is_age(text: str) -> bool:
    jsonschema.validate(json.loads(text), AGE)
    return True


_AFTER_THINKING = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": AGE}}},
     _is_age),
    ({"guided_json": AGE}, _is_age),
    ({"guided_regex": "[a-z]{3,6}"}, lambda s: re.fullmatch("[a-z]{3,6}", s)),
    ({"guided_choice": ["yes", "no"]}, lambda s: s in ("yes", "no")),
    ({"guided_grammar": 'root ::= "a" | "bb"'}, lambda s: s in ("a", "bb")),
    ({"json_schema": AGE}, _is_age),  # SGLang's three (its ReasonerGrammarBackend)
    ({"regex": "[a-z]{3,6}"}, lambda s: re.fullmatch("[a-z]{3,6}", s)),
    ({"ebnf": 'root ::= "yes" | "no"'}, lambda s: s in ("yes", "no")),
    ({"structured_outputs": {"structural_tag": json.dumps(AGE_TAG)}},  # (as SGLang's, vLLM's)
     lambda s: re.fullmatch("<age>[0-9]{1,3}</age>", s)),
    ({"response_format": AGE_TAG}, lambda s: re.fullmatch("<age>[0-9]{1,3}</age>", s)),
]  # fmt: skip


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize(
    ("extra", "check"), _AFTER_THINKING, ids=[next(iter(e)) for e, _ in _AFTER_THINKING]
)
def test_structured_output_starts_after_the_reasoning(thinker, extra, check, stream):
    """The prompt opens `<think>`: response_format, vLLM's guided_* and structured_outputs
    (a structural tag too) and SGLang's regex / ebnf / json_schema constrain the answer once
    the reasoning is over (vLLM's reasoning parsers, SGLang's ReasonerGrammarBackend), so
    `content` holds it. (Enforced from the first token, they put the answer in
    reasoning_content and left content empty.)"""
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Your age as JSON?"}],
        max_tokens=40,
        temperature=0,
        logit_bias={str(THINK_END): 100},  # the model closes its reasoning at once
        extra_body=extra,
    )
    if stream:
        chunks = list(thinker.chat.completions.create(stream=True, **kw))
        deltas = [c.choices[0].delta for c in chunks]
        content = "".join(d.content or "" for d in deltas)
        reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        finish = chunks[-1].choices[0].finish_reason
    else:
        r = thinker.chat.completions.create(**kw)
        content, reasoning = r.choices[0].message.content, r.choices[0].message.reasoning_content
        finish = r.choices[0].finish_reason
    assert finish == "stop" and reasoning == "", (content, reasoning)
    assert check(content), content


def test_generate_grammars_still_cover_the_reasoning(thinker):
    """SGLang's /generate has no reasoning parser: its grammar covers the whole output, the
    reasoning block included, as SGLang's does."""
    prompt = "<|user|>Think, then answer.<|assistant|><think>"
    params = {"max_new_tokens": 20, "temperature": 0, "regex": "[a-z]{3}</think>[a-z]{2}"}
    url = str(thinker.base_url).removesuffix("/").removesuffix("/v1")
    r = httpx.post(f"{url}/generate", json={"text": prompt, "sampling_params": params})
    assert r.status_code == 200, r.text
    assert re.fullmatch("[a-z]{3}</think>[a-z]{2}", r.json()["text"]), r.json()["text"]


# --- the engine side ---------------------------------------------------------------------------


def test_offline_grammar_mixed_batch_and_cache(model_dir):
    """Constrained and free requests in one batch; the free ones are untouched by the mask,
    and compiled grammars are cached (LRU, bounded)."""
    llm = LLM(str(model_dir), **ENGINE_ARGS)
    free = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    alone = llm.generate(["free text"], free)[0]
    schema = json.dumps(SCHEMAS["enum"])
    constrained = SamplingParams(max_tokens=40, temperature=0, grammar=("json_schema", schema))
    outs = llm.generate(["free text", "json:", "json:"], [free, constrained, constrained])
    assert outs[0].token_ids == alone.token_ids
    for o in outs[1:]:
        jsonschema.validate(json.loads(o.text), SCHEMAS["enum"])
        assert o.finish_reason == "stop" and o.token_ids[-1] in llm.engine.eos_token_ids
    cache = llm.engine.grammars
    assert list(cache._compiled) == [("json_schema", schema)]
    with pytest.raises(DsakvError, match="invalid regex"):
        llm.engine.add_request("x", SamplingParams(grammar=("regex", "(")))
    assert not llm.engine.has_unfinished()
    llm.engine.check_integrity()


def test_vllms_structured_outputs_params_offline(model_dir):
    """vLLM's offline spelling, `SamplingParams(structured_outputs=StructuredOutputsParams(
    ...))` (or a dict of its fields): the same grammar as dsakv's `grammar=`, so the same
    tokens; choices (n > 1, which `replace`s the params) each follow it; one constraint."""
    from dsakv import StructuredOutputsParams

    llm = LLM(str(model_dir), **ENGINE_ARGS)
    schema = SCHEMAS["enum"]

    def follows(text: str, kind: str) -> bool:
        if kind == "json_schema":
            jsonschema.validate(json.loads(text), schema)
            return True
        return bool(re.fullmatch("[a-c]{2,5}x", text)) if kind == "regex" else text in choices

    choices = ["yes", 'no "way"']
    for so, grammar in (
        (StructuredOutputsParams(json=schema), ("json_schema", json.dumps(schema))),
        ({"regex": "[a-c]{2,5}x"}, ("regex", "[a-c]{2,5}x")),
        (StructuredOutputsParams(choice=choices), ("ebnf", 'root ::= "yes" | "no \\"way\\""')),
    ):
        p = SamplingParams(max_tokens=40, temperature=0, structured_outputs=so)
        assert p.grammar == grammar
        ref = SamplingParams(max_tokens=40, temperature=0, grammar=grammar)
        got, want = llm.generate(["json:", "json:"], [p, ref], use_tqdm=False)
        assert got.token_ids == want.token_ids and follows(got.text, grammar[0])
        sampled = SamplingParams(n=3, max_tokens=40, temperature=1.0, seed=1, structured_outputs=so)
        for choice in llm.generate("json:", sampled, use_tqdm=False)[0].outputs:
            assert follows(choice.text, grammar[0]), choice.text
    for bad, said in (
        (StructuredOutputsParams(regex="a", choice=["b"]), "takes one constraint"),
        (StructuredOutputsParams(), "takes one constraint"),
        (StructuredOutputsParams(choice=[]), "choice must be a list of non-empty strings"),
        ({"regexp": "a"}, "structured_outputs takes json, regex"),
        ("regex", "must be StructuredOutputsParams or a dict"),
    ):
        with pytest.raises(DsakvError, match=said):
            SamplingParams(structured_outputs=bad)
    with pytest.raises(DsakvError, match="give one"):
        SamplingParams(grammar=("regex", "b"), structured_outputs={"regex": "a"})
    llm.engine.check_integrity()


def test_after_reasoning_grammars(model_dir):
    """`after_reasoning`: "enabled" (the prompt opened `<think>`) takes free text up to
    `</think>`, then the grammar (a structural tag's format too); "auto" an optional
    `<think>...</think>` first; "disabled" the grammar as it is. The inner grammar is
    checked as `compile` checks it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    cache = GrammarCache(tok, 264, (257,))

    def accepts(grammar, text: str) -> bool:
        m = cache.matcher(grammar)
        return m.accept_string(text) and m.accept_token(257) and m.is_terminated()

    cases = [
        (("json_schema", json.dumps(SCHEMAS["enum"])), '{"color": "red", "size": "L"}'),
        (("json_object", ""), '{"a": [1, "b"]}'),
        (("regex", "[a-z]{3}"), "abc"),
        (("ebnf", 'root ::= "yes" | "no"'), "no"),
        (("structural_tag", json.dumps(AGE_TAG)), "<age>7</age>"),
    ]
    for grammar, answer in cases:
        assert after_reasoning(grammar, "disabled") == grammar
        enabled, auto = after_reasoning(grammar, "enabled"), after_reasoning(grammar, "auto")
        assert enabled[0] == auto[0] == "structural_tag"
        assert accepts(enabled, "Hmm. {not yet} <x>\n</think>" + answer)
        assert accepts(enabled, "</think>" + answer)
        assert not accepts(enabled, answer)
        assert not accepts(enabled, "a<think>b</think>" + answer)
        assert accepts(auto, answer) and accepts(auto, "<think>hmm</think>" + answer)
        assert not accepts(auto, "hmm</think>" + answer)
        assert not accepts(enabled, "</think>" + answer + " more")
    with pytest.raises(GrammarError, match="invalid regex"):
        after_reasoning(("regex", "(unclosed"), "enabled")
    with pytest.raises(GrammarError, match="uniqueItems at / cannot be enforced"):
        after_reasoning(("json_schema", '{"type": "array", "uniqueItems": true}'), "auto")
    with pytest.raises(GrammarError, match="invalid json schema: not JSON"):
        after_reasoning(("json_schema", "{oops"), "auto")
    with pytest.raises(GrammarError, match="invalid ebnf"):
        after_reasoning(("ebnf", "root ::= undefined_rule"), "enabled")
    with pytest.raises(GrammarError, match="invalid structural tag: .*must have a format"):
        after_reasoning(("structural_tag", '{"type": "structural_tag"}'), "auto")


def test_structural_tags_legacy_format_and_compact_json(model_dir):
    """SGLang's and vLLM's legacy structural tag (`structures`, `triggers`) is taken: free
    text until a trigger, then its structure; a JSON-schema part is whitespace-free as the
    `json_schema` kind is (xgrammar's own let a model wander into endless whitespace), unless
    the tag bounds its whitespace itself. A malformed legacy tag is one clear error."""
    from transformers import AutoTokenizer

    cache = GrammarCache(AutoTokenizer.from_pretrained(str(model_dir)), 264, (257,))

    def accepts(grammar, text: str) -> bool:
        m = cache.matcher(grammar)
        return m.accept_string(text) and m.accept_token(257) and m.is_terminated()

    structure = {"begin": "<f>", "schema": AGE, "end": "</f>"}
    legacy = ("structural_tag", json.dumps({"structures": [structure], "triggers": ["<f>"]}))
    assert accepts(legacy, 'Sure. <f>{"age": 7}</f> and <f>{"age": 12}</f> done')
    assert accepts(legacy, "no call at all")
    assert not accepts(legacy, 'x <f>{"age": "7"}</f>')
    assert not accepts(legacy, 'x <f>{ "age": 7}</f>')
    tagged = {"type": "tag", "begin": "<f>", "end": "</f>"}
    plain = {"type": "json_schema", "json_schema": AGE}
    compact = ("structural_tag", json.dumps({"format": {**tagged, "content": plain}}))
    assert accepts(compact, '<f>{"age": 7}</f>')
    assert not accepts(compact, '<f>{"age": 7 }</f>')
    loose = {"format": {**tagged, "content": {**plain, "max_whitespace_cnt": 2}}}
    assert accepts(("structural_tag", json.dumps(loose)), '<f>{ "age":  7 }</f>')
    # SGLang's at_least_one: a structure must come; a structure without a schema: any JSON
    forced = {"structures": [structure], "triggers": ["<f>"], "at_least_one": True}
    assert not accepts(("structural_tag", json.dumps(forced)), "no call at all")
    assert accepts(("structural_tag", json.dumps(forced)), '<f>{"age": 7}</f>')
    free = {"structures": [{"begin": "<f>", "end": "</f>"}], "triggers": ["<f>"]}
    assert accepts(("structural_tag", json.dumps(free)), 'x <f>{"any": [1, "json"]}</f>')
    # a JSON schema's own values are data, never rewritten (a const shaped like a part)
    part = {"type": "json_schema", "json_schema": {"type": "integer"}}
    data = {"type": "object", "properties": {"p": {"const": part}}, "required": ["p"]}
    as_data = {"format": {**tagged, "content": {**plain, "json_schema": data}}}
    const = json.dumps(part, separators=(",", ":"))  # (how xgrammar writes a const)
    assert accepts(("structural_tag", json.dumps(as_data)), f'<f>{{"p": {const}}}</f>')
    bad = [
        ({"structures": [structure], "triggers": "<f>"}, "triggers must be a list"),
        ({"structures": [{"begin": "<f>", "schema": []}], "triggers": []}, "each structure"),
        ({"structures": [], "triggers": [], "at_least_one": "yes"}, "at_least_one must be"),
        ([1], "not a JSON object"),
    ]
    for tag, message in bad:
        with pytest.raises(GrammarError, match=f"invalid structural tag: {message}"):
            cache.compile(("structural_tag", json.dumps(tag)))
        with pytest.raises(GrammarError, match=f"invalid structural tag: {message}"):
            after_reasoning(("structural_tag", json.dumps(tag)), "auto")


def test_json_strings_take_valid_utf8_only(model_dir):
    """xgrammar admits a UTF-16 surrogate written as UTF-8 (ED A0..BF xx) in a JSON string:
    invalid UTF-8, decoded as three U+FFFD, so `{"s": "a" + surrogate}` passed maxLength 2
    and the output broke its schema with finish_reason "stop". Real characters still pass."""
    from transformers import AutoTokenizer

    cache = GrammarCache(AutoTokenizer.from_pretrained(str(model_dir)), 264, (257,))
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 2}}}
    grammars = [("json_schema", json.dumps(schema)), ("json_object", "")]

    def accepts(grammar, data: bytes) -> bool:  # the tiny tokenizer: token id = byte
        m = cache.matcher(grammar)
        return all(m.accept_token(b) for b in data)

    for grammar in grammars:
        for surrogate in (b"\xed\xa0\x80", b"\xed\xbc\x8f", b"\xed\xbf\xbf"):
            assert not accepts(grammar, b'{"s": "a' + surrogate), (grammar, surrogate)
        assert accepts(grammar, '{"s": "漢😀"}'.encode())
    assert not accepts(grammars[1], b'{"\xed\xa0\x80')  # keys too


def test_grammar_cache_is_bounded_and_masks_rows(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    cache = GrammarCache(tok, 264, (257,), max_entries=2)
    for i in range(4):
        cache.compile(("regex", f"a{{{i + 1}}}"))
    assert list(cache._compiled) == [("regex", "a{3}"), ("regex", "a{4}")]
    # and nothing beyond them: xgrammar's own cache kept every grammar, without a limit (a
    # server's memory grew by ~70 KB per new schema)
    assert cache._compiler.get_cache_size_bytes() == 0
    logits = torch.zeros(3, 264)
    cache.apply(logits, [cache.matcher(("regex", "b")), None, cache.matcher(("regex", "[cd]"))])
    allowed = [torch.nonzero(row > float("-inf")).flatten().tolist() for row in logits]
    assert allowed == [[ord("b")], list(range(264)), [ord("c"), ord("d")]]


def test_a_dp_peer_compiles_grammars_off_its_step_loop(model_dir):
    """Under DP attention a peer rank's loop steps in lockstep with every rank: a request
    with a slow grammar waits while a worker compiles it, the others are queued at once,
    and one aborted while it waits never runs. (One rank stands in for the peer: the
    messages rank 0 sends name it.)"""
    import threading

    from dsakv.engine import Engine
    from dsakv.engine.dp import _Reporter

    engine = Engine(EngineConfig(model=str(model_dir), **ENGINE_ARGS))
    compile_, gate = engine.grammars.compile, threading.Event()
    engine.grammars.compile = lambda g: gate.wait(TIMEOUT) and compile_(g)  # a slow schema
    regex = r"(cat|dog)-[0-9]{2,4}"
    slow = SamplingParams(max_tokens=12, temperature=0, grammar=("regex", regex))
    plain = SamplingParams(max_tokens=4, temperature=0)
    reporter = _Reporter(engine)
    try:
        adds = [(0, 101, [5, 6, 7], slow), (0, 102, [8, 9], plain), (0, 103, [5, 6], slow)]
        reporter.apply(("step", adds, [], []))  # returns with the grammar still compiling
        assert set(engine.requests) == {102} and set(reporter.pending) == {101, 103}
        assert reporter.report(engine.step()).waiting_tokens == 5  # pending ones count
        reporter.apply(("step", [], [(0, 103)], []))  # aborted while it waits
        gate.set()
        reporter.pending[101][0].result(TIMEOUT)
        reporter.apply(("step", [], [], []))
        assert not reporter.pending and 101 in engine.requests and 103 not in engine.requests
        req = engine.requests[101]
        while engine.has_unfinished():
            engine.step()
        assert re.fullmatch(regex, req.output_text), req.output_text
    finally:
        gate.set()
        reporter.close()
