"""Deterministic random tiny DSA models with a byte-level tokenizer, for tests and benchmarks.

Weights come from transformers' own reference model (seeded) and its `save_pretrained`,
so they are real-format checkpoints: per-expert tensors, `*.indexer.*` on full layers only.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import torch

from dsakv.config.presets import (
    BOS_ID,
    QUANTIZED_WEIGHT,
    SPECIAL_TOKENS,
    TINY_PRESETS,
    is_model_dir,
)
from dsakv.errors import DsakvError
from dsakv.writable import write_blocker

# Chat templates in the real models' shapes (role markers are the tiny specials; every other
# tag is plain text). Tools arrive as `tools=[{"type": "function", "function": {...}}]`;
# assistant tool-call arguments as dicts. DeepSeek-V3.2 ships no template (its prompt is
# rendered in code: `dsakv.engine.chat_format.render_chat`), nor does the tiny preset.
_ROLE_ERROR = "{{ raise_exception('unsupported role ' ~ m.role) }}"
_ARG_TEXT = "{{ v if v is string else v | tojson }}"

# GLM-5's: tool calls `<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value>
# </tool_call>`, tool results under `<|observation|><tool_response>`; thinking on unless
# `enable_thinking` is false (the generation prompt `<|assistant|><think>`, else
# `<|assistant|></think>`); an assistant turn's reasoning (`reasoning_content`, else a
# `<think>` block in its content) kept only after the last user turn unless `clear_thinking`
# is false. ([gMASK]<sop>, GLM's prefix, is the tiny BOS here.)
GLM_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>\n# Tools\n\nYou may call one or more functions to assist "
    "with the user query.\n\nYou are provided with function signatures within "
    "<tools></tools> XML tags:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n\n"
    "For each function call, output the function name and arguments within the following "
    "XML format:\n<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>"
    "{arg-value-1}</arg_value><arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}"
    "</arg_value>...</tool_call>{% endif %}"
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}"
    "{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' %}<|system|>{{ m.content }}"
    "{% elif m.role == 'user' %}<|user|>{{ m.content }}"
    "{% elif m.role == 'assistant' %}<|assistant|>"
    "{% set text = m.content or '' %}{% set thought = m.reasoning_content %}"
    "{% if thought is not string and '</think>' in text %}"
    "{% set thought = text.split('</think>')[0].rstrip('\n').split('<think>')[-1]"
    ".lstrip('\n') %}{% set text = text.split('</think>')[-1].lstrip('\n') %}{% endif %}"
    "{% if thought and (loop.index0 > ns.last_user "
    "or (clear_thinking is defined and not clear_thinking)) %}"
    "<think>{{ thought.strip() }}</think>{% else %}</think>{% endif %}{{ text.strip() }}"
    "{% for tc in m.tool_calls or [] %}<tool_call>{{ tc.function.name }}"
    "{% for k, v in tc.function.arguments.items() %}<arg_key>{{ k }}</arg_key><arg_value>"
    + _ARG_TEXT
    + "</arg_value>{% endfor %}</tool_call>{% endfor %}"
    "{% elif m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|observation|>"
    "{% endif %}<tool_response>{{ m.content }}</tool_response>"
    "{% else %}" + _ROLE_ERROR + "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{{ '</think>' if (enable_thinking is defined and not enable_thinking) else '<think>' }}"
    "{% endif %}"
)
CHAT_TEMPLATES = {"glm_moe_dsa": GLM_CHAT_TEMPLATE}


def hf_config(preset: str | dict[str, Any]):
    """A transformers config object for a preset name or a config dict."""
    from transformers import DeepseekV32Config, GlmMoeDsaConfig

    raw = copy.deepcopy(TINY_PRESETS[preset] if isinstance(preset, str) else preset)
    model_type = raw.pop("model_type")
    cls = {"glm_moe_dsa": GlmMoeDsaConfig, "deepseek_v32": DeepseekV32Config}[model_type]
    return cls(**raw)


def random_hf_model(config, seed: int = 0, dtype: torch.dtype = torch.float32):
    """transformers' reference model with seeded weights; norms and router bias perturbed
    too, so every parameter (not only the projections) matters for parity."""
    from transformers import AutoModelForCausalLM

    gen_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name or name.endswith(".bias"):
                    p.add_(0.1 * torch.randn(p.shape, generator=g))
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.copy_(0.05 * torch.randn(b.shape, generator=g))
    finally:
        torch.random.set_rng_state(gen_state)
    return model.to(dtype).eval()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what ByteLevel expects)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(161, 173)) + list(range(174, 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def write_tokenizer(path: str | Path, model_type: str = "glm_moe_dsa") -> None:
    """Byte-level tokenizer: token id == byte value, specials from 256 up; the chat
    template of `model_type`'s family. DeepSeek-V3.2's, as its release, has no template and
    adds a BOS to a text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    if model_type == "deepseek_v32":
        tok.post_processor = processors.TemplateProcessing(
            single="<|bos|> $A", pair="<|bos|> $A $B", special_tokens=[("<|bos|>", BOS_ID)]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        chat_template=CHAT_TEMPLATES.get(model_type),
    )
    fast.save_pretrained(str(path))


