"""Checkpoint loading: plan-driven indexer omission, skipped tensors, errors, sharding, FP8."""

from __future__ import annotations

import ctypes
import json
import logging
import mmap
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsakv import LLM, SamplingParams
from dsakv.cli import main
from dsakv.config import LayerPlan
from dsakv.engine.engine import _load_tokenizer
from dsakv.errors import ConfigError, DsakvError
from dsakv.memory import huge_page_empty_like
from dsakv.memory.release import Stash
from dsakv.models import DSAForCausalLM, load_model, write_tiny_model

from .model_driver import fp8_block_quantise, greedy, make_pool

INDEXER_TENSORS = 5  # wq_b, wk, k_norm.weight, k_norm.bias, weights_proj


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """glm-tiny: GLM-5.2-format config (`indexer_types` F F S S F S F S), no MTP layer."""
    return write_tiny_model(tmp_path_factory.mktemp("glm-tiny"), "glm-tiny", mtp="none")


def _indexer_params(model: DSAForCausalLM) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if ".indexer." in n)


def _copy_ckpt(src, dst, edit):
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_shared_layers_allocate_no_indexer(ckpt, caplog):
    with caplog.at_level(logging.INFO, logger="dsakv.models.loader"):
        model, config, plan = load_model(ckpt)
    assert plan.full_layers == (0, 1, 4, 6) and plan.shared_layers == (2, 3, 5, 7)
    for i, layer in enumerate(model.model.layers):
        assert hasattr(layer.self_attn, "indexer") == plan.runs_indexer(i)
    with torch.device("meta"):
        all_full = DSAForCausalLM(config, plan.all_full())
    per_layer = _indexer_params(all_full) // config.num_hidden_layers
    assert _indexer_params(model) == per_layer * plan.num_full_layers
    total = sum(p.numel() for p in model.parameters())
    saved = sum(p.numel() for p in all_full.parameters()) - total
    assert saved == per_layer * plan.num_shared_layers
    assert "skipped 0 indexer tensors" in caplog.text
    assert "belong to other ranks\n" in caplog.text  # (no pipeline stages: not said)


def test_override_skips_and_counts_indexer_tensors(ckpt, caplog):
    with caplog.at_level(logging.INFO, logger="dsakv.models.loader"):
        model, _, plan = load_model(ckpt, index_topk_pattern="FSSSSSSS")
    assert plan.full_layers == (0,)
    assert f"skipped {3 * INDEXER_TENSORS} indexer tensors of 7 shared layers" in caplog.text
    assert sum(".indexer." in n for n, _ in model.named_parameters()) == INDEXER_TENSORS


def test_plan_needing_absent_indexers_is_a_clear_error(ckpt):
    with pytest.raises(
        DsakvError, match=r"missing tensor\(s\): model\.layers\.2\.self_attn\.indexer"
    ):
        load_model(ckpt, no_index_share=True)
    with pytest.raises(DsakvError) as e:  # the layers named, and what to do
        load_model(ckpt, index_topk_pattern="FFFSFSSF")
    assert str(e.value).endswith(
        "layer(s) 2, 7 run their indexer in the layer plan FFFSFSSF but the checkpoint holds "
        "none for them: make them shared (--index-topk-pattern)"
    )


def test_missing_and_unexpected_tensors(ckpt, tmp_path):
    def drop(t):
        for k in [k for k in t if k.startswith("model.layers.5.")]:
            del t[k]
        t["model.layers.0.self_attn.bogus.weight"] = torch.zeros(2)

    bad = _copy_ckpt(ckpt, tmp_path / "bad", drop)
    with pytest.raises(DsakvError) as e:
        load_model(bad)
    msg = str(e.value)
    assert "missing tensor(s): model.layers.5." in msg and "more)" in msg  # long list truncated
    assert "1 unexpected tensor(s): model.layers.0.self_attn.bogus.weight" in msg
    assert "\n" not in msg


