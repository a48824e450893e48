"""SGLang's --lora-target-modules (`EngineConfig.lora_target_modules`): adapter slots only on
the modules it names (no routed experts' slots without gate/up/down_proj: the bulk of the
LoRA memory), an adapter on them serving the tokens it serves with every module targeted,
an adapter adapting another module refused at start and at run time (under TP=2 by every
rank alike), and bad names one clear error. Default `all`: every module, as vLLM.

The tiny GLM-5 model is dense (index_topk covering every context), fp32: exact comparisons
are fair. Adapters are PEFT's own (tests/test_lora.py, tests/test_lora_experts.py)."""

from __future__ import annotations

import shutil

import pytest
from safetensors.torch import load_file, save_file

from dsakv import LLM, LoRARequest
from dsakv.cli import build_parser, engine_config_from_args
from dsakv.cli.args import add_engine_args, given_flags
from dsakv.engine import Engine, EngineConfig
from dsakv.errors import DsakvError
from dsakv.models.moe import MoE
from dsakv.procs import free_port

from .conftest import cli_config, cli_error_line
from .test_lora import GREEDY, _peft_model, _prompt, dense_tiny
from .test_lora_experts import ATTENTION, FUSED, KW, WEIGHTS, _logprobs, _per_expert

peft = pytest.importorskip("peft")

PROMPTS = [_prompt(1, 45), _prompt(2, 12)]
SMALL = ["q_a_proj", "o_proj"]  # the attention adapter's modules


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return dense_tiny(tmp_path_factory.mktemp("targets"))


@pytest.fixture(scope="module")
def adapters(model, tmp_path_factory) -> dict[str, str]:
    """`attention` (q_a_proj, o_proj), `fused` (those and the routed experts' fused params),
    its experts' deltas as vLLM's per-expert keys, and `mlp` (the dense MLP's and the
    shared experts' gate_proj)."""
    root = tmp_path_factory.mktemp("adapters")
    fused = _peft_model(model, 3, r=4, target_modules=ATTENTION, target_parameters=FUSED)
    fused.save_pretrained(str(root / "fused"))
    for name, seed, targets in (("attention", 4, ATTENTION), ("mlp", 5, ["gate_proj"])):
        _peft_model(model, seed, r=4, target_modules=targets).save_pretrained(str(root / name))
    out = {name: str(root / name) for name in ("fused", "attention", "mlp")}
    return {**out, "per_expert": _per_expert(fused, root / "fused", root / "per_expert")}


def _engine(model: str, **kw) -> Engine:
    return Engine(EngineConfig(model, **KW, **kw))


def _slot_bytes(engine: Engine) -> int:
    return sum(t.numel() * t.element_size() for t in engine.model.lora.tensors())


def _suffixes(engine: Engine) -> set[str]:
    return {name.rsplit(".", 1)[1] for name in engine.model.lora.layers}


def _routed(engine: Engine) -> list:
    layers = engine.model.target_layers
    return [layer.mlp.experts.lora for layer in layers if isinstance(layer.mlp, MoE)]


# --- the flag -------------------------------------------------------------------------------


def test_the_flag_sets_the_field_and_serve_pd_hands_it_on(glm_tiny):
    """SGLang's spelling (names, repeatable: their union) sets the field; serve-pd passes it
    to its servers; not given, every module (`all`)."""
    assert cli_config("serve", glm_tiny, "--enable-lora").lora_target_modules == ("all",)
    flags = ["--enable-lora", "--lora-target-modules", "q_a_proj", "o_proj"]
    flags += ["--lora-target-modules", "gate_up_proj"]
    config = cli_config("serve", glm_tiny, *flags)
    assert config.lora_target_modules == ("q_a_proj", "o_proj", "gate_up_proj")
    args = build_parser().parse_args(["serve-pd", glm_tiny, *flags])
    engine_config_from_args(args)
    assert cli_config("serve", glm_tiny, *given_flags(args, add_engine_args)) == config


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--enable-lora", "--lora-target-modules", "o_proj", "q_proj"], "'q_proj' is not"),
        (["--lora-target-modules", "o_proj"], "--lora-target-modules needs --enable-lora"),
    ],
    ids=["unknown", "no-enable-lora"],
)
def test_bad_target_modules_are_one_error_line(glm_tiny, flags, words, capsys):
    """An unknown name lists the valid ones; the flag without --enable-lora is refused as the
    other LoRA settings are. One line, exit 2, before anything loads."""
    with pytest.raises(DsakvError):  # (refused before `serve` would start a server)
        cli_config("serve", glm_tiny, *flags)
    err = cli_error_line(["serve", glm_tiny, "--port", str(free_port()), *flags], capsys)
    assert words in err, err
    if "q_proj" in words:
        assert "q_a_proj, q_b_proj, kv_a_proj_with_mqa" in err and "gate_up_proj, all" in err


