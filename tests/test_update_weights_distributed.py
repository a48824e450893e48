"""SGLang's /init_weights_update_group, /update_weights_from_distributed and
/destroy_weights_update_group, with a real trainer: another process that joins the group as
RL frameworks' trainers do (torch's rendezvous and group helper, gloo on a CPU) and
broadcasts a checkpoint's tensors. The served model then answers as a fresh one on that
checkpoint, token for token and logprob for logprob, whether it came in one update or in
buckets; an update that does not fit changes nothing; over `--tp 2` every rank receives
and copies its own slices."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from safetensors.torch import load_file

from dsakv.distributed.weight_sync import GroupUpdate, WeightGroup
from dsakv.engine import LLM, EngineConfig
from dsakv.errors import DsakvError
from dsakv.procs import free_port

from .serving import TIMEOUT, serving
from .test_update_weights import ENGINE_ARGS, _answer, _generate, _model, _outputs

# The trainer: rank 0 of the group, broadcasting each bucket's tensors in order: a name alone
# is the checkpoint's tensor, [name, shape] zeros of that shape, [name, shape, dtype] zeros of
# that dtype. Once the test has seen the engine take everything, it exits (as `os._exit`: gloo
# may abort a process that leaves its group while the engine is still in it).
TRAINER = """
import datetime, json, os, sys
import torch, torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from safetensors.torch import load_file

job = json.loads(sys.argv[1])
timeout = datetime.timedelta(seconds=60)
url = f"tcp://127.0.0.1:{job['port']}"
store, rank, world = next(c10d.rendezvous(url, 0, job["world"], timeout=timeout))
group, _ = c10d._new_process_group_helper(
    world, 0, [], "gloo", store, group_name="weight_update_group", timeout=timeout
)
c10d._world.pg_group_ranks[group] = {i: i for i in range(world)}
tensors = load_file(job["model"] + "/model.safetensors")
for bucket in job["buckets"]:
    for item in bucket:
        if isinstance(item, str):
            t = tensors[item]
        else:
            t = torch.zeros(item[1], dtype=getattr(torch, item[2] if len(item) > 2 else "float32"))
        dist.broadcast(t.contiguous(), src=0, group=group)
print("sent", flush=True)
sys.stdin.readline()
os._exit(0)
"""


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    return {seed: _model(root, "glm-tiny", seed) for seed in (0, 1)}


class Trainer:
    """The trainer process for one group: started, then joined by the engine."""

    def __init__(self, model, buckets, ranks: int = 1) -> None:
        self.port, self.ranks = free_port(), ranks
        self.tensors = load_file(model / "model.safetensors")
        self.buckets = buckets
        job = {"port": self.port, "world": 1 + ranks, "model": str(model), "buckets": buckets}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", TRAINER, json.dumps(job)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def group(self) -> dict:
        return {
            "master_address": "127.0.0.1",
            "master_port": self.port,
            "rank_offset": 1,
            "world_size": 1 + self.ranks,
            "backend": "gloo",
        }

    def bucket(self, i: int, **kw) -> dict:
        """Bucket `i`'s metadata, as the trainer tells the server before broadcasting it."""
        items = [
            (x, None, None) if isinstance(x, str) else (*x, "float32")[:3] for x in self.buckets[i]
        ]
        return {
            "names": [name for name, _, _ in items],
            "dtypes": [
                f"torch.{dtype}" if shape else str(self.tensors[name].dtype)
                for name, shape, dtype in items
            ],
            "shapes": [shape or list(self.tensors[name].shape) for name, shape, _ in items],
            **kw,
        }

    def done(self) -> None:
        out, err = self.proc.communicate("\n", timeout=TIMEOUT)
        assert self.proc.returncode == 0 and "sent" in out, err


def _post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base}{path}", json=body, timeout=TIMEOUT)