def test_a_layer_or_expert_number_past_ints_limit_is_an_unexpected_tensor(ckpt, tmp_path):
    """A tensor named with a 5,000-digit layer or expert number was a ValueError traceback
    (int() refuses over 4,300 digits); it is a tensor no module has, as any other."""
    huge = "9" * 5000

    def add(t):
        t[f"model.layers.{huge}.mlp.experts.0.up_proj.weight"] = torch.zeros(2)
        t[f"model.layers.1.mlp.experts.{huge}.up_proj.weight"] = torch.zeros(2)

    bad = _copy_ckpt(ckpt, tmp_path / "bad", add)
    with pytest.raises(DsakvError, match=r"2 unexpected tensor\(s\): model\.layers\.1\.mlp"):
        load_model(bad)


def test_a_missing_expert_is_named_whether_its_layer_is_stacked_or_not(ckpt, tmp_path):
    """Experts load one by one or stacked (`experts.gate_up_proj`, `experts.down_proj`); a
    missing one is named as the checkpoint would hold it (it was the stacked parameter's
    name, with no word of which expert)."""
    experts = "model.layers.1.mlp.experts"

    def edit(t):
        del t[f"{experts}.1.up_proj.weight"]  # one by one
        stacked = "model.layers.2.mlp.experts"  # layer 2 stacked, its expert 3 down missing
        n = len({k.split(".")[5] for k in t if k.startswith(stacked + ".")})
        halves = [
            torch.cat([t.pop(f"{stacked}.{e}.{p}_proj.weight") for p in ("gate", "up")])
            for e in range(n)
        ]
        t[f"{stacked}.gate_up_proj"] = torch.stack(halves)
        del t[f"{stacked}.3.down_proj.weight"]

    bad = _copy_ckpt(ckpt, tmp_path / "bad", edit)
    with pytest.raises(DsakvError) as e:
        load_model(bad)
    assert str(e.value) == (
        "checkpoint does not match the model: 2 missing tensor(s): "
        f"{experts}.1.up_proj.weight, model.layers.2.mlp.experts.3.down_proj.weight"
    )


def test_draft_layer_tensors_are_skipped(ckpt, tmp_path, caplog):
    def add_mtp(t):
        t["model.layers.8.eh_proj.weight"] = torch.zeros(4, 4)
        t["model.layers.8.self_attn.indexer.wk.weight"] = torch.zeros(4, 4)

    path = _copy_ckpt(ckpt, tmp_path / "mtp", add_mtp)
    with caplog.at_level(logging.INFO, logger="dsakv.models.loader"):
        load_model(path)
    assert "and 2 draft/MTP tensors" in caplog.text
    # A config with fewer layers than the checkpoint holds ran the first ones alone, their
    # rest skipped as if draft layers: wrong outputs, no error.
    fewer = shutil.copytree(ckpt, tmp_path / "fewer")
    config = json.loads((fewer / "config.json").read_text())
    config |= {"num_hidden_layers": 6, "indexer_types": config["indexer_types"][:6]}
    (fewer / "config.json").write_text(json.dumps(config))
    with pytest.raises(DsakvError, match=r"unexpected tensor\(s\): model\.layers\.7\."):
        load_model(fewer)


def _logits(model, config, plan, steps=4):
    prompt = list(range(30, 70))
    return greedy(model, make_pool(config, plan), prompt, steps)[1]


def test_sharded_checkpoint_loads_identically(ckpt, tmp_path):
    tensors = load_file(ckpt / "model.safetensors")
    names = sorted(tensors)
    weight_map = {}
    for i in range(3):
        file = f"model-{i + 1:05d}-of-00003.safetensors"
        part = {n: tensors[n] for n in names[i::3]}
        save_file(part, tmp_path / file)
        weight_map.update(dict.fromkeys(part, file))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    shutil.copy(ckpt / "config.json", tmp_path / "config.json")
    a, b = load_model(ckpt), load_model(tmp_path)
    assert torch.equal(_logits(*a), _logits(*b))