def test_bad_target_modules_offline_are_a_dsakv_error(model):
    """`LLM(...)` / `EngineConfig` keywords: a list (or one name) of the same names."""
    for kw, words in (
        (dict(enable_lora=True, lora_target_modules=["qkv_proj"]), "'qkv_proj' is not"),
        (dict(enable_lora=True, lora_target_modules=[]), "at least one module"),
        (dict(enable_lora=True, lora_target_modules=[3]), "must be module names"),
        (dict(lora_target_modules=["o_proj"]), "needs --enable-lora"),
    ):
        with pytest.raises(DsakvError, match=words):
            EngineConfig(model, **kw)
    config = EngineConfig(model, enable_lora=True, lora_target_modules="o_proj")
    assert config.lora_target_modules == ("o_proj",)


# --- slots ----------------------------------------------------------------------------------


def test_slots_only_on_the_targeted_modules(model):
    """q_a_proj and o_proj: their slots alone (S·R·(in + out) values each), no routed
    experts' slots (the experts run their plain op, no LoRA loop); down_proj: the dense
    MLP's, the shared experts' and the routed experts' down alone; gate_up_proj: gate and
    up. `all` (the default) holds every one."""
    full = _engine(model)
    assert _suffixes(full) == {
        "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "wq_b", "wk",
        "weights_proj", "gate_proj", "up_proj", "down_proj",
    }  # fmt: skip
    assert _routed(full) and all(r is not None for r in _routed(full))

    small = _engine(model, lora_target_modules=tuple(SMALL))
    assert _suffixes(small) == {"q_a_proj", "o_proj"}
    assert _routed(small) and all(r is None for r in _routed(small))
    linears = [small.model.get_submodule(name) for name in small.model.lora.layers]
    want = sum(8 * (lin.in_features + lin.out_features) * 4 for lin in linears)  # S 1, R 8, fp32
    assert _slot_bytes(small) == want and 5 * want < _slot_bytes(full)

    down = _engine(model, lora_target_modules=["down_proj"])
    assert _suffixes(down) == {"down_proj"}
    assert all(list(r.projections()) == ["down_proj"] for r in _routed(down))
    names = set(down.model.lora.layers)
    assert {"model.layers.0.mlp.down_proj", "model.layers.1.mlp.shared_experts.down_proj"} < names
    gate_up = _engine(model, lora_target_modules=["gate_up_proj"])
    assert _suffixes(gate_up) == {"gate_proj", "up_proj"}
    assert all(sorted(r.projections()) == ["gate_proj", "up_proj"] for r in _routed(gate_up))


@pytest.fixture(scope="module")
def tokens(model, adapters) -> dict[str, list]:
    """The greedy tokens of `PROMPTS` on the attention adapter and on the base model, under
    `all` and under `q_a_proj o_proj` (offline keywords: `LLM(..., lora_target_modules=...)`)."""
    lora = LoRARequest("attention", 1, adapters["attention"])
    got = {}
    for name, targets in (("all", "all"), ("small", SMALL)):
        with LLM(model, **KW, lora_target_modules=targets) as llm:
            outs = [
                llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=r) for r in (lora, None)
            ]
            got[name] = [[list(o.outputs[0].token_ids) for o in out] for out in outs]
    return got


