"""Sleep mode for a trainer colocated with the engine (SGLang's /release_memory_occupation,
vLLM's /sleep): the KV pool's and the weights' storage really freed and brought back, the
outputs after a wake bit-identical (the native CPU path's tables and the MTP layer made
again over the moved memory), discarded weights (level 2) refused until every one is
loaded again; refused under requests that hold KV, new requests a 503 while asleep; on
every rank (`--tp 2 --ep 2`), and on every server behind `dsakv router`."""

from __future__ import annotations

import shutil
import threading
import time
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file

from dsakv.engine import LLM, EngineConfig, SamplingParams
from dsakv.engine.sleep import EngineAsleep
from dsakv.errors import DsakvError
from dsakv.memory.release import held_bytes

from .serving import TIMEOUT, routing, serving, serving_disagg
from .test_pause_generation import _frozen_at, _on_engine, _Stream
from .test_update_weights import ENGINE_ARGS, _model

PROMPTS = [list(range(5, 45)), list(range(60, 100))]  # two pages each to cache
ASK = {
    "input_ids": PROMPTS[0],
    "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
    "return_logprob": True,
    "top_logprobs_num": 2,
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("sleep")
    return {p: _model(root, p, 0) for p in ("glm-tiny", "deepseek-tiny")}


def _outputs(llm: LLM) -> list[tuple]:
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    return [(c.token_ids, c.logprobs) for o in outs for c in o.outputs]


def _held(engine) -> dict[str, int]:
    """The bytes the weights (parameters and buffers) and the KV pool's buffers hold."""
    pool = engine.pool
    kv = [pool.latent_data(i) for i in range(pool.layout.num_layers)]
    kv += [pool.index_k_data(i) for i in pool.layout.index_k_layers]
    weights = [*engine.model.parameters(), *engine.model.buffers()]
    return {"weights": held_bytes(weights), "kv_cache": held_bytes(kv)}


def _occupy(engine) -> list[torch.Tensor]:
    """Tensors the size of everything released, taken while it is: what comes back on wake
    lands at other addresses, which every native table must then follow."""
    tensors = [*engine.model.parameters(), *engine.model.buffers()]
    tensors += [engine.pool.latent_data(i) for i in range(engine.pool.layout.num_layers)]
    return [torch.ones(t.shape, dtype=t.dtype) for t in tensors]


@pytest.mark.parametrize(
    "preset, args",
    [("glm-tiny", {}), ("deepseek-tiny", {"speculative_algorithm": "mtp"})],
    ids=["native", "mtp"],
)
def test_level1_frees_memory_and_wakes_bit_identical(models, preset, args):
    """Sleep level 1 frees every byte of the pool and the weights (storage, not a flag) and
    drops the prefix cache; generating is refused while asleep; sleeping twice is fine. On
    wake, at new addresses, the same tokens and logprobs, through the native CPU path
    (its layer loop made again) and with MTP drafts."""
    with LLM(str(models[preset]), **ENGINE_ARGS, **args) as llm:
        e = llm.engine
        want = _outputs(llm)
        assert _outputs(llm) == want and e.cache.num_device_pages > 0
        if not args:
            assert e.deterministic and "_layer_loop" in e.model.__dict__  # (native loop ran)
        held = _held(e)
        assert held["weights"] > 0 and held["kv_cache"] > 0
        llm.sleep(level=1)
        assert llm.is_sleeping()
        assert _held(e) == {"weights": 0, "kv_cache": 0}
        assert e.cache.num_device_pages == 0
        with pytest.raises(EngineAsleep, match=r"asleep .* wake it first"):
            llm.generate(PROMPTS, use_tqdm=False)
        llm.sleep(level=2)  # (asleep already: nothing more happens, the host copy stays)
        blockers = _occupy(e)
        llm.wake_up()
        llm.wake_up()
        assert not llm.is_sleeping() and _held(e) == held
        assert e.cache.num_device_pages == 0
        assert _outputs(llm) == want
        del blockers
        e.check_integrity()


def test_level2_refused_until_every_weight_is_loaded(models):
    """Level 2 drops the weights (no host copy): after wake they are zeros, and generating
    is refused, naming what loads them, until updates have covered every checkpoint tensor
    (two buckets of tensors, the first not enough), then as before; or one checkpoint."""
    path = models["glm-tiny"]
    tensors = sorted(load_file(path / "model.safetensors").items())
    with LLM(str(path), **ENGINE_ARGS) as llm:
        e = llm.engine
        want = _outputs(llm)
        held = _held(e)
        llm.sleep(level=2)
        assert _held(e) == {"weights": 0, "kv_cache": 0}
        llm.wake_up()
        assert not llm.is_sleeping() and _held(e) == held
        assert all(p.count_nonzero() == 0 for p in e.model.parameters())
        last = tensors[-1][0]
        with pytest.raises(EngineAsleep, match="update_weights_from_disk"):
            llm.generate(PROMPTS, use_tqdm=False)
        llm.update_weights_from_tensor(tensors[:-1], flush_cache=False)
        with pytest.raises(EngineAsleep, match=f"1 of this rank's weights, e.g. {last}"):
            llm.generate(PROMPTS, use_tqdm=False)
        llm.update_weights_from_tensor(tensors[-1:])
        assert _outputs(llm) == want
        llm.sleep(level=2)
        llm.wake_up()
        llm.update_weights(path)
        assert _outputs(llm) == want


def test_level2_failed_update_rolls_back_to_a_servable_checkpoint(models, tmp_path, monkeypatch):
    """After level 2, a checkpoint update that fails part way (its file gone after the
    check) reloads the previous checkpoint whole: every weight is loaded again, so the
    engine generates (as before the sleep) instead of refusing for discarded weights."""
    from dsakv.models import loader

    path, new = models["glm-tiny"], tmp_path / "new"
    shutil.copytree(models["glm-tiny"], new)
    check = loader.check_update

    def then_gone(*args, **kw):
        checked = check(*args, **kw)
        (new / "model.safetensors").unlink()
        return checked

    with LLM(str(path), **ENGINE_ARGS) as llm:
        want = _outputs(llm)
        llm.sleep(level=2)
        llm.wake_up()
        monkeypatch.setattr(loader, "check_update", then_gone)
        with pytest.raises(DsakvError, match=f"every rank serves {path} again$"):
            llm.update_weights(new)
        assert _outputs(llm) == want


def test_kv_cache_release_keeps_the_weights(models):
    """Releasing the KV cache alone frees the pool and leaves the weights where they are;
    the tags are checked; the cuda_graph tag alone (no graphs on a CPU) still sleeps."""
    with LLM(str(models["glm-tiny"]), **ENGINE_ARGS) as llm:
        e = llm.engine
        want = _outputs(llm)
        held = _held(e)
        before = {n: (p.data_ptr(), p.clone()) for n, p in e.model.named_parameters()}
        llm.release_memory_occupation(["kv_cache"])
        assert _held(e) == {"weights": held["weights"], "kv_cache": 0}
        for n, p in e.model.named_parameters():
            assert p.data_ptr() == before[n][0] and torch.equal(p, before[n][1])
        with pytest.raises(EngineAsleep, match="kv_cache memory released"):
            llm.generate(PROMPTS, use_tqdm=False)
        llm.resume_memory_occupation(["weights"])  # (not released: nothing to do)
        assert llm.is_sleeping()
        llm.resume_memory_occupation(["kv_cache"])
        assert _held(e) == held and _outputs(llm) == want
        with pytest.raises(DsakvError, match="unknown memory tag.*'kv'"):
            llm.release_memory_occupation(["kv"])
        with pytest.raises(DsakvError, match="level must be 1 .* or 2"):
            llm.sleep(level=3)
        llm.release_memory_occupation(["cuda_graph"])
        assert llm.is_sleeping() and _held(e) == held
        llm.resume_memory_occupation()
        assert not llm.is_sleeping() and _outputs(llm) == want


# --- the server (SGLang's and vLLM's routes) -----------------------------------------------


def _generate(base: str) -> dict:
    r = httpx.post(f"{base}/generate", json=ASK, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()


def _answer(out: dict) -> tuple:
    m = out["meta_info"]
    return out["output_ids"], m["output_token_logprobs"], m["output_top_logprobs"]


def _post(base: str, path: str, **kw: Any) -> httpx.Response:
    return httpx.post(f"{base}{path}", timeout=TIMEOUT, **kw)


def _sleeping(base: str) -> bool:
    r = httpx.get(f"{base}/is_sleeping", timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()["is_sleeping"]


def _refused_asleep(base: str, match: str) -> None:
    """Generation calls, SGLang's and OpenAI's, answer 503 (at once: no hang)."""
    for r in (
        _post(base, "/generate", json=ASK),
        _post(base, "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 2}),
    ):
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["type"] == "server_error" and match in error["message"], error


def test_server_sleeps_and_wakes(models):
    """Over HTTP: a running request (or one paused in place, with its KV) refuses a
    release, naming what to do; vLLM's /sleep, /is_sleeping and /wake_up by tag, with
    generation a 503 while asleep and the same answer after; a paused, retracted request
    waits through a release (generation continued meanwhile takes no step) and ends as an
    unpaused run; level 2 answers 503 until /update_weights_from_disk; bad levels and tags
    are a 400."""
    path = models["glm-tiny"]
    with serving(EngineConfig(model=str(path), **ENGINE_ARGS)) as (base, async_engine):
        want = _answer(_generate(base))
        with _frozen_at(async_engine, 2):
            stream = _Stream(base, **ASK)
            stream.wait_tokens(2)
            for call in ("/release_memory_occupation", "/sleep"):
                r = _post(base, call, json={})
                assert r.status_code == 400, r.text
                assert "/pause_generation" in r.json()["error"]["message"]
            assert _post(base, "/pause_generation", json={"mode": "in_place"}).status_code == 200
            r = _post(base, "/release_memory_occupation", json={"tags": ["weights"]})
            assert r.status_code == 400 and "retract" in r.json()["error"]["message"]
            assert _post(base, "/pause_generation", json={"mode": "retract"}).status_code == 200
        r = _post(base, "/release_memory_occupation", json={"tags": None})
        assert r.status_code == 200, r.text
        assert _post(base, "/continue_generation").status_code == 200
        time.sleep(0.1)  # (a step over released memory would run meanwhile)
        assert stream.tokens() == 2 and _sleeping(base)
        _refused_asleep(base, "asleep")
        assert _post(base, "/resume_memory_occupation", json={}).status_code == 200
        assert stream.last()["output_ids"] == want[0]

        assert _post(base, "/sleep", params={"level": 1}).status_code == 200
        assert _sleeping(base)
        _refused_asleep(base, "wake it first")
        assert _post(base, "/wake_up", params={"tags": ["weights"]}).status_code == 200
        assert _sleeping(base)  # (the KV cache is still released)
        assert _post(base, "/wake_up", params={"tags": ["kv_cache"]}).status_code == 200
        assert not _sleeping(base)
        got = _generate(base)
        assert got["meta_info"]["cached_tokens"] == 0 and _answer(got) == want

        assert _post(base, "/sleep", params={"level": 2}).status_code == 200
        assert _post(base, "/wake_up").status_code == 200
        assert not _sleeping(base)
        _refused_asleep(base, "/update_weights_from_disk")
        r = _post(base, "/update_weights_from_disk", json={"model_path": str(path)})
        assert r.status_code == 200, r.text
        assert _answer(_generate(base)) == want

        for call, kw in (
            ("/sleep", {"params": {"level": 3}}),
            ("/sleep", {"params": {"level": "deep"}}),
            ("/wake_up", {"params": {"tags": ["gpu"]}}),
            ("/release_memory_occupation", {"json": {"tags": ["kv"]}}),
            ("/resume_memory_occupation", {"json": {"tags": "weights"}}),
        ):
            r = _post(base, call, **kw)
            assert r.status_code == 400, (call, r.text)
        assert not _sleeping(base)

        def idle(e) -> bool:
            e.check_integrity()
            return e.has_unfinished()

        assert not _on_engine(async_engine, idle)


def test_server_takes_no_step_after_a_release_between_two_steps(models):
    """A pause and a release the engine thread applies between two steps (here one call;
    two commands queued during a step are applied alike): the next thing it does is not a
    step over the memory just released (nor over a pause just asked for); the retracted
    request waits it out and ends as an unpaused run."""
    path = models["glm-tiny"]
    with serving(EngineConfig(model=str(path), **ENGINE_ARGS)) as (base, async_engine):
        want = _answer(_generate(base))
        engine, asleep_steps, frozen = async_engine.engine, [], threading.Event()
        step = engine.step

        def gated() -> list:
            """No step while asleep (recorded: it would read freed storage), nor while the
            request in flight has 2 tokens and `frozen` (`_frozen_at`'s, checked after)."""
            if engine.asleep:
                asleep_steps.append(sorted(engine.released))
                return []
            live = [r for r in engine.requests.values() if not r.finished]
            if frozen.is_set() and live and all(len(r.output_ids) >= 2 for r in live):
                time.sleep(0.002)
                return []
            return step()

        def pause_and_release(e) -> None:
            e.retract_all()
            e.paused = True
            e.release_memory_occupation()

        frozen.set()
        engine.step = gated
        try:
            stream = _Stream(base, **ASK)
            stream.wait_tokens(2)
            _on_engine(async_engine, pause_and_release)
            frozen.clear()
            assert _post(base, "/resume_memory_occupation").status_code == 200
            assert _post(base, "/continue_generation").status_code == 200
            assert stream.last()["output_ids"] == want[0]
        finally:
            del engine.step
        assert asleep_steps == []


# --- every rank ------------------------------------------------------------------------------


def test_tp2_every_rank_sleeps_and_wakes(models):
    """`--tp 2 --ep 2`: level 1 wakes every rank bit-identical; level 2 drops every rank's
    weights (rank 1's experts read back as zeros), and rank 0 refuses to generate while
    rank 1 still lacks an expert of its own, which rank 0 never holds."""
    path = models["glm-tiny"]
    tensors = load_file(path / "model.safetensors")
    rank1 = "model.layers.1.mlp.experts.7.down_proj.weight"  # (experts 4-7: rank 1's)
    with LLM(str(path), **ENGINE_ARGS, tp=2, ep=2) as llm:
        want = _outputs(llm)
        llm.sleep(level=1)
        with pytest.raises(EngineAsleep):
            llm.generate(PROMPTS, use_tqdm=False)
        llm.wake_up()
        assert _outputs(llm) == want
        llm.sleep(level=2)
        llm.wake_up()
        assert not torch.tensor(llm.get_weights_by_name(rank1)).any()
        llm.update_weights_from_tensor([(n, t) for n, t in tensors.items() if n != rank1])
        with pytest.raises(EngineAsleep, match="another rank's weights"):
            llm.generate(PROMPTS, use_tqdm=False)
        llm.update_weights_from_tensor([(rank1, tensors[rank1])])
        assert torch.equal(torch.tensor(llm.get_weights_by_name(rank1)), tensors[rank1])
        assert _outputs(llm) == want


def test_router_relays_sleep_mode(models):
    """`dsakv router` relays sleep mode to every server, its query too, and answers
    /is_sleeping (true while every server sleeps); a prefill or decode
    server keeps its KV cache (its peer holds the pool's addresses): a release of it is a
    400 there, and the router undoes it on the servers that took it."""
    conf = EngineConfig(model=str(models["glm-tiny"]), **ENGINE_ARGS)
    with ExitStack() as stack:
        urls = [
            stack.enter_context(serving_disagg(conf, mode))[0] for mode in ("prefill", "decode")
        ]
        router = stack.enter_context(routing(urls[:1], urls[1:]))
        r = _post(router, "/release_memory_occupation", json={"tags": ["weights"]})
        assert r.status_code == 200, r.text
        assert all(_sleeping(url) for url in urls) and _sleeping(router)
        assert _post(router, "/generate", json=ASK).status_code == 503
        assert _post(router, "/wake_up", params={"tags": ["weights"]}).status_code == 200
        assert not any(_sleeping(url) for url in urls) and not _sleeping(router)
        for call, kw in (("/sleep", {}), ("/release_memory_occupation", {"json": {}})):
            r = _post(router, call, **kw)
            assert r.status_code == 400 and "KV cache" in r.json()["error"]["message"], r.text
            assert not any(_sleeping(url) for url in urls)
        r = _post(router, "/generate", json=ASK)
        assert r.status_code == 200, r.text
