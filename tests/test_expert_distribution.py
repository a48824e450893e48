"""SGLang's expert distribution recorder (`--expert-distribution-recorder-mode`, the
/start_, /stop_ and /dump_expert_distribution_record routes, `LLM`'s methods of those
names): a "stat" dump's `logical_count` sums, per layer and expert, the tokens transformers'
gates route there over exactly the recording window (a dense layer's row 0; the MTP layer
not counted), under DP attention as one engine counts; a "per_token" dump holds each
token's experts; SGLang's file names and keys; recording changes no token or logprob;
refusals on a server without the mode or a model without MoE layers."""

from __future__ import annotations

import dataclasses
import glob
import os

import httpx
import numpy as np
import pytest
import torch

from dsakv import LLM
from dsakv.cli import build_parser, engine_config_from_args
from dsakv.config.presets import TINY_PRESETS
from dsakv.engine import Engine, EngineConfig
from dsakv.errors import DsakvError
from dsakv.models.tiny import write_tiny_model

from .conftest import hf_reference
from .serving import TIMEOUT, serving
from .test_routed_experts import EXACT, GREEDY, LAYERS, TOP_K

EXPERTS = TINY_PRESETS["glm-tiny"]["n_routed_experts"]
STAT = dict(expert_distribution_recorder_mode="stat")
ROUTES = ("start", "stop", "dump")