def test_an_adapter_on_the_targets_gives_the_tokens_it_gives_with_every_module(tokens):
    """The attention adapter's greedy tokens (and the base model's) under `q_a_proj o_proj`
    are those under `all`; the adapter does change them."""
    on_adapter, on_base = tokens["all"]
    assert tokens["small"] == [on_adapter, on_base] and on_adapter != on_base


def test_the_routed_experts_down_proj_alone(model, adapters, tmp_path):
    """`down_proj`: the routed experts hold down's slots alone, and an adapter on just their
    down gives the logprobs and tokens it gives under `all` (where gate's and up's slots
    hold zeros); its delta is there."""
    path = tmp_path / "down"
    shutil.copytree(adapters["per_expert"], path)
    tensors = load_file(path / WEIGHTS)
    down = {k: t for k, t in tensors.items() if ".experts." in k and ".down_proj." in k}
    save_file(down, str(path / WEIGHTS))
    ids = list(range(0, 256, 8))
    got = {}
    for targets in ("all", "down_proj"):
        with LLM(model, **KW, lora_target_modules=targets) as llm:
            got[targets] = [_logprobs(llm, p, ids) for p in (str(path), None)]
    (everything, tokens), (base, _) = got["all"]
    alone, alone_tokens = got["down_proj"][0]
    assert alone_tokens == tokens and (alone - everything).abs().max().item() <= 1e-6
    assert (everything - base).abs().max().item() > 0.01


# --- refusals -------------------------------------------------------------------------------


EXPERTS = r"model\.layers\.1\.mlp\.experts\.(down|gate|up)_proj"


@pytest.mark.parametrize(
    "targets, adapter, words",
    [
        (("q_a_proj", "o_proj"), "fused", EXPERTS + r": not among --lora-target-modules"),
        (("q_a_proj", "o_proj"), "per_expert", EXPERTS + r": not among --lora-target-modules"),
        (("q_a_proj", "o_proj"), "mlp", r"model\.layers\.0\.mlp\.gate_proj: not among"),
        (("q_a_proj", "o_proj", "gate_up_proj"), "fused", r"experts\.down_proj: not among"),
        (("gate_proj", "up_proj", "down_proj"), "attention", r"self_attn\.o_proj: not among"),
    ],
    ids=["experts-fused", "experts-per-expert", "dense-mlp", "down-not-targeted", "attention"],
)
def test_an_adapter_outside_the_targets_is_refused(model, adapters, targets, adapter, words):
    """At run time one error naming the module and the flag, nothing loaded; at start the
    same error stops the engine."""
    engine = _engine(model, lora_target_modules=targets)
    with pytest.raises(DsakvError, match=words) as e:
        engine.load_lora("x", adapters[adapter])
    assert "\n" not in str(e.value) and adapters[adapter] in str(e.value)
    assert engine.loras() == {} and not engine.model.lora.adapters
    with pytest.raises(DsakvError, match=words):
        _engine(model, lora_target_modules=targets, lora_modules=[("x", adapters[adapter])])


def test_tp2_builds_the_same_slots_on_every_rank(model, adapters, tokens):
    """Under --tp 2 every rank builds the targeted modules' slots alone: an adapter on them
    gives TP=1's tokens, and one adapting the experts is refused by both ranks in the same
    words (a rank holding their slots would have loaded it: `rank 0: ...`)."""
    lora = LoRARequest("attention", 1, adapters["attention"])
    with LLM(model, **KW, lora_target_modules=SMALL, tp=2) as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=lora)
        assert [list(o.outputs[0].token_ids) for o in outs] == tokens["small"][0]
        with pytest.raises(DsakvError, match=EXPERTS) as e:
            llm.engine.load_lora("fused", adapters["fused"])
        assert not str(e.value).startswith("rank"), str(e.value)
        assert sorted(llm.engine.loras()) == ["attention"]
        assert all(r is None for r in _routed(llm.engine))