def test_trainer_weights_answer_as_a_fresh_server(models):
    old, new = models[0], models[1]
    with serving(EngineConfig(model=str(new), **ENGINE_ARGS)) as (base, _):
        want = _answer(_generate(base))
    names = sorted(load_file(new / "model.safetensors"))
    half = len(names) // 2
    trainer = Trainer(new, [names[:half], names[half:]])
    with serving(EngineConfig(model=str(old), **ENGINE_ARGS)) as (base, _):
        before = _answer(_generate(base))
        assert before != want
        r = _post(base, "/init_weights_update_group", trainer.group())
        assert r.status_code == 200 and r.json()["success"], r.text
        # Two buckets, as trainers send them: the cache kept after the first, dropped after
        # the last (the prompt was cached by the old weights)
        r = _post(base, "/update_weights_from_distributed", trainer.bucket(0, flush_cache=False))
        assert r.status_code == 200 and r.json()["success"], r.text
        bucket = trainer.bucket(1, weight_version="step-1")
        r = _post(base, "/update_weights_from_distributed", bucket)
        assert r.status_code == 200 and r.json()["success"], r.text
        trainer.done()
        out = _generate(base)
        assert _answer(out) == want
        assert out["meta_info"]["weight_version"] == "step-1"
        r = _post(base, "/destroy_weights_update_group", {})
        assert r.status_code == 200 and r.json()["success"], r.text
        r = _post(base, "/destroy_weights_update_group", {})
        assert r.status_code == 400 and "no weight update group" in r.json()["message"]


def test_an_update_that_does_not_fit_changes_nothing(models):
    """Received in full (the trainer's broadcast completes), then refused: a tensor the model
    does not have, or one of another shape; the served weights and cache stay as they were.
    Metadata that cannot be received is refused before the broadcast."""
    old, new = models[0], models[1]
    names = sorted(load_file(new / "model.safetensors"))
    nope = ["model.layers.0.self_attn.nope.weight", [4, 4]]
    embed = load_file(new / "model.safetensors")["model.embed_tokens.weight"]
    wide = ["model.embed_tokens.weight", [embed.shape[0], embed.shape[1] + 1]]
    trainer = Trainer(new, [[*names, nope], [wide]])
    with serving(EngineConfig(model=str(old), **ENGINE_ARGS)) as (base, _):
        before = _answer(_generate(base))
        r = _post(base, "/init_weights_update_group", trainer.group())
        assert r.json()["success"], r.text
        for i, words in ((0, "does not have: model.layers.0.self_attn.nope.weight"), (1, "shape")):
            r = _post(base, "/update_weights_from_distributed", trainer.bucket(i))
            assert r.status_code == 400 and not r.json()["success"]
            assert words in r.json()["message"], r.text
        trainer.done()
        assert _answer(_generate(base)) == before
        bad = trainer.bucket(1)
        for body, words in (
            ({**bad, "group_name": "other"}, "no weight update group 'other'"),
            ({**bad, "dtypes": ["float9"]}, "not a torch dtype"),
            ({**bad, "dtypes": []}, "differ in length"),
            ({**bad, "load_format": "bin"}, "load_format"),
        ):
            r = _post(base, "/update_weights_from_distributed", body)
            assert r.status_code == 400 and words in r.json()["message"], r.text
        r = _post(base, "/init_weights_update_group", {**trainer.group(), "backend": "nccl"})
        assert r.status_code == 400 and "nccl needs CUDA" in r.json()["message"]
        r = _post(base, "/init_weights_update_group", {**trainer.group(), "rank_offset": 0})
        assert r.status_code == 400 and "rank_offset" in r.json()["message"]
        assert _answer(_generate(base)) == before


@pytest.mark.parametrize(
    "layout", [dict(tp=2, ep=2), dict(tp=2, dp_attention=True)], ids=["tp2-ep2", "dp-attention"]
)
def test_every_rank_receives_its_slices(models, layout):
    """`--tp 2 --ep 2` and `--dp-attention`: both ranks join (world 3) and receive every
    tensor, each copying its own slices and experts (or all of it); the engine then answers
    as a fresh one on the checkpoint. A group joined twice is refused on both ranks."""
    old, new = models[0], models[1]
    tp = layout
    with LLM(str(new), **ENGINE_ARGS, **tp) as fresh:
        want = _outputs(fresh)
    tensors = load_file(new / "model.safetensors")
    names = sorted(tensors)
    trainer = Trainer(new, [names], ranks=2)
    with LLM(str(old), **ENGINE_ARGS, **tp) as llm:
        before = _outputs(llm)
        assert before != want
        engine = llm.engine
        llm.init_weights_update_group(**trainer.group())  # (SGLang's offline Engine API)
        meta = trainer.bucket(0)
        llm.update_weights_from_distributed(names, meta["dtypes"], meta["shapes"])
        trainer.done()
        assert _outputs(llm) == want
        with pytest.raises(DsakvError, match="^weight update group 'weight_update_group' exists"):
            engine.join_weight_group(WeightGroup(**trainer.group()))  # (each rank refuses)
        llm.destroy_weights_update_group()
        assert not engine.weight_groups
        # a trainer in this process: its tensors go to every rank with the update's message
        llm.update_weights_from_tensor(load_file(old / "model.safetensors").items())
        assert _outputs(llm) == before


