"""SGLang's /start_profile and /stop_profile (vLLM's too: POST, no body), and `LLM`'s: every
rank's engine runs torch.profiler and writes its own Chrome trace (`{id}-TP-{rank}
.trace.json.gz`), holding the model forward's ops; `num_steps` stops it by itself; a
second start, and a stop with none running, are refused."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import httpx
import pytest

from dsakv.engine import LLM, EngineConfig, SamplingParams
from dsakv.errors import DsakvError

from .serving import TIMEOUT, serving
from .test_update_weights import ENGINE_ARGS, _model

PROMPT = list(range(5, 25))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return _model(tmp_path_factory.mktemp("profile"), "glm-tiny", 0)


def _ops(trace: Path) -> set[str]:
    """The aten ops a trace recorded (it must be a gzipped Chrome trace)."""
    with gzip.open(trace) as f:
        events = json.load(f)["traceEvents"]
    return {e["name"] for e in events if e.get("name", "").startswith("aten::")}


def _generate(llm: LLM, tokens: int) -> None:
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate([PROMPT], params, use_tqdm=False)


@pytest.mark.parametrize("layout", [{}, dict(tp=2)], ids=["tp1", "tp2"])
def test_every_rank_writes_a_trace_of_the_forward(model, layout, tmp_path):
    ranks = layout.get("tp", 1)
    with LLM(str(model), **ENGINE_ARGS, **layout) as llm:
        with pytest.raises(DsakvError, match="^no profile is running"):
            llm.stop_profile()
        llm.start_profile(output_dir=str(tmp_path), with_stack=False)
        with pytest.raises(DsakvError, match="^a profile is running already"):
            llm.start_profile(output_dir=str(tmp_path))
        _generate(llm, 4)
        paths = [Path(p) for p in llm.stop_profile()]
        assert [p.parent for p in paths] == [tmp_path] * ranks
        assert [p.name.split("-", 1)[1] for p in paths] == [
            f"TP-{r}.trace.json.gz" for r in range(ranks)
        ]
        assert len({p.name.split("-")[0] for p in paths}) == 1  # (one profile id)
        for p in paths:
            assert "aten::embedding" in _ops(p), p  # (the forward's token embedding)
        with pytest.raises(DsakvError, match="^no profile is running"):
            llm.stop_profile()
        # num_steps: it stops by itself (on every rank), and a new one can start
        llm.start_profile(output_dir=str(tmp_path / "n"), num_steps=2, with_stack=False)
        _generate(llm, 6)
        assert llm.engine.profiler is None
        assert len(list((tmp_path / "n").glob("*.trace.json.gz"))) == ranks
        with pytest.raises(DsakvError, match="^no profile is running"):
            llm.stop_profile()
        for bad, why in [
            (dict(activities=["MEM"]), "activities must be some of CPU, GPU"),
            (dict(activities=["GPU"]), "runs on no GPU"),
            (dict(num_steps=0), "num_steps must be a positive integer"),
        ]:
            with pytest.raises(DsakvError, match=why):
                llm.start_profile(output_dir=str(tmp_path / "bad"), **bad)
        with pytest.raises(DsakvError):  # (a directory no trace can be written to)
            llm.start_profile(output_dir="/proc")
        assert llm.engine.profiler is None  # (nothing left running on any rank)
        llm.start_profile(output_dir=str(tmp_path / "again"), activities="CPU", with_stack=False)
        assert len(llm.stop_profile()) == ranks


def test_http_routes(model, tmp_path, monkeypatch):
    """SGLang's body, GET or POST; vLLM's bare POST writes to $DSAKV_TORCH_PROFILER_DIR."""
    monkeypatch.setenv("DSAKV_TORCH_PROFILER_DIR", str(tmp_path / "env"))
    with serving(EngineConfig(model=str(model), **ENGINE_ARGS)) as (base, _):

        def post(path: str, body: dict | None = None, method: str = "POST") -> httpx.Response:
            return httpx.request(method, f"{base}{path}", json=body, timeout=TIMEOUT)

        assert post("/stop_profile").status_code == 400
        body = {"output_dir": str(tmp_path / "sglang"), "activities": ["CPU"], "with_stack": False}
        r = post("/start_profile", body)
        assert r.status_code == 200 and r.text == "Start profiling.\n"
        r = post("/start_profile", body, "GET")
        assert r.status_code == 400
        assert r.json()["error"]["message"].startswith("a profile is running already")
        gen = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        assert post("/generate", gen).status_code == 200
        r = post("/stop_profile", None, "GET")
        assert r.status_code == 200, r.text
        (trace,) = (tmp_path / "sglang").glob("*-TP-0.trace.json.gz")
        assert "aten::embedding" in _ops(trace)
        r = post("/stop_profile")
        assert r.status_code == 400 and "no profile is running" in r.json()["error"]["message"]
        assert post("/start_profile", {"start_step": 3}).status_code == 400
        assert post("/start_profile").status_code == 200  # (vLLM's)
        assert post("/stop_profile").status_code == 200
        assert len(list((tmp_path / "env").glob("*-TP-0.trace.json.gz"))) == 1
        # A trace that cannot be written at the stop (its directory gone since the start) is
        # the server's 500, not the client's 400; the next profile starts and saves.
        gone = tmp_path / "gone"
        assert post("/start_profile", {**body, "output_dir": str(gone)}).status_code == 200
        gone.rmdir()
        r = post("/stop_profile")
        assert r.status_code == 500, r.text
        assert "the profile was not saved" in r.json()["error"]["message"]
        assert post("/start_profile", body).status_code == 200
        assert post("/stop_profile").status_code == 200