def _fp8_ckpt(src, dst, originals=None, edit=None):
    """`src` with its 2-D projections as 128×128-block e4m3 weights + `weight_scale_inv`
    (their fp32 values into `originals`), then `edit`ed."""
    originals = {} if originals is None else originals

    def quantise(t):
        for k in [k for k in t if k.endswith("proj.weight") and t[k].dim() == 2]:
            t[k], t[k + "_scale_inv"], originals[k] = fp8_block_quantise(t[k])
        if edit is not None:
            edit(t)

    path = _copy_ckpt(src, dst, quantise)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_fp8_block_quantised_checkpoint_is_dequantised(ckpt, tmp_path):
    """128×128-block e4m3 weights + `weight_scale_inv`, as DeepSeek/GLM FP8 releases ship."""
    originals = {}
    model, config, _ = load_model(_fp8_ckpt(ckpt, tmp_path / "fp8", originals))
    params = dict(model.named_parameters())
    assert len(originals) > 20
    for k, expected in originals.items():
        if ".experts." in k:  # per-expert tensors land in the stacked expert parameters
            prefix, e, part, _ = k.rsplit(".", 3)
            i = config.moe_intermediate_size
            stacked = params[f"{prefix}.{'down_proj' if part == 'down_proj' else 'gate_up_proj'}"]
            got = {"gate_proj": stacked[int(e), :i], "up_proj": stacked[int(e), i:]}.get(
                part, stacked[int(e)]
            )
        else:
            got = params[k]
        assert torch.equal(got, expected), k


_KV_B = "model.layers.3.self_attn.kv_b_proj.weight"  # (256, 512): 2 × 4 blocks


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.pop(_KV_B + "_scale_inv"), r"kv_b_proj.weight is FP8 \(F8_E4M3\) without"),
        (
            lambda t: t.update({_KV_B + "_scale_inv": t[_KV_B + "_scale_inv"].t().contiguous()}),
            r"scale_inv has shape \(4, 2\); .* in 128x128 blocks .* has \(2, 4\)",
        ),
        (
            lambda t: t.update({_KV_B + "_scale_inv": torch.ones(4, 8)}),  # 64×64 blocks
            r"scale_inv has shape \(4, 8\)",
        ),
        (
            lambda t: t.update({"model.layers.3.self_attn.gone.weight_scale_inv": torch.ones(1)}),
            r"unexpected tensor\(s\): model.layers.3.self_attn.gone.weight_scale_inv",
        ),
        (
            lambda t: t.update({"lm_head.weight": t["lm_head.weight"].to(torch.int32)}),
            "lm_head.weight is I32, not floating point",
        ),
    ],
    ids=["no-scale", "transposed", "other-blocks", "stray-scale", "integers"],
)
def test_integer_weights_and_ill_fitting_fp8_scales_are_refused(ckpt, tmp_path, edit, message):
    """Without its scale an FP8 weight loaded as raw e4m3 values, scales of another block
    size were read in part, an int32 matrix was cast: wrong tokens, no error. A transposed
    scale failed deep in torch. Each is now one error, before anything is allocated."""
    path = _fp8_ckpt(ckpt, tmp_path / "fp8", edit=edit)
    with pytest.raises(DsakvError, match=message):
        load_model(path)


def test_bf16_load_keeps_router_and_index_weights_fp32(ckpt):
    model, _, _ = load_model(ckpt, dtype="bf16")
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert dtypes["model.layers.1.mlp.gate.weight"] == torch.float32
    assert dtypes["model.layers.0.self_attn.indexer.weights_proj.weight"] == torch.float32
    assert dtypes["model.layers.0.self_attn.q_a_proj.weight"] == torch.bfloat16
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32


def test_plan_and_overrides_are_exclusive(ckpt):
    from dsakv.config import ModelConfig

    plan = LayerPlan.from_config(ModelConfig.from_hf(ckpt))
    with pytest.raises(DsakvError, match="either a LayerPlan or plan overrides"):
        load_model(ckpt, plan, no_index_share=True)


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _index(weight_map):
    def write(path):
        path.unlink()
        index = path.parent / "model.safetensors.index.json"
        index.write_text(json.dumps({"weight_map": weight_map} if weight_map else {"x": 1}))

    return write


def _misplaced(path):
    """An index that puts lm_head.weight in a shard that does not hold it (a SafetensorError
    traceback from the read)."""
    save_file({"x": torch.zeros(1)}, path.parent / "other.safetensors")
    weight_map = dict.fromkeys(load_file(path), path.name) | {"lm_head.weight": "other.safetensors"}
    (path.parent / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": weight_map})
    )


def _deep(key: str, depth: int = 100_000) -> str:
    """A JSON object nested past Python's recursion limit (json.loads: a RecursionError)."""
    return f'{{"{key}": ' + "[" * depth + "]" * depth + "}"


