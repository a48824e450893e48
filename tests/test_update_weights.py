"""SGLang's /update_weights_from_disk (`Engine.update_weights`), end to end on tiny models:
a server updated from one checkpoint to another answers as a fresh server on the second
(every weight replaced, the MTP layer's too, the prefix cache not reused), in each form the
loader keeps weights in; a checkpoint that does not fit changes nothing; an update waits for
the generation in flight (or aborts it) and holds back new ones until it is done."""

from __future__ import annotations

import asyncio
import copy
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import torch

from dsakv.config.presets import TINY_PRESETS
from dsakv.engine import LLM, EngineConfig
from dsakv.errors import DsakvError
from dsakv.models.tiny import write_tiny_model

from .serving import TIMEOUT, engine_stops_stepping_at, serving

# index_topk over every context: chunked prefill and cached prefixes change no number.
ENGINE_ARGS = dict(
    kv_cache_dtype="fp32",
    index_k_dtype="fp32",
    num_pages=64,
    page_size=16,
    chunked_prefill_size=40,
    device="cpu",
)
PROMPT = list(range(5, 45))  # two whole pages to cache
ASK = {
    "input_ids": PROMPT,
    "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
    "return_logprob": True,
    "top_logprobs_num": 2,
}


def _model(root, preset: str, seed: int, weights: str = "fp32"):
    p = copy.deepcopy(TINY_PRESETS[preset])
    p["index_topk"] = 4096
    return write_tiny_model(
        root / f"{preset}-{weights}-{seed}", preset=p, seed=seed, weights=weights
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("update")
    return {
        (preset, weights, seed): _model(root, preset, seed, weights)
        for preset, weights in (
            ("glm-tiny", "fp32"),
            ("glm-tiny", "bf16"),
            ("deepseek-tiny", "fp32"),
        )
        for seed in (0, 1)
    }


def _generate(base: str, **body: Any) -> dict:
    r = httpx.post(f"{base}/generate", json={**ASK, **body}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()


def _update(base: str, path, **body: Any) -> httpx.Response:
    return httpx.post(
        f"{base}/update_weights_from_disk", json={"model_path": str(path), **body}, timeout=TIMEOUT
    )


def _answer(out: dict) -> tuple:
    """What the weights decide: the tokens and every logprob."""
    m = out["meta_info"]
    return out["output_ids"], m["output_token_logprobs"], m["output_top_logprobs"]


def _weights(async_engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in async_engine.engine.model.state_dict().items()}


def _config(path, **args: Any) -> EngineConfig:
    return EngineConfig(model=str(path), **{**ENGINE_ARGS, **args})


@pytest.mark.parametrize(
    "preset, weights, args",
    [
        ("glm-tiny", "fp32", {}),  # the native CPU kernels' path, fp32 weights
        ("glm-tiny", "bf16", {}),  # bf16 matrices kept as stored
        ("glm-tiny", "fp32", {"dtype": "bfloat16"}),
        ("deepseek-tiny", "fp32", {"speculative_algorithm": "mtp"}),  # + MTP, own vocab copies
    ],
    ids=["fp32-native", "bf16-stored", "dtype-bf16", "mtp"],
)
def test_updated_server_answers_as_a_fresh_one(models, preset, weights, args):
    """Seed 0's server updated to seed 1 gives seed 1's fresh server's tokens and logprobs
    bit for bit, holds its every weight, reuses no prefix cached before, and reports the
    weight_version given."""
    old, new = models[preset, weights, 0], models[preset, weights, 1]
    with serving(_config(new, **args)) as (base, fresh):
        want = _generate(base)
        want_weights = _weights(fresh)
    with serving(_config(old, **args)) as (base, async_engine):
        before = _generate(base)
        assert _generate(base)["meta_info"]["cached_tokens"] == 32  # (the prompt's 2 pages)
        assert before["meta_info"]["weight_version"] == "default"
        r = _update(base, new, weight_version="v1")
        assert r.status_code == 200, r.text
        assert r.json() == {
            "success": True,
            "message": "Succeeded to update model weights. Weight version updated to v1.",
            "num_paused_requests": 0,
        }
        got = _generate(base)
        assert got["meta_info"]["cached_tokens"] == 0  # (old weights' KV: dropped)
        assert _answer(got) == _answer(want) != _answer(before)
        assert got["meta_info"]["weight_version"] == "v1"
        assert _weights(async_engine).keys() == want_weights.keys()
        for name, tensor in _weights(async_engine).items():
            assert torch.equal(tensor, want_weights[name]), name
        assert httpx.get(f"{base}/get_weight_version").json() == {"weight_version": "v1"}
        assert httpx.get(f"{base}/model_info").json()["weight_version"] == "v1"
        # and back: the first weights' answers again
        assert _update(base, old).json()["success"]
        assert _answer(_generate(base)) == _answer(before)
        assert _generate(base)["meta_info"]["weight_version"] == "v1"  # (none given: kept)


def test_a_checkpoint_that_does_not_fit_changes_nothing(models, tmp_path):
    """Another preset, a missing path, weights stored otherwise (bf16 where the server keeps
    fp32), an unknown load_format: a 400 with success false; the server answers as before."""
    base_model = models["glm-tiny", "fp32", 0]
    with serving(_config(base_model)) as (base, async_engine):
        before, weights = _generate(base), _weights(async_engine)
        bad = {
            models["deepseek-tiny", "fp32", 1]: "another architecture",
            tmp_path / "nowhere": "is not a directory",
            models["glm-tiny", "bf16", 1]: "as it stores them",
        }
        for path, words in bad.items():
            r = _update(base, path, weight_version="bad")
            assert r.status_code == 400, r.text
            body = r.json()
            assert body["success"] is False and body["num_paused_requests"] == 0
            assert (
                body["message"].startswith("Failed to update weights: ")
                and words in body["message"]
            )
        r = _update(base, models["glm-tiny", "fp32", 1], load_format="pt")
        assert r.status_code == 400 and "load_format" in r.json()["message"]
        after = _generate(base)
        assert _answer(after) == _answer(before)
        assert after["meta_info"]["weight_version"] == "default"
        for name, tensor in _weights(async_engine).items():
            assert torch.equal(tensor, weights[name]), name


def test_python_api_updates_in_place(models):
    """`LLM.update_weights`: the offline engine's answers become the new checkpoint's; one
    that does not fit raises and changes nothing."""
    from dsakv.engine import SamplingParams

    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)
    old, new = models["glm-tiny", "fp32", 0], models["glm-tiny", "fp32", 1]
    fresh = LLM(str(new), **ENGINE_ARGS).generate([PROMPT], sp)[0].outputs[0]
    llm = LLM(str(old), **ENGINE_ARGS)
    before = llm.generate([PROMPT], sp)[0].outputs[0]
    with pytest.raises(DsakvError, match="another architecture"):
        llm.update_weights(models["deepseek-tiny", "fp32", 0])
    assert llm.generate([PROMPT], sp)[0].outputs[0].logprobs == before.logprobs
    llm.update_weights(new)
    out = llm.generate([PROMPT], sp)[0].outputs[0]
    assert (out.token_ids, out.logprobs) == (fresh.token_ids, fresh.logprobs)


def test_l3_pages_of_the_old_weights_are_not_read_after(models, tmp_path):
    """The L3 storage tier: pages stored under the old weights are not the new weights' (an
    update moves L3 to the new checkpoint's namespace), and its pages are stored anew."""
    from dsakv.engine import SamplingParams

    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)
    old, new = models["glm-tiny", "fp32", 0], models["glm-tiny", "fp32", 1]
    fresh = LLM(str(new), **ENGINE_ARGS).generate([PROMPT], sp)[0].outputs[0]
    store = dict(hicache_storage_backend="file", hicache_storage_dir=str(tmp_path))
    llm = LLM(str(old), **ENGINE_ARGS, **store)
    try:
        llm.generate([PROMPT], sp)
        assert llm.engine.l3.drain(TIMEOUT) and llm.engine.counters()["l3_pages_written"] == 2
        llm.update_weights(new)
        out = llm.generate([PROMPT], sp)[0].outputs[0]
        assert (out.token_ids, out.logprobs) == (fresh.token_ids, fresh.logprobs)
        assert llm.engine.l3.drain(TIMEOUT)
        c = llm.engine.counters()
        assert c["l3_hits"] == 0 and c["l3_pages_written"] == 4
    finally:
        llm.close()