MTP_MODES = ("fit", "random", "none")
# How `write_tiny_model` stores the weights: fp32, bf16, or the layers' linear weights as
# FP8 blocks (e4m3, one scale per 128 × 128 block, as DeepSeek-V3.x / GLM-5 FP8 releases
# ship them) with everything else bf16.
WEIGHT_FORMATS = ("fp32", "bf16", "fp8")
FP8_QUANTIZATION = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}


def write_tiny_model(
    path: str | Path,
    preset: str | dict[str, Any] = "glm-tiny",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    mtp: str = "random",
    weights: str | None = None,
) -> Path:
    """Write config.json, model.safetensors and the tokenizer for a tiny preset into `path`.

    `mtp`: the MTP layer `model.layers.{N}` (`num_nextn_predict_layers: 1`) written into
    model.safetensors beside the target's tensors (transformers ignores it): `"fit"`
    distilled from the target (`mtp_fit.fit_draft`, seconds on CPU), `"random"` an unfitted
    one (the target's last layer, random eh_proj: it accepts almost nothing), `"none"`
    no MTP layer. DeepSeek-V3.2 presets also carry the MTP layer's own embedding and
    head copies, as its releases do.

    `weights` (one of `WEIGHT_FORMATS`) overrides `dtype`; `"fp8"` writes bf16 weights, then
    quantises the layers' projections to FP8 blocks (`quantize_fp8_blocks`).
    """
    if weights is not None:
        if weights not in WEIGHT_FORMATS:
            raise DsakvError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {weights!r}")
        dtype = torch.float32 if weights == "fp32" else torch.bfloat16
    if mtp not in MTP_MODES:
        raise DsakvError(f"mtp must be one of {', '.join(MTP_MODES)}, got {mtp!r}")
    path = Path(path)
    _refuse_unwritable(path, f"cannot write a model into {path}")
    path.mkdir(parents=True, exist_ok=True)
    config = hf_config(preset)
    config.num_nextn_predict_layers = 0 if mtp == "none" else 1
    model = random_hf_model(config, seed, dtype)
    model.save_pretrained(str(path), max_shard_size="100GB")
    write_tokenizer(path, config.model_type)
    if mtp != "none":
        _write_mtp_layer(path, model, seed, dtype, fit=mtp == "fit")
    if weights == "fp8":
        quantize_fp8_blocks(path)
    return path


def _refuse_unwritable(folder: Path, what: str) -> None:
    """One error line now, where `folder` cannot take the model's files, not an OSError
    traceback from the first write."""
    blocker = write_blocker(folder)
    if blocker is not None:
        why = "is not a directory" if not blocker.is_dir() else "refuses new files"
        raise DsakvError(f"{what}: {blocker} {why}")