def _deep_index(path):
    (path.parent / "model.safetensors.index.json").write_text(_deep("weight_map"))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda p: p.write_text("garbage"), "cannot read checkpoint file .*model.safetensors"),
        (_truncate, "cannot read checkpoint file .*model.safetensors: .*header"),
        (_index(None), r"model\.safetensors\.index\.json is not a safetensors index"),
        (_index({"lm_head.weight": "gone.safetensors"}), "checkpoint file .*gone.safetensors"),
        (_misplaced, "checkpoint file .*other.safetensors holds no tensor lm_head.weight"),
        (_deep_index, r"model\.safetensors\.index\.json is not a safetensors index: nested"),
    ],
)
def test_corrupt_checkpoint_file_is_named(ckpt, tmp_path, edit, message):
    path = shutil.copytree(ckpt, tmp_path / "bad")
    edit(path / "model.safetensors")
    with pytest.raises(DsakvError, match=message) as e:
        load_model(path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("file", "edit", "error", "message"),
    [
        ("tokenizer.json", "{bad", DsakvError, "tokenizer.json is not valid JSON"),
        ("tokenizer.json", "{}", DsakvError, "cannot load the tokenizer in "),
        ("tokenizer_config.json", "[bad", DsakvError, "tokenizer_config.json is not valid JSON"),
        ("tokenizer_config.json", _deep("a"), DsakvError, "_config.json is not valid JSON: nested"),
        ("tokenizer.json", _deep("a"), DsakvError, "tokenizer.json is not valid JSON: nested"),
        ("config.json", {"pad_token_id": "x"}, ConfigError, "config.json: .*'pad_token_id'"),
    ],
)
def test_broken_tokenizer_or_transformers_config_is_named(
    ckpt, tmp_path, file, edit, error, message
):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ckpt / name, tmp_path / name)
    if isinstance(edit, dict):  # a field transformers' config class refuses (dsakv ignores)
        edit = json.dumps({**json.loads((tmp_path / file).read_text()), **edit})
    (tmp_path / file).write_text(edit)
    with pytest.raises(error, match=message) as e:
        _load_tokenizer(str(tmp_path))
    assert "\n" not in str(e.value)
    assert _load_tokenizer(str(ckpt)) is not None


@pytest.mark.parametrize(
    ("file", "text"),
    [
        ("model.safetensors", "garbage"),
        ("tokenizer.json", "{bad"),
        ("model.safetensors.index.json", _deep("weight_map")),
        ("tokenizer_config.json", _deep("a")),
    ],
)
def test_generate_with_corrupt_file_is_one_error_line(ckpt, tmp_path, capsys, file, text):
    path = shutil.copytree(ckpt, tmp_path / "bad")
    (path / file).write_text(text)
    args = ["generate", str(path), "--prompt", "hi", "--max-tokens", "2", "--device", "cpu"]
    with pytest.raises(SystemExit) as exc:
        sys.exit(main(args))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and file in err[0], err


def _with_config(src, dst, **fields):
    path = shutil.copytree(src, dst)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **fields}))
    return path


def test_a_config_its_checkpoint_contradicts_is_refused_before_allocating(ckpt, tmp_path):
    """A vocab of 2**36 (a typo) asked for 16 TiB before any tensor's shape was compared:
    a torch allocator traceback. The shapes are now checked on the meta device first."""
    path = _with_config(ckpt, tmp_path / "m", vocab_size=2**36)
    with pytest.raises(DsakvError, match=r"lm_head.weight has shape \(264, 64\), model expects"):
        load_model(path)


def test_too_little_memory_for_the_model_is_one_error_with_its_size(ckpt, tmp_path):
    """2**36 positions make 2 × 8 TiB of RoPE tables: one error naming the size, at load
    (the tables were built at the first step, so the engine died serving a request)."""
    path = _with_config(ckpt, tmp_path / "m", max_position_embeddings=2**36)
    with pytest.raises(DsakvError, match=r"cannot allocate this model's 16384.\d\d GiB .* host"):
        load_model(path)