@pytest.fixture
def out_dir(tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR", str(tmp_path / "eplb"))
    return str(tmp_path / "eplb")


def _prompts(seed: int) -> list[list[int]]:
    """Prompts no other `seed`'s share a page of (the prefix cache computes each once)."""
    return [[(7 * i + 3 * j + 11 * seed) % 250 + 1 for j in range(9 + 13 * i)] for i in range(3)]


def _counts(hf, prompts: list[list[int]], outs) -> np.ndarray:
    """`[layers, experts]`: the tokens transformers' gates route to each expert over every
    position an engine computes (prompt and output but the last token)."""
    total = np.zeros((LAYERS, EXPERTS), dtype=np.int64)
    for prompt, out in zip(prompts, outs):
        routed, _ = hf_reference(hf, prompt + out.outputs[0].token_ids[:-1])
        for layer in range(1, LAYERS):
            total[layer] += np.bincount(routed[:, layer].ravel(), minlength=EXPERTS)
    return total


def _stat(paths: list[str]) -> dict:
    (path,) = paths
    assert os.path.basename(path).startswith("expert_distribution_recorder_")
    assert path.endswith(".pt") and os.path.isfile(path)
    return torch.load(path)


def test_stat_counts_the_window_as_transformers_routes_and_changes_nothing(
    glm_tiny, glm_tiny_hf, out_dir
):
    """Steps before the start and after the stop are not counted; within the window every
    computed token is (chunked prefill beside decode steps), as return_routed_experts
    reports them too; SGLang's dump keys, its 1000-step buffer, a dump starting
    the counts over; the tokens and logprobs are a run's without recording, bit for bit."""
    llm = LLM(glm_tiny, **EXACT, num_pages=64, chunked_prefill_size=24, **STAT,
              enable_return_routed_experts=True)  # fmt: skip
    window = _prompts(1)
    llm.generate(_prompts(0), GREEDY, use_tqdm=False)  # (before the start)
    plain = llm.generate(window, GREEDY, use_tqdm=False)
    llm.reset_prefix_cache()
    llm.start_expert_distribution_record()
    asked = dataclasses.replace(GREEDY, return_routed_experts=True)
    outs = llm.generate(window, asked, use_tqdm=False)
    llm.stop_expert_distribution_record()
    llm.generate(_prompts(2), GREEDY, use_tqdm=False)  # (after the stop)
    dump = _stat(llm.dump_expert_distribution_record())
    assert set(dump) == {"rank", "logical_count", "average_utilization_rate_over_window"}
    assert dump["rank"] == 0
    count = dump["logical_count"]
    assert count.dtype == torch.int32 and count.shape == (1000, LAYERS, EXPERTS)
    want = _counts(glm_tiny_hf, window, outs)
    np.testing.assert_array_equal(count.sum(0).numpy(), want)
    assert want[1:].sum() == sum(len(p) + 5 for p in window) * TOP_K * (LAYERS - 1)
    reported = np.zeros_like(want)  # (return_routed_experts' rows, another consumer's)
    for o in outs:
        rows = o.outputs[0].routed_experts
        for layer in range(1, LAYERS):
            reported[layer] += np.bincount(rows[:, layer].ravel(), minlength=EXPERTS)
    np.testing.assert_array_equal(count.sum(0).numpy(), reported)
    for a, b in zip(outs, plain):
        (ca,), (cb,) = a.outputs, b.outputs
        assert ca.token_ids == cb.token_ids
        assert [d[t].logprob for t, d in zip(ca.token_ids, ca.logprobs)] == [
            d[t].logprob for t, d in zip(cb.token_ids, cb.logprobs)
        ]
    again = _stat(llm.dump_expert_distribution_record())  # (the dump started them over)
    assert not again["logical_count"].any()


def test_per_token_records_each_tokens_experts(glm_tiny, glm_tiny_hf, out_dir):
    """ "per_token": one file per rank, `..._{rank}.pt`, whose records (one per step) hold
    each computed token's id, position and experts (a dense layer's -1) as transformers
    routes them, and SGLang's `last_physical_to_logical_map` (no redundant experts here);
    `forward_pass_id` is the engine's count of steps before the record's, rising across
    windows (SGLang's EPLB reader refuses an id seen twice in a directory; it restarted
    at 0 in each window)."""
    llm = LLM(glm_tiny, **EXACT, num_pages=64, expert_distribution_recorder_mode="per_token")
    prompt = _prompts(3)[1]
    llm.start_expert_distribution_record()
    (out,) = llm.generate([prompt], GREEDY, use_tqdm=False)
    (first,) = llm.dump_expert_distribution_record()
    llm.stop_expert_distribution_record()
    llm.generate(_prompts(5)[:1], GREEDY, use_tqdm=False)  # (steps between the windows)
    llm.start_expert_distribution_record()
    before = llm.engine.stats.steps
    llm.generate(_prompts(6)[:1], GREEDY, use_tqdm=False)
    (second,) = llm.dump_expert_distribution_record()
    ids = [r["forward_pass_id"] for r in torch.load(second)["records"]]
    assert ids == list(range(before, llm.engine.stats.steps))
    path = first
    assert path.endswith("_0.pt") and os.path.dirname(path) == out_dir
    dump = torch.load(path)
    assert set(dump) == {"records", "last_physical_to_logical_map"}
    assert dump["last_physical_to_logical_map"].tolist() == [list(range(EXPERTS))] * LAYERS
    records = dump["records"]
    ids = prompt + out.outputs[0].token_ids[:-1]
    assert [r["forward_pass_id"] for r in records] == list(range(len(records)))
    assert max(r["forward_pass_id"] for r in records) < before
    assert [t for r in records for t in r["input_ids"]] == ids
    assert [p for r in records for p in r["positions"]] == list(range(len(ids)))
    topk = torch.cat([r["topk_ids_of_layer"] for r in records], 1)  # [layers, tokens, k]
    assert topk.shape == (LAYERS, len(ids), TOP_K) and (topk[0] == -1).all()
    routed, _ = hf_reference(glm_tiny_hf, ids)
    np.testing.assert_array_equal(np.sort(topk[1:].numpy(), -1), routed[:, 1:].transpose(1, 0, 2))
    per_step = sum(r["global_physical_count"] for r in records)
    np.testing.assert_array_equal(per_step.numpy(), _counts(glm_tiny_hf, [prompt], [out]))


def _blocked(tmp_path, monkeypatch) -> None:
    """Dumps go where a file stands in the way of the directory: none can be written."""
    (tmp_path / "a_file").touch()
    monkeypatch.setenv("SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR", str(tmp_path / "a_file" / "d"))


def _tokens(dump: dict) -> int:
    """The tokens a stat dump counted (each routed to TOP_K experts in every MoE layer)."""
    return int(dump["logical_count"].sum()) // (TOP_K * (LAYERS - 1))


def test_a_dump_that_fails_keeps_the_counts_and_a_restart_warns(
    glm_tiny, tmp_path, monkeypatch, caplog
):
    """A dump no rank could write is an OSError (the server's fault, not the request's) and
    throws no count away, of an open window or a stopped one: the next dump that lands holds
    them (they were started over). A start while recording starts over, saying so (SGLang's
    "forget to dump?" warning)."""
    llm = LLM(glm_tiny, **EXACT, num_pages=32, **STAT)
    prompt = _prompts(7)[0]
    per_run = len(prompt) + GREEDY.max_tokens - 1
    for stop in (False, True):
        llm.start_expert_distribution_record()
        llm.generate([prompt], GREEDY, use_tqdm=False)
        llm.reset_prefix_cache()
        if stop:
            llm.stop_expert_distribution_record()
        with monkeypatch.context() as env:
            _blocked(tmp_path, env)
            with pytest.raises(OSError, match="not saved .*its counts are kept"):
                llm.dump_expert_distribution_record()
        llm.generate([prompt], GREEDY, use_tqdm=False)  # (counted while the window is open)
        llm.reset_prefix_cache()
        monkeypatch.setenv("SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR", str(tmp_path / f"{stop}"))
        assert _tokens(_stat(llm.dump_expert_distribution_record())) == per_run * (2 - stop)
        llm.stop_expert_distribution_record()
    llm.start_expert_distribution_record()
    caplog.clear()
    with caplog.at_level("WARNING", logger="dsakv.engine.expert_distribution"):
        llm.start_expert_distribution_record()
    assert "already recording, starting over (forget to dump?" in caplog.text


def test_dp_attention_counts_as_one_engine(glm_tiny, glm_tiny_hf, out_dir):
    """Under DP attention each rank routes its own requests' tokens: the dump sums every
    rank's, the counts one engine makes of the same requests."""
    prompts = _prompts(4)
    with LLM(glm_tiny, **EXACT, num_pages=64, tp=2, dp_attention=True, **STAT) as llm:
        llm.start_expert_distribution_record()
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert all(c["finished_requests"] > 0 for c in llm.engine.rank_counters())
        dump = _stat(llm.dump_expert_distribution_record())
    np.testing.assert_array_equal(
        dump["logical_count"].sum(0).numpy(), _counts(glm_tiny_hf, prompts, outs)
    )


def test_pipeline_stages_count_as_one_engine(glm_tiny, glm_tiny_hf, out_dir):
    """Under --pp-size each stage routes its own layers: the dump holds every stage's
    layers, the counts one engine makes of the same requests."""
    prompts = _prompts(5)
    with LLM(glm_tiny, **EXACT, num_pages=64, pp=2, pp_layer_partition="3,5", **STAT) as llm:
        llm.start_expert_distribution_record()
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        dump = _stat(llm.dump_expert_distribution_record())
    np.testing.assert_array_equal(
        dump["logical_count"].sum(0).numpy(), _counts(glm_tiny_hf, prompts, outs)
    )


def test_refused_without_the_mode_or_moe(glm_tiny, tmp_path, capsys):
    """Without the mode, each call is refused naming the flag; a model without MoE layers
    refuses the mode; a mode SGLang has that this engine does not is refused; the flags
    reach the engine's config, on serve; `generate`, which has no route to open a window
    with, does not take them (it took them and recorded nothing)."""
    llm = LLM(glm_tiny, **EXACT, num_pages=16)
    for name in ROUTES:
        with pytest.raises(DsakvError, match="--expert-distribution-recorder-mode"):
            getattr(llm, f"{name}_expert_distribution_record")()
    all_dense = {**TINY_PRESETS["glm-tiny"], "first_k_dense_replace": LAYERS}
    dense = write_tiny_model(tmp_path / "dense", preset=all_dense, mtp="none")
    with pytest.raises(DsakvError, match="needs an MoE model"):
        Engine(EngineConfig(str(dense), **EXACT, num_pages=8, **STAT))
    with pytest.raises(DsakvError, match="needs an MoE model"):
        LLM(str(dense), **EXACT, num_pages=8).start_expert_distribution_record()
    with pytest.raises(DsakvError, match="must be stat or per_token"):
        EngineConfig(glm_tiny, expert_distribution_recorder_mode="stat_approx")
    with pytest.raises(DsakvError, match="nonzero integer"):
        EngineConfig(glm_tiny, **STAT, expert_distribution_recorder_buffer_size=0)
    flags = ["--expert-distribution-recorder-mode", "per_token",
             "--expert-distribution-recorder-buffer-size", "-1"]  # fmt: skip
    config = engine_config_from_args(build_parser().parse_args(["serve", glm_tiny, *flags]))
    assert config.expert_distribution_recorder_mode == "per_token"
    assert config.expert_distribution_recorder_buffer_size == -1
    capsys.readouterr()  # (what the engines above logged)
    for flag, value in zip(flags[::2], flags[1::2]):
        with pytest.raises(SystemExit) as exc:
            build_parser().parse_args(["generate", glm_tiny, "--prompt", "x", flag, value])
        assert exc.value.code == 2
        (err,) = capsys.readouterr().err.strip().splitlines()
        assert err.startswith("error: unrecognized arguments: " + flag), err


@pytest.fixture(scope="module")
def served(glm_tiny):
    with serving(EngineConfig(model=glm_tiny, **EXACT, num_pages=64, **STAT)) as served:
        yield served


def test_routes_record_on_get_and_post(served, out_dir):
    """SGLang's routes, on GET and POST: a /generate between start and stop is counted
    (its prompt and output but the last token), in SGLang's file under the directory its
    variable names."""
    base, _ = served
    assert httpx.get(f"{base}/start_expert_distribution_record", timeout=TIMEOUT).status_code == 200
    body = {"input_ids": list(range(1, 12)), "sampling_params": {"max_new_tokens": 4,
            "temperature": 0, "ignore_eos": True}}  # fmt: skip
    assert httpx.post(f"{base}/generate", json=body, timeout=TIMEOUT).status_code == 200
    for route, call in (("stop", httpx.post), ("dump", httpx.get)):
        r = call(f"{base}/{route}_expert_distribution_record", timeout=TIMEOUT)
        assert r.status_code == 200, r.text
    (path,) = glob.glob(os.path.join(out_dir, "expert_distribution_recorder_*.pt"))
    count = torch.load(path)["logical_count"].sum(0)
    assert not count[0].any()
    assert (count[1:].sum(1) == (11 + 3) * TOP_K).all()


def test_a_dump_that_fails_is_a_server_error_and_keeps_the_counts(served, tmp_path, monkeypatch):
    """A dump the server cannot write is its 500 `server_error` (it was the client's 400),
    and the counts wait for the next dump (they were thrown away)."""
    base, _ = served
    assert httpx.post(f"{base}/start_expert_distribution_record", timeout=TIMEOUT).is_success
    body = {"input_ids": list(range(3, 13)), "sampling_params": {"max_new_tokens": 3,
            "temperature": 0, "ignore_eos": True}}  # fmt: skip
    assert httpx.post(f"{base}/generate", json=body, timeout=TIMEOUT).status_code == 200
    assert httpx.post(f"{base}/stop_expert_distribution_record", timeout=TIMEOUT).is_success
    _blocked(tmp_path, monkeypatch)
    r = httpx.post(f"{base}/dump_expert_distribution_record", timeout=TIMEOUT)
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert error["type"] == "server_error" and "not saved" in error["message"], error
    monkeypatch.setenv("SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR", str(tmp_path / "eplb"))
    assert httpx.post(f"{base}/dump_expert_distribution_record", timeout=TIMEOUT).is_success
    (path,) = glob.glob(str(tmp_path / "eplb" / "*.pt"))
    assert _tokens(torch.load(path)) == 10 + 2


def test_routes_refused_on_a_server_without_the_mode(glm_tiny):
    """A 400 in the routes' JSON error shape, naming the flag, on GET and POST."""
    with serving(EngineConfig(model=glm_tiny, **EXACT, num_pages=16)) as (base, _):
        for route in ROUTES:
            for call in (httpx.get, httpx.post):
                r = call(f"{base}/{route}_expert_distribution_record", timeout=TIMEOUT)
                assert r.status_code == 400
                assert "--expert-distribution-recorder-mode" in r.json()["error"]["message"]


def test_a_dump_never_overwrites_another(tmp_path):
    """Servers sharing a directory may dump within one tick of `time.time()` (a router
    relays the dump to all of them at once): the second file gets a suffix."""
    from dsakv.engine.expert_distribution import _save_new

    paths = [_save_new({"n": n}, str(tmp_path), "expert_distribution_recorder_1.5") for n in (0, 1)]
    assert paths[0] != paths[1]
    assert [torch.load(p)["n"] for p in paths] == [0, 1]