def _live(async_engine) -> list[int]:
    async def get() -> list[int]:
        return await asyncio.wait_for(
            async_engine.call(
                lambda e: [len(r.output_ids) for r in e.requests.values() if not r.finished]
            ),
            TIMEOUT,
        )

    return asyncio.run(get())


def _until(check, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_an_update_waits_for_the_request_in_flight(models):
    """A streaming request started on the old weights ends on them, whole; the update runs
    after it, and a request sent meanwhile waits for the update and runs on the new weights."""
    old, new = models["glm-tiny", "fp32", 0], models["glm-tiny", "fp32", 1]
    long = {"sampling_params": {**ASK["sampling_params"], "max_new_tokens": 24}}
    with serving(_config(new)) as (base, _):
        want_new = _generate(base)
    with serving(_config(old)) as (base, async_engine):
        want_old = _generate(base, **long)
        with ThreadPoolExecutor(3) as pool:
            with engine_stops_stepping_at(async_engine, 4):
                streamed = pool.submit(_stream_last, base, **long)
                _until(lambda: _live(async_engine) == [4], "the stream did not start")
                update = pool.submit(_update, base, new, weight_version="v2")
                time.sleep(0.3)
                later = pool.submit(_generate, base)
                time.sleep(0.3)
                assert not update.done() and not later.done()  # (held by the stream)
            last = streamed.result(TIMEOUT)
            assert update.result(TIMEOUT).json()["success"]
            out = later.result(TIMEOUT)
        assert _answer(last) == _answer(want_old)
        assert last["meta_info"]["weight_version"] == "default"
        assert _answer(out) == _answer(want_new) and out["meta_info"]["weight_version"] == "v2"


def test_abort_all_requests_ends_the_request_in_flight_first(models):
    """`abort_all_requests`: the request in flight ends at once, finish_reason abort, and the
    update goes ahead without waiting for it."""
    old, new = models["glm-tiny", "fp32", 0], models["glm-tiny", "fp32", 1]
    long = {"sampling_params": {**ASK["sampling_params"], "max_new_tokens": 64}}
    with serving(_config(old)) as (base, async_engine):
        with ThreadPoolExecutor(2) as pool, engine_stops_stepping_at(async_engine, 3):
            streamed = pool.submit(_stream_last, base, **long)
            _until(lambda: _live(async_engine) == [3], "the stream did not start")
            r = _update(base, new, abort_all_requests=True)
            assert r.status_code == 200 and r.json()["success"], r.text
            last = streamed.result(TIMEOUT)
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
        assert len(last["output_ids"]) == 3
        assert not _live(async_engine)


def _stream_last(base: str, **body: Any) -> dict:
    """A streamed /generate's last output (SGLang streams the output so far)."""
    import json

    with httpx.stream(
        "POST", f"{base}/generate", json={**ASK, **body, "stream": True}, timeout=TIMEOUT
    ) as r:
        assert r.status_code == 200
        events = [x for x in r.iter_lines() if x.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    return json.loads(events[-2][6:])


def test_update_weight_version(models):
    """SGLang's /update_weight_version renames the weights /generate reports, no load."""
    with serving(_config(models["glm-tiny", "fp32", 0])) as (base, _):
        r = httpx.post(
            f"{base}/update_weight_version", json={"new_version": "step-7"}, timeout=TIMEOUT
        )
        assert r.json() == {
            "success": True,
            "message": "Weight version updated to step-7",
            "new_version": "step-7",
        }
        assert _generate(base)["meta_info"]["weight_version"] == "step-7"