def test_generation_configs_eos_ids_stop_generation_too(ckpt, tmp_path):
    """vLLM and SGLang stop on generation_config.json's eos_token_id as well as config.json's
    (GLM and DeepSeek releases list end-of-turn ids there); it was not read."""
    params = SamplingParams(max_tokens=8, temperature=0)
    tokens = LLM(str(ckpt), device="cpu", num_pages=8).generate([5, 6, 7], params)[0].token_ids
    path = shutil.copytree(ckpt, tmp_path / "m")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [257, tokens[2]]}))
    out = LLM(str(path), device="cpu", num_pages=8).generate([5, 6, 7], params)[0]
    assert out.token_ids == tokens[: tokens.index(tokens[2]) + 1] and out.finish_reason == "stop"
    for text, message in (("[1", "is not a JSON object"), ('{"eos_token_id": "x"}', "must be a")):
        (path / "generation_config.json").write_text(text)
        with pytest.raises(ConfigError, match=f"generation_config.json.* {message}"):
            load_model(path)


def _thp_eligible(address: int) -> bool:
    """Whether the mapping holding `address` may be backed by transparent huge pages
    (`/proc/self/smaps`' THPeligible of its VMA)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split()[0]
        if "-" in first and not first.endswith(":"):
            lo, hi = (int(x, 16) for x in first.split("-"))
            inside = lo <= address < hi
        elif inside and first == "THPeligible:":
            return line.split()[1] == "1"
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_cpu_models_weights_lie_in_one_block_of_huge_pages(glm_tiny):
    """On the CPU every weight is carved from one block Linux backs with huge pages (a
    decode step streams them all; each weight alone is far smaller than a huge page): under
    THP "madvise" its mapping is THP-eligible, as a fresh anonymous mapping is not (the
    allocator's heap may hold a range an earlier block in this process advised). The
    buffers lie apart (sleep mode drops the weights and keeps them)."""
    model, _, _ = load_model(glm_tiny)
    params = list(model.parameters())
    block = {p.untyped_storage().data_ptr() for p in params}
    assert len(block) == 1
    assert not block & {b.untyped_storage().data_ptr() for b in model.buffers()}
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.is_file() or "[madvise]" not in mode.read_text():
        pytest.skip('THP is not in "madvise" mode here: eligibility says nothing')
    assert _thp_eligible(params[0].data_ptr())
    with mmap.mmap(-1, 4 << 20) as plain:  # (unadvised)
        view = ctypes.c_char.from_buffer(plain)
        assert not _thp_eligible(ctypes.addressof(view))
        del view


def test_weights_come_back_on_huge_pages_after_sleep():
    """Sleep mode frees the weights' block and the allocator brings it back (`Stash`): on
    plain pages, unless advised again. 40 MiB: past glibc's largest mmap threshold, so the
    memory that comes back is always a fresh mapping, never the advised one reused."""
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.is_file() or "[madvise]" not in mode.read_text():
        pytest.skip('THP is not in "madvise" mode here: eligibility says nothing')
    n = 40 << 20
    weight = huge_page_empty_like(n)(torch.empty(n // 4, device="meta"))
    weight.copy_(torch.arange(n // 4, dtype=torch.float32))
    stash = Stash([weight], keep=True, huge_pages=True)
    stash.free()
    stash.restore()
    assert _thp_eligible(weight.data_ptr() + n // 2)
    assert torch.equal(weight, torch.arange(n // 4, dtype=torch.float32))


def test_the_mtp_layers_dropped_vocab_copies_give_their_bytes_back(tmp_path):
    """The MTP layer's own embedding and head (DeepSeek's), dropped at load where they
    equal the target's, lie outside the weights' huge-page block: their bytes go back."""
    model, _, _ = load_model(write_tiny_model(tmp_path, "deepseek-tiny"), draft_layers=1)
    assert not model.mtp.vocab_copies()  # (both equal the target's: dropped)
    params = list(model.parameters())
    assert len({p.untyped_storage().data_ptr() for p in params}) == 1
    block = params[0].untyped_storage().nbytes() - (2 << 20)  # (the block's alignment slack)
    kept = sum(p.numel() * p.element_size() + 64 for p in params)
    vocab = model.model.embed_tokens.weight
    assert kept <= block < kept + vocab.numel() * vocab.element_size()
