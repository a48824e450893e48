"""SGLang's and vLLM's `--stream-interval N`: a running request's tokens reach its stream N
at a time, its first at once (time to first token unchanged) and its last with the end;
what a client reads in total is the same."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from dsakv.cli import main
from dsakv.engine import EngineConfig
from dsakv.errors import DsakvError

from .serving import (
    TIMEOUT,
    engine_stops_stepping_at,
    scrape_metrics,
    serving,
    sglang_stream,
    until_in_flight,
)

INTERVAL = 4


@pytest.fixture(scope="module")
def served(glm_tiny):
    config = EngineConfig(model=glm_tiny, num_pages=32, stream_interval=INTERVAL)
    with serving(config) as served:
        yield served


@pytest.fixture(scope="module")
def base(served):
    return served[0]


def test_tokens_reach_the_stream_n_at_a_time(base):
    ask = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 10,
           "temperature": 0, "ignore_eos": True}}  # fmt: skip
    events = sglang_stream(base, **ask)
    counts = [e["meta_info"]["completion_tokens"] for e in events]
    assert counts == [1, 5, 9, 10]  # (the first at once, then 4 at a time, the rest at the end)
    whole = httpx.post(f"{base}/generate", json=ask, timeout=TIMEOUT).json()
    assert events[-1]["output_ids"] == whole["output_ids"]
    assert events[-1]["text"] == whole["text"]
    # OpenAI's stream: as many chunks, their text the whole answer
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    with httpx.stream(
        "POST", f"{base}/v1/completions", json={**body, "stream": True}, timeout=TIMEOUT
    ) as r:
        chunks = [x for x in r.iter_lines() if x.startswith("data: {")]
    assert len(chunks) <= 5  # (4 with tokens, maybe one more with the finish)
    plain = httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT).json()
    text = "".join(c["text"] for x in chunks for c in json.loads(x[6:])["choices"])
    assert text == plain["choices"][0]["text"]


def test_a_request_s_own_interval_overrides_the_server_s(base):
    """SGLang's sampling_params.stream_interval (0 or null: the server's)."""
    sp = {"max_new_tokens": 7, "temperature": 0, "ignore_eos": True}
    for own, counts in ((2, [1, 3, 5, 7]), (1, list(range(1, 8))), (0, [1, 5, 7])):
        events = sglang_stream(
            base, input_ids=[5, 6], sampling_params={**sp, "stream_interval": own}
        )
        assert [e["meta_info"]["completion_tokens"] for e in events] == counts, own


def test_an_abort_hands_out_the_tokens_held_back(served):
    """An /abort_request while tokens wait for the interval: the answer holds them (ids,
    logprobs and text alike), not only the text."""
    base, engine = served
    sp = {"max_new_tokens": 50, "temperature": 0, "ignore_eos": True, "stream_interval": 1000}
    ask = {"input_ids": [5, 6, 7], "rid": "held", "sampling_params": sp, "return_logprob": True}
    with engine_stops_stepping_at(engine, 6), ThreadPoolExecutor(1) as pool:
        held = pool.submit(httpx.post, f"{base}/generate", json=ask, timeout=TIMEOUT)
        until_in_flight(base, held)
        deadline = time.monotonic() + TIMEOUT
        while not any(len(r.output_ids) >= 6 for r in list(engine.engine.requests.values())):
            assert time.monotonic() < deadline, "the request never ran"
            time.sleep(0.02)
        httpx.post(f"{base}/abort_request", json={"rid": "held"}, timeout=TIMEOUT)
        out = held.result().json()
    meta = out["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert len(out["output_ids"]) == meta["completion_tokens"] == 6
    assert len(meta["output_token_logprobs"]) == 6


def test_inter_token_latency_is_one_gap_a_step_whatever_the_interval(base):
    """vLLM's inter-token latency: one sample per step that brought tokens (9 for 10
    tokens), the steps held back for the interval included, not one per chunk sent."""
    name = "dsakv_inter_token_latency_seconds_count"
    before = scrape_metrics(base).get(name, 0)
    ask = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 10, "temperature": 0,
           "ignore_eos": True}}  # fmt: skip
    assert len(sglang_stream(base, **ask)) == 4  # (1, 4, 4, 1 tokens)
    assert scrape_metrics(base)[name] - before == 9


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_an_interval_below_one_token_is_refused(bad):
    with pytest.raises(DsakvError, match="stream_interval must be a positive integer"):
        EngineConfig(model="glm-tiny", stream_interval=bad)


@pytest.mark.parametrize(
    "args",
    [
        ["generate", "glm-tiny", "--prompt", "x", "--stream-interval", "2"],  # (a server's)
        ["serve", "glm-tiny", "--stream-interval", "0"],
    ],
)
def test_bad_flags_are_one_error_line(args, capsys):
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
