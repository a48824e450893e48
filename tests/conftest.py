"""Shared test fixtures: small model configs that keep the real per-token cache dims."""

from __future__ import annotations

import copy
import os
from typing import Any

import numpy as np
import pytest
import torch

from dsakv.config import preset

# On a CPU the Triton kernels run under the interpreter: set before any test module imports
# triton (peft and transformers import it too, so a module's own setting came too late
# whenever another module was collected first)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def small_glm_config(num_layers: int = 6, **extra: Any) -> dict[str, Any]:
    """A GLM-shaped config dict with tiny compute dims but real cache dims (576 / 128)."""
    cfg = preset("glm-5")
    cfg.update(
        num_hidden_layers=num_layers,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        index_n_heads=2,
        index_topk=8,
        vocab_size=300,
    )
    cfg.update(extra)
    return copy.deepcopy(cfg)


@pytest.fixture
def glm_small() -> dict[str, Any]:
    return small_glm_config()


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """The tests run thousands of tiny tensor ops: intra-op threads only add sync cost, and
    stall badly when another process shares the two cores."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def glm_tiny() -> str:
    """glm-tiny's checkpoint (cached; its MTP layer fitted): the tiny MoE model the routing
    tests run."""
    from dsakv.models.tiny import default_model_dir

    return str(default_model_dir("glm-tiny"))


@pytest.fixture(scope="session")
def glm_tiny_dense_mtp(tmp_path_factory) -> str:
    """glm-tiny with index_topk covering every context the tests use (greedy runs with and
    without MTP are exactly equal) and its MTP layer fitted to it (drafts often kept): the
    fit takes ~20 s, so the run writes it once, whichever worker asks first, the others
    waiting on its lock (pytest-xdist's workers share their base temp's parent)."""
    from filelock import FileLock

    from dsakv.models.tiny import TINY_PRESETS, write_tiny_model

    base = tmp_path_factory.getbasetemp()
    path = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "glm-dense-mtp"
    with FileLock(f"{path}.lock"):
        if not (path / ".complete").is_file():
            write_tiny_model(path, {**TINY_PRESETS["glm-tiny"], "index_topk": 1024}, mtp="fit")
            (path / ".complete").touch()
    return str(path)


@pytest.fixture(scope="module")
def glm_tiny_hf(glm_tiny):
    """transformers' glm-tiny in fp32: the routing tests' reference (`hf_reference`)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(glm_tiny, dtype=torch.float32).eval()


def hf_reference(hf, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """transformers' forward over `ids`: each position's experts (its MoE gates' top-k,
    sorted; a dense layer's 0) `[n, layers, top_k]` and final-normed hidden `[n, hidden]`."""
    import torch

    top_k = hf.config.num_experts_per_tok
    routed = np.zeros((len(ids), len(hf.model.layers), top_k), dtype=np.int64)
    hooks = []
    for i, layer in enumerate(hf.model.layers):
        if hasattr(layer.mlp, "gate"):  # (an MoE layer: its router returns the top-k third)

            def keep(module, args, out, i=i):
                routed[:, i] = out[2].reshape(len(ids), top_k).numpy()

            hooks.append(layer.mlp.gate.register_forward_hook(keep))
    try:
        with torch.no_grad():
            hidden = hf.model(torch.tensor([ids])).last_hidden_state[0].numpy()
    finally:
        for h in hooks:
            h.remove()
    assert routed[:, 0].max() == 0 and routed[:, 1:].any()
    return np.sort(routed, -1), hidden


@pytest.fixture(scope="module")
def base(served) -> str:
    """Base URL of the module's `served` server (each server test module defines `served`)."""
    return served[0]


@pytest.fixture(scope="module")
def client(base):
    import openai

    from .serving import TIMEOUT

    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)


def flat_logprobs(positions, ids, k: int | None = None) -> list:
    """vLLM-shaped logprobs (`CompletionOutput.logprobs`, `RequestOutput.prompt_logprobs`)
    as the engine's flat lists: the logprob of each of `ids` at its position, or with `k`
    each position's top-k (token id, logprob) pairs by rank; None where a position has no
    dict (the prompt's first)."""
    if k is None:
        return [None if d is None else d[t].logprob for t, d in zip(ids, positions)]
    return [
        None if d is None else [(t, x.logprob) for t, x in sorted(d.items(), key=_rank)][:k]
        for d in positions
    ]


def _rank(item):
    return item[1].rank


def assert_integrity_catches(engine, corrupt, message: str) -> None:
    """`engine.check_integrity()` (many tests' proof that nothing leaked) raises `message`
    once `corrupt(engine)` has broken what it claims to check, and passes again once the
    undo `corrupt` returned has run."""
    engine.check_integrity()
    undo = corrupt(engine)
    try:
        with pytest.raises(AssertionError, match=message):
            engine.check_integrity()
    finally:
        undo()
    engine.check_integrity()


def synchronous_l3(l3) -> None:
    """Make `l3`'s lookups see every page written before them and end before the step that
    started them goes on. A busy engine steps on while a lookup runs (only an idle one
    waits), so on a slower machine a request was admitted steps later: a test counting
    retractions or L3 hits under page pressure then counted another schedule."""
    prefetch = l3.prefetch

    def waited(rid, *args):
        assert l3.drain()
        prefetch(rid, *args)
        if (lookup := l3._lookups.get(rid)) is not None:
            lookup.done.wait()

    l3.prefetch = waited


def cli_config(*argv: str):
    """The `EngineConfig` a `dsakv` command line gives, nothing started."""
    from dsakv.cli import build_parser, engine_config_from_args
    from dsakv.cli.args import fold_model_option

    args = build_parser().parse_args(list(argv))
    fold_model_option(args)
    return engine_config_from_args(args)


def cli_error_line(argv: list[str], capsys) -> str:
    """The one `error:` line `dsakv argv` exits 2 with."""
    import sys

    from dsakv.cli import main

    with pytest.raises(SystemExit) as exc:
        sys.exit(main(argv))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def assert_taken_and_ignored(model: str, engine: list[str], server: list[list[str]], capsys):
    """Flags dsakv takes and ignores change no `EngineConfig`: `engine`'s on serve, serve-pd
    and generate; `server`'s (each a flag and its value) on serve and serve-pd, which
    generate does not take (one error line each)."""
    plain = cli_config("serve", model)
    assert cli_config("serve", model, *engine, *sum(server, [])) == plain
    assert cli_config("serve-pd", model, *engine, *sum(server, [])) == plain
    generate = ["generate", model, "--prompt", "x"]
    assert cli_config(*generate, *engine) == cli_config(*generate)
    for flag in server:
        error = cli_error_line([*generate, *flag], capsys)
        assert "unrecognized arguments: " + " ".join(flag) in error