def test_a_refused_update_is_still_received(models, tmp_path):
    """The trainer broadcasts once whatever the answer: an update refused before its tensors
    are read (here: the L3 tier under a paused request), or for what they hold (integers), is
    received and dropped, so the next update reads its own tensors, not the refused one's."""
    from dsakv.engine import SamplingParams

    old, new = models[0], models[1]
    with LLM(str(new), **ENGINE_ARGS) as fresh:
        want = _outputs(fresh)
    names = sorted(load_file(new / "model.safetensors"))
    embed = list(load_file(new / "model.safetensors")["model.embed_tokens.weight"].shape)
    ints = [["model.embed_tokens.weight", embed, "int32"]]
    trainer = Trainer(new, [[["model.embed_tokens.weight", embed]], ints, names])
    store = dict(hicache_storage_backend="file", hicache_storage_dir=str(tmp_path))
    with LLM(str(old), **ENGINE_ARGS, **store) as llm:
        engine = llm.engine
        engine.join_weight_group(WeightGroup(**trainer.group()))
        engine.add_request(list(range(5, 25)), SamplingParams(max_tokens=4, temperature=0))
        engine.step()
        engine.paused = True
        meta = trainer.bucket(0)
        zeros = GroupUpdate("weight_update_group", tuple(meta["names"]), tuple(meta["dtypes"]),
                            tuple(tuple(s) for s in meta["shapes"]))  # fmt: skip
        with pytest.raises(DsakvError, match="with the L3 tier"):
            engine.update_weights(zeros)
        engine.paused = False
        while engine.has_unfinished():
            engine.step()
        meta = trainer.bucket(1)
        with pytest.raises(DsakvError, match="torch.int32, not floating point"):
            llm.update_weights_from_distributed(meta["names"], meta["dtypes"], meta["shapes"])
        meta = trainer.bucket(2)
        update = GroupUpdate("weight_update_group", tuple(names), tuple(meta["dtypes"]),
                             tuple(tuple(s) for s in meta["shapes"]))  # fmt: skip
        assert engine.update_weights(update)
        trainer.done()
        assert _outputs(llm) == want


def test_fp8_tensors_and_prefill_servers_are_refused(models):
    """FP8 tensors would be copied as raw e4m3 values without their block scales; a prefill
    or decode server refuses the join itself (its handshake compares checkpoints), before a
    trainer starts broadcasting."""
    import torch

    with LLM(str(models[0]), **ENGINE_ARGS) as llm:
        before = _outputs(llm)
        embed = load_file(models[1] / "model.safetensors")["model.embed_tokens.weight"]
        fp8 = [("model.embed_tokens.weight", embed.to(torch.float8_e4m3fn))]
        with pytest.raises(DsakvError, match=r"is FP8 \(torch.float8_e4m3fn\): send it deq"):
            llm.update_weights_from_tensor(fp8)
        assert _outputs(llm) == before
    from dsakv.disagg.config import DisaggConfig
    from dsakv.disagg.serving import bridge_for

    config = EngineConfig(model=str(models[0]), **ENGINE_ARGS)
    bridge = bridge_for(DisaggConfig("prefill", bootstrap_port=free_port()), config, "127.0.0.1")
    with serving(config, bridge=bridge) as (base, _):
        body = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1,
                "world_size": 2, "backend": "gloo"}  # fmt: skip
        r = _post(base, "/init_weights_update_group", body)
        assert r.status_code == 400 and "prefill or decode server" in r.json()["message"]


def test_tensors_in_this_process(models):
    """SGLang's `update_weights_from_tensor` (a trainer in this process): in two buckets,
    the cache kept after the first, the engine then answers as a fresh one on those
    weights; a name the model does not have changes nothing."""
    old, new = models[0], models[1]
    with LLM(str(new), **ENGINE_ARGS) as fresh:
        want = _outputs(fresh)
    tensors = sorted(load_file(new / "model.safetensors").items())
    with LLM(str(old), **ENGINE_ARGS) as llm:
        before = _outputs(llm)
        bad = [*tensors[:3], ("model.layers.0.nope.weight", tensors[0][1])]
        with pytest.raises(DsakvError, match="does not have: model.layers.0.nope.weight"):
            llm.update_weights_from_tensor(bad)
        assert _outputs(llm) == before
        half = len(tensors) // 2
        llm.update_weights_from_tensor(tensors[:half], flush_cache=False)
        llm.update_weights_from_tensor(tensors[half:])
        assert _outputs(llm) == want
