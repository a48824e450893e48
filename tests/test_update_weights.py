"""SGLang's /update_weights_from_disk (`Engine.update_weights`), end to end on tiny models:
a server updated from one checkpoint to another answers as a fresh server on the second
(every weight replaced, the MTP layer's too, the prefix cache not reused), in each form the
loader keeps weights in; a checkpoint that does not fit changes nothing; an update waits for
the generation in flight (or aborts it) and holds back new ones until it is done. Over
several ranks (`--tp 2`, `--dp-attention`) every rank loads its part, or none does, or all
roll back."""

from __future__ import annotations

import asyncio
import copy
import threading
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
from .test_completions_api import ENGINE_ARGS as COMPLETIONS_ARGS

# index_topk over every context: chunked prefill and cached prefixes change no number.
ENGINE_ARGS = {**COMPLETIONS_ARGS, "num_pages": 64}
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
    fp32), an unknown load_format: a 400 with success false; the server answers as before,
    its prefix cache kept (a refused checkpoint dropped it on one rank)."""
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
        assert after["meta_info"]["cached_tokens"] > 0
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


def test_an_update_takes_the_checkpoints_stop_tokens_and_defaults(models, tmp_path):
    """generation_config.json's eos ids and sampling defaults come with the weights: the
    updated engine stops and samples as a fresh one on that checkpoint; a checkpoint whose
    defaults are bad is refused and changes nothing."""
    import json
    import shutil

    from dsakv.engine import SamplingParams

    new = models["glm-tiny", "fp32", 1]
    sp = SamplingParams(max_tokens=8, temperature=0)
    with LLM(str(new), **ENGINE_ARGS) as fresh:
        stop = fresh.generate([PROMPT], sp)[0].outputs[0].token_ids[2]

    def variant(name: str, **generation) -> str:
        path = tmp_path / name
        shutil.copytree(new, path)
        config = json.loads((path / "generation_config.json").read_text())
        (path / "generation_config.json").write_text(json.dumps({**config, **generation}))
        return str(path)

    eos = json.loads((new / "generation_config.json").read_text())["eos_token_id"]
    eos = [eos] if isinstance(eos, int) else eos
    stops = variant("stops", eos_token_id=[*eos, stop], temperature=0.0, max_new_tokens=5)
    bad = variant("bad", temperature=-1.0)

    def answers(llm: LLM) -> tuple:
        out = llm.generate([PROMPT], sp)[0].outputs[0]
        plain = llm.generate([PROMPT])[0].outputs[0]  # (the checkpoint's defaults)
        return out.token_ids, out.finish_reason, plain.token_ids, llm.engine.eos_token_ids

    with LLM(stops, **ENGINE_ARGS) as fresh:
        want = answers(fresh), fresh.get_default_sampling_params()
    with LLM(str(models["glm-tiny", "fp32", 0]), **ENGINE_ARGS) as llm:
        before = llm.get_default_sampling_params()
        with pytest.raises(DsakvError, match="temperature"):
            llm.update_weights(bad)
        assert llm.get_default_sampling_params() == before
        llm.update_weights(stops)
        assert (answers(llm), llm.get_default_sampling_params()) == want
    assert want[0][1] == "stop" and len(want[0][2]) <= 5


@pytest.mark.parametrize("identity", ["own", "blind"])
def test_l3_pages_of_the_old_weights_are_not_read_after(models, tmp_path, monkeypatch, identity):
    """The L3 storage tier: pages stored under the old weights are not the new weights' (an
    update moves L3 to a namespace of its own), and its pages are stored anew; also where
    the checkpoint's identity does not see the change ("blind": it samples a large shard,
    and a fine-tune step may change only tensors the samples miss; the stale pages were
    read)."""
    import dsakv.engine.engine as engine_module
    from dsakv.engine import SamplingParams

    if identity == "blind":
        monkeypatch.setattr(engine_module, "model_identity", lambda path: "same-samples")

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


def test_an_update_waits_for_the_request_in_flight(models, monkeypatch):
    """A streaming request started on the old weights ends on them, whole; the update runs
    after it, and a request sent meanwhile waits for the update and runs on the new weights."""
    from dsakv.server.submit import InFlight

    old, new = models["glm-tiny", "fp32", 0], models["glm-tiny", "fp32", 1]
    waits, drained = threading.Event(), InFlight.drained

    async def drained_and_tell(self) -> None:  # (the update waits: new calls wait for it)
        waits.set()
        await drained(self)

    monkeypatch.setattr(InFlight, "drained", drained_and_tell)
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
                assert waits.wait(TIMEOUT)
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


# --- every rank (`--tp 2`, `--dp-attention`; gloo on CPU) ---------------------------------

PROMPTS = [PROMPT, list(range(60, 100))]  # two pages each (one per rank under DP attention)


def _outputs(llm: LLM) -> list[tuple]:
    from dsakv.engine import SamplingParams

    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)
    return [(c.token_ids, c.logprobs) for o in llm.generate(PROMPTS, sp) for c in o.outputs]


def _split(src, dst, ranks: int = 2):
    """`src`'s checkpoint in 1 + `ranks` files: the routed experts of expert-parallel rank r
    in file r + 2 (read by that rank alone under `--ep ranks`), the rest in file 1."""
    import json
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = load_file(src / "model.safetensors")
    experts = TINY_PRESETS["glm-tiny"]["n_routed_experts"]
    names = [f"model-{i:05d}-of-{ranks + 1:05d}.safetensors" for i in range(1, ranks + 2)]
    parts: list[dict[str, torch.Tensor]] = [{} for _ in names]
    weight_map = {}
    for name in sorted(tensors):
        m = re.search(r"\.experts\.(\d+)\.", name)
        part = 0 if m is None else 1 + int(m.group(1)) * ranks // experts
        parts[part][name] = tensors[name]
        weight_map[name] = names[part]
    for file, part in zip(names, parts):
        save_file(part, dst / file, metadata={"format": "pt"})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return dst


@pytest.fixture(scope="module")
def split(models, tmp_path_factory):
    """Seed 1's glm-tiny with each expert-parallel rank's experts in a file of its own."""
    return _split(models["glm-tiny", "fp32", 1], tmp_path_factory.mktemp("split") / "glm")


def test_tp2_update_answers_as_a_fresh_tp2_engine(models, split, tmp_path, monkeypatch):
    """`--tp 2 --ep 2`: every rank loads its own slices, and the engine then answers as a
    fresh one on the new checkpoint. A checkpoint that one rank alone refuses (its experts
    of another shape) changes nothing on any rank; a read that fails part way on one rank
    (its experts' file gone after the check: the trainer replaced the checkpoint) leaves
    every rank on the old weights, the rank that loaded all of it too."""
    from safetensors.torch import load_file, save_file

    old, new = models["glm-tiny", "fp32", 0], models["glm-tiny", "fp32", 1]
    tp = dict(tp=2, ep=2)
    with LLM(str(new), **ENGINE_ARGS, **tp) as fresh:
        want = _outputs(fresh)
    odd = _split(new, tmp_path / "odd")  # rank 1's expert 5 one column wider
    rank1 = odd / "model-00003-of-00003.safetensors"
    tensors = load_file(rank1)
    name = next(n for n in tensors if ".experts.5.gate_proj." in n)
    tensors[name] = torch.zeros(tensors[name].shape[0], tensors[name].shape[1] + 1)
    save_file(tensors, rank1, metadata={"format": "pt"})
    with LLM(str(old), **ENGINE_ARGS, **tp) as llm:
        before, cached = _outputs(llm), _outputs(llm)  # (over several ranks a cached
        assert before != want  # prefix changes the last bits: the two are compared apart)
        with pytest.raises(DsakvError, match="another architecture"):
            llm.update_weights(models["deepseek-tiny", "fp32", 1])
        with pytest.raises(DsakvError, match=r"^rank 1: checkpoint tensor .*experts\.5\.gate"):
            llm.update_weights(odd)
        assert _outputs(llm) == cached  # (a refused checkpoint keeps the cache too)

        from dsakv.models import loader

        check = loader.check_update
        rank0 = split / "model-00002-of-00003.safetensors"  # experts 0-3: rank 0's alone

        def then_gone(*args, **kw):
            checked = check(*args, **kw)
            rank0.rename(rank0.with_suffix(".gone"))
            return checked

        with monkeypatch.context() as m:
            m.setattr(loader, "check_update", then_gone)
            with pytest.raises(DsakvError) as e:
                llm.update_weights(split)
        assert f"rank 0: cannot read checkpoint file {rank0}" in str(e.value)
        assert str(e.value).endswith(f"; every rank serves {old} again")
        assert _outputs(llm) == before  # (the cache was dropped before the copy)
        rank0.with_suffix(".gone").rename(rank0)
        llm.update_weights(split)
        assert llm.engine.weights_path == str(split)
        assert _outputs(llm) == want


def test_dp_attention_update_drops_every_ranks_cache(models):
    """`--dp-attention`: each rank loads the checkpoint and drops its own prefix cache (its
    pages were computed by the old weights): the same prompts, cached on both ranks
    before, then answer as a fresh engine's on the new checkpoint."""
    old, new = models["glm-tiny", "fp32", 0], models["glm-tiny", "fp32", 1]
    dp = dict(tp=2, dp_attention=True)
    with LLM(str(new), **ENGINE_ARGS, **dp) as fresh:
        want = _outputs(fresh)
    with LLM(str(old), **ENGINE_ARGS, **dp) as llm:
        before, cached = _outputs(llm), _outputs(llm)
        assert before != want
        hits = [r.counters["prefix_hit_tokens"] for r in llm.engine._reports]
        assert hits == [32, 32]  # (each rank ran one prompt, and reused its two pages)
        with pytest.raises(DsakvError, match="another architecture"):
            llm.update_weights(models["deepseek-tiny", "fp32", 1])
        assert _outputs(llm) == cached
        hits = [r.counters["prefix_hit_tokens"] for r in llm.engine._reports]
        llm.update_weights(new)
        assert _outputs(llm) == want
        hits_after = [r.counters["prefix_hit_tokens"] for r in llm.engine._reports]
        assert hits_after == hits