def quantize_fp8_blocks(path: str | Path, block: int = 128) -> int:
    """Rewrite `path`'s model.safetensors with the layers' projection weights as FP8 blocks
    (`weight` e4m3 + `weight_scale_inv` fp32 per `block` × `block`: amax / 448, so each
    block's largest value maps to e4m3's largest) and say so in config.json. Returns how
    many tensors were quantised."""
    from safetensors.torch import load_file, save_file

    path = Path(path)
    file = path / "model.safetensors"
    tensors = load_file(file)
    names = [n for n in tensors if QUANTIZED_WEIGHT.match(n) and tensors[n].dim() == 2]
    for name in names:
        w = tensors[name].float()
        n, k = w.shape
        nb, kb = -(-n // block), -(-k // block)
        padded = torch.zeros(nb * block, kb * block)
        padded[:n, :k] = w
        blocks = padded.view(nb, block, kb, block)
        amax = blocks.abs().amax(dim=(1, 3))
        scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
        q = (blocks / scale[:, None, :, None]).view(nb * block, kb * block)[:n, :k]
        tensors[name] = q.to(torch.float8_e4m3fn).contiguous()
        tensors[name + "_scale_inv"] = scale.contiguous()
    save_file(tensors, file, metadata={"format": "pt"})
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config["quantization_config"] = {**FP8_QUANTIZATION, "weight_block_size": [block, block]}
    config_file.write_text(json.dumps(config, indent=2) + "\n")
    return len(names)


def _write_mtp_layer(path: Path, hf_model, seed: int, dtype: torch.dtype, fit: bool) -> None:
    """Append `model.layers.{N}.*` to the checkpoint's model.safetensors."""
    from safetensors.torch import load_file, save_file

    from .mtp_fit import draft_block, fit_draft

    gen_state = torch.random.get_rng_state()
    try:
        if fit:
            from .loader import load_model

            target, _, _ = load_model(path, dtype=torch.float32)
            block = fit_draft(hf_model, target, seed + 2)
        else:
            block = draft_block(hf_model, seed + 2)
    finally:
        torch.random.set_rng_state(gen_state)
    tensors = block.checkpoint_tensors()
    if hf_model.config.model_type == "deepseek_v32":
        tensors[block.prefix + "embed_tokens.weight"] = hf_model.model.embed_tokens.weight
        tensors[block.prefix + "shared_head.head.weight"] = hf_model.lm_head.weight
    file = path / "model.safetensors"
    saved = load_file(file)
    saved.update({k: v.detach().to(dtype).contiguous() for k, v in tensors.items()})
    save_file(saved, file, metadata={"format": "pt"})


def default_model_dir(preset: str = "glm-bench", seed: int = 0, weights: str | None = None) -> Path:
    """A cached tiny model (`$DSAKV_CACHE` or `~/.cache/dsakv`), generated on first use.

    `weights`: None, as the preset is released (16-bit for the bench presets, with a fitted
    MTP layer), or one of `WEIGHT_FORMATS` (no MTP layer: written in seconds)."""
    if preset not in TINY_PRESETS:
        raise DsakvError(f"unknown tiny preset {preset!r} (choose from {', '.join(TINY_PRESETS)})")
    root = Path(os.environ.get("DSAKV_CACHE") or Path.home() / ".cache" / "dsakv")
    # "-mtp2": caches from before the MTP layer was fitted on prompts of several lengths
    # regenerate; "-chat2": those from before GLM-5's chat template and DeepSeek-V3.2's
    # template-less, BOS-adding tokenizer
    tag = "mtp2-chat2" if weights is None else f"{weights}-chat2"
    name = f"{preset}-{tag}-seed{seed}"
    path = root / name
    done = path / ".complete"
    if not done.is_file():
        where = f"the tiny-model cache {root} ($DSAKV_CACHE, else ~/.cache/dsakv)"
        _refuse_unwritable(root, f"cannot write {where}")
        tmp = root / f".{name}.tmp{os.getpid()}"
        mtp = "fit" if weights is None else "none"
        if weights is None:
            wide = preset.startswith(("glm-bench", "glm-hisparse"))  # 16-bit, as released
            weights = "bf16" if wide else "fp32"
        write_tiny_model(tmp, preset, seed, mtp=mtp, weights=weights)
        done_note = {"preset": preset, "seed": seed, "mtp": mtp, "weights": weights}
        (tmp / ".complete").write_text(json.dumps(done_note))
        try:
            tmp.rename(path)
        except OSError:  # a concurrent writer won (`make test`'s workers): keep theirs
            if not done.is_file():
                raise
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return path


def resolve_model_dir(model: str | None, default: str = "glm-bench") -> str:
    """What a `MODEL` argument names: a model directory (it wins over a preset of its name:
    `is_model_dir`), a tiny preset (generated on first use), or, when omitted, the embedded
    default preset."""
    if model is not None and is_model_dir(model):
        return str(model)
    if model is None or model in TINY_PRESETS:
        return str(default_model_dir(model or default))
    if Path(model).is_file():  # e.g. DIR/config.json: the model is the folder
        folder = Path(model).absolute().parent
        hint = f"; give its folder, {folder}" if (folder / "config.json").is_file() else ""
        raise DsakvError(f"{model} is a file, not a model directory{hint}")
    raise DsakvError(f"{model} is not a model directory (no config.json) nor a tiny preset")
