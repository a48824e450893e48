"""The published launch commands for DeepSeek-V3.2 and GLM-5.x (SGLang's docs and cookbook,
vLLM's recipes) run as `dsakv serve` commands, the model swapped for a tiny one: each flag
reaches `EngineConfig` with the meaning it has there, or is taken and ignored where dsakv
does that anyway; a value dsakv cannot honour is one `error:` line, exit 2."""

from __future__ import annotations

import logging

import httpx
import pytest

from dsakv.cli import build_parser, engine_config_from_args
from dsakv.cli.args import add_engine_args, given_flags
from dsakv.engine import Engine
from dsakv.procs import free_port

from .conftest import assert_taken_and_ignored
from .conftest import cli_config as _config
from .conftest import cli_error_line as _error_line

# Placeholders: the model, and the GPUs the recipes run on (they size the pool with
# --mem-fraction-static, which a CPU refuses; nothing here starts an engine).
M, GPU = "{model}", ("--device", "cuda")
MTP_3 = ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3"]
MTP_3 += ["--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
DP_8 = ["--dp", "8", "--enable-dp-attention"]
DOCS_V32 = "https://docs.sglang.io/basic_usage/deepseek_v32.html"
COOKBOOK = "https://docs.sglang.io/cookbook/autoregressive"
RECIPES = "https://github.com/vllm-project/recipes/blob/main"

# (source, model family, the command's flags, fields it sets). The cookbook pages generate
# their commands (`sglang serve ...`) from per-hardware tables; each row is one of them.
# Left out: the NVFP4 / W4AFP8 cells (`--quantization modelopt_fp4` / `w4afp8`: refused
# below).
COMMANDS = [
    (  # DeepSeek-V3.2-Exp with tool calls ("the same as DeepSeek-V3.2 except for the parser")
        DOCS_V32,
        "deepseek",
        ["--model", M, "--tp", "8", *DP_8, "--tool-call-parser", "deepseekv31"]
        + ["--reasoning-parser", "deepseek-v3"],
        {"tp": 8, "dp_attention": True},
    ),
    (DOCS_V32, "deepseek", ["--model", M, "--tp", "8", *DP_8], {"dp_attention": True}),
    (DOCS_V32, "deepseek", ["--model", M, "--tp", "8", "--ep", "8", *DP_8], {"ep": 8}),
    (DOCS_V32, "deepseek", ["--model", M, "--tp", "8"], {"tp": 8, "dp_attention": False}),
    (  # "Launch with TP on MI30x/MI35x"
        DOCS_V32,
        "deepseek",
        ["--model", M, "--tp", "8", "--nsa-prefill-backend", "tilelang"]
        + ["--nsa-decode-backend", "tilelang"],
        {"tp": 8, "attention_backend": "auto"},
    ),
    (
        DOCS_V32,
        "deepseek",
        ["--model", M, "--tp", "8", *DP_8, *MTP_3],
        {"speculative_num_steps": 3},
    ),
    (
        DOCS_V32,
        "deepseek",
        ["--model-path", M, "--trust-remote-code", "--tp-size", "8", "--dp-size", "8"]
        + ["--enable-dp-attention", "--tool-call-parser", "deepseekv32"]
        + ["--reasoning-parser", "deepseek-v3"],
        {"tp": 8, "dp_attention": True},
    ),
    (  # PD disaggregation, the prefill server
        DOCS_V32,
        "deepseek",
        ["--model-path", M, "--disaggregation-mode", "prefill", "--host", "127.0.0.1"]
        + ["--port", "30000", "--tp", "8", *DP_8, "--dist-init-addr", "127.0.0.1:5757"]
        + ["--trust-remote-code", "--disaggregation-bootstrap-port", "8998"]
        + ["--mem-fraction-static", "0.9", *GPU],
        {"mem_fraction_static": 0.9, "dist_init_addr": "127.0.0.1:5757"},
    ),
    (  # H200, every strategy ticked, both parsers
        f"{COOKBOOK}/DeepSeek/DeepSeek-V3_2",
        "deepseek",
        ["--model", M, "--tp", "8", *DP_8, "--ep", "8", *MTP_3]
        + ["--tool-call-parser", "deepseekv32", "--reasoning-parser", "deepseek-v3"],
        {"ep": 8, "speculative_algorithm": "mtp"},
    ),
    (  # MI300X / MI355X
        f"{COOKBOOK}/DeepSeek/DeepSeek-V3_2",
        "deepseek",
        ["--model", M, "--trust-remote-code", "--nsa-prefill-backend", "tilelang"]
        + ["--nsa-decode-backend", "tilelang", "--cuda-graph-max-bs", "64", "--tp", "8"],
        {"cuda_graph_max_bs": 64},
    ),
    (  # H200 FP8, the defaults (GLM-5.1's page gives the same for GLM-5.1-FP8)
        f"{COOKBOOK}/GLM/GLM-5",
        "glm",
        ["--model-path", M, "--tp", "8", "--reasoning-parser", "glm45"]
        + ["--tool-call-parser", "glm47", *MTP_3, "--mem-fraction-static", "0.85", *GPU],
        {"speculative_num_steps": 3, "mem_fraction_static": 0.85},
    ),
    (
        f"{COOKBOOK}/GLM/GLM-5",
        "glm",
        ["--model-path", M, "--tp", "8", *DP_8, "--reasoning-parser", "glm45"]
        + ["--tool-call-parser", "glm47", "--mem-fraction-static", "0.85", *GPU],
        {"dp_attention": True},
    ),
    (  # B200 FP8
        f"{COOKBOOK}/GLM/GLM-5",
        "glm",
        ["--model-path", M, "--tp", "8", "--reasoning-parser", "glm45"]
        + ["--tool-call-parser", "glm47", *MTP_3, "--ep", "1", "--quantization", "fp8"]
        + ["--attention-backend", "nsa", "--nsa-decode-backend", "trtllm"]
        + ["--nsa-prefill-backend", "trtllm", "--moe-runner-backend", "flashinfer_trtllm"]
        + ["--enable-flashinfer-allreduce-fusion", "--mem-fraction-static", "0.9", *GPU],
        {"ep": 1, "attention_backend": "auto", "mem_fraction_static": 0.9},
    ),
    (  # MI300X / MI355X BF16
        f"{COOKBOOK}/GLM/GLM-5.1",
        "glm",
        ["--model-path", M, "--tp", "8", "--trust-remote-code"]
        + ["--nsa-prefill-backend", "tilelang", "--nsa-decode-backend", "tilelang"]
        + ["--chunked-prefill-size", "131072", "--reasoning-parser", "glm45"]
        + ["--tool-call-parser", "glm47", "--mem-fraction-static", "0.80"]
        + ["--watchdog-timeout", "1200", *GPU],
        {"chunked_prefill_size": 131072, "watchdog_timeout": 1200},
    ),
    (  # H200 FP8, low-latency
        f"{COOKBOOK}/GLM/GLM-5.2",
        "glm",
        ["--model-path", M, "--tp", "8", "--speculative-algorithm", "EAGLE"]
        + ["--speculative-num-steps", "5", "--speculative-eagle-topk", "1"]
        + ["--speculative-num-draft-tokens", "6", "--mem-fraction-static", "0.8"]
        + ["--host", "0.0.0.0", "--port", "30000", *GPU],
        {"speculative_num_steps": 5},
    ),
    (  # H200 FP8, balanced
        f"{COOKBOOK}/GLM/GLM-5.2",
        "glm",
        ["--model-path", M, "--tp", "8", *DP_8, "--moe-a2a-backend", "deepep"]
        + ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "1"]
        + ["--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "2"]
        + ["--mem-fraction-static", "0.85", "--chunked-prefill-size", "32768"]
        + ["--max-running-requests", "256", "--host", "0.0.0.0", "--port", "30000", *GPU],
        {"ep": 8, "dp_attention": True, "speculative_num_steps": 1, "max_running_requests": 256},
    ),
    (  # H200 FP8, high-throughput
        f"{COOKBOOK}/GLM/GLM-5.2",
        "glm",
        ["--model-path", M, "--tp", "8", *DP_8, "--moe-a2a-backend", "deepep"]
        + ["--mem-fraction-static", "0.85", "--max-running-requests", "256", *GPU],
        {"ep": 8, "speculative_algorithm": None},
    ),
    (  # MI355X FP8, balanced
        f"{COOKBOOK}/GLM/GLM-5.2",
        "glm",
        ["--model-path", M, "--tp", "8", "--dsa-prefill-backend", "tilelang"]
        + ["--dsa-decode-backend", "tilelang", "--chunked-prefill-size", "32768"]
        + ["--mem-fraction-static", "0.85", "--cuda-graph-max-bs", "128"]
        + ["--max-running-requests", "80", *GPU],
        {"cuda_graph_max_bs": 128, "max_running_requests": 80},
    ),
    (  # "Core HiCache Parameters"
        "https://docs.sglang.io/advanced_features/hicache_best_practices.html",
        "glm",
        ["--model-path", M, "--page-size", "64", "--enable-hierarchical-cache"]
        + ["--hicache-ratio", "2", "--hicache-size", "100", "--hicache-io-backend", "kernel"]
        + ["--hicache-mem-layout", "page_first"],
        {"host_pool_gib": 100e9 / 2**30, "host_pool_ratio": None},
    ),
    (
        f"{RECIPES}/DeepSeek/DeepSeek-V3_2.md",
        "deepseek",
        [M, "--tensor-parallel-size", "8", "--tokenizer-mode", "deepseek_v32"]
        + ["--tool-call-parser", "deepseek_v32", "--reasoning-parser", "deepseek_v3"],
        {"tp": 8},
    ),
    (
        f"{RECIPES}/DeepSeek/DeepSeek-V3_2-Exp.md",
        "deepseek",
        [M, "-dp", "8", "--enable-expert-parallel"],
        {"tp": 8, "ep": 8, "dp_attention": True},
    ),
    (
        f"{RECIPES}/GLM/GLM5.md",
        "glm",
        [M, "--tensor-parallel-size", "8", "--speculative-config.method", "mtp"]
        + ["--speculative-config.num_speculative_tokens", "1", "--tool-call-parser", "glm47"]
        + ["--reasoning-parser", "glm45", "--enable-auto-tool-choice"]
        + ["--served-model-name", "glm-5-fp8"],
        {"speculative_num_steps": 1},
    ),
    (  # GLM-5.1
        "https://docs.vllm.ai/projects/recipes/en/stable/GLM/GLM5.html",
        "glm",
        [M, "--tensor-parallel-size", "8", "--tool-call-parser", "glm47"]
        + ["--reasoning-parser", "glm45", "--enable-auto-tool-choice"]
        + ["--chat-template-content-format=string", "--served-model-name", "glm-5.1-fp8"],
        {"tp": 8},
    ),
]


@pytest.fixture(scope="module")
def models() -> dict[str, str]:
    """Tiny GLM-5 and DeepSeek-V3.2 checkpoints with FP8 weight blocks, as the releases the
    commands serve are (cached; no MTP layer: nothing here drafts)."""
    from dsakv.models.tiny import default_model_dir

    return {
        "glm": str(default_model_dir("glm-tiny", weights="fp8")),
        "deepseek": str(default_model_dir("deepseek-tiny", weights="fp8")),
    }


def test_the_published_commands_run(models):
    """Each command above was "unrecognized arguments" (--nsa-*-backend, --dsa-*-backend,
    --moe-a2a-backend, --quantization, --moe-runner-backend, --enable-hierarchical-cache...),
    or "invalid choice" (--attention-backend nsa): each now gives the config its flags mean."""
    for source, family, flags, want in COMMANDS:
        argv = [models[family] if f == M else f for f in flags]
        config = _config("serve", *argv)
        got = {field: getattr(config, field) for field in want}
        assert got == want, (source, flags)


@pytest.mark.parametrize(
    "flags, field, value",
    [
        (["--max-total-tokens", "4096", "--page-size", "64"], "max_total_tokens", 4096),
        (["--max-total-tokens", "4096", "--num-pages", "8"], "max_total_tokens", 4096),
        (["--max-total-tokens", "4096", "--kv-budget-gib", "2"], "kv_budget_gib", 2.0),
        (["--random-seed", "7"], "seed", 7),
        (["--enable-hierarchical-cache"], "host_pool_ratio", 2.0),  # (SGLang's default)
        (["--enable-hierarchical-cache", "--hicache-ratio", "3.5"], "host_pool_ratio", 3.5),
        (["--enable-hierarchical-cache", "--hicache-size", "8"], "host_pool_gib", 8e9 / 2**30),
        (["--enable-hierarchical-cache", "--hicache-size", "0"], "host_pool_ratio", 2.0),
        # Without the switch SGLang ignores its sizes (0 is --hicache-size's default): no tier
        (["--hicache-size", "0"], "host_pool_gib", 0.0),
        (["--hicache-ratio", "3", "--hicache-size", "8"], "host_pool_ratio", None),
        (["--attention-backend", "dsa"], "attention_backend", "auto"),
        (["--tp", "2", "--moe-a2a-backend", "deepep"], "ep", 2),
        (["--tp", "2", "--moe-a2a-backend", "none"], "ep", 1),
    ],
)
def test_sglangs_flags_mean_dsakvs_own(models, flags, field, value):
    """SGLang's spellings set what dsakv's own flags do, on serve and serve-pd (which hands
    its servers dsakv's flags for them); generate takes the engine's (not its seed: there
    --seed is the requests')."""
    commands = [["serve"], ["serve-pd"]]
    if field != "seed":
        commands.append(["generate", "--prompt", "x"])
    for command in commands:
        config = _config(command[0], models["glm"], *command[1:], *flags)
        assert getattr(config, field) == value, command
    args = build_parser().parse_args(["serve-pd", models["glm"], *flags])
    engine_config_from_args(args)
    passed = _config("serve", models["glm"], *given_flags(args, add_engine_args))
    assert getattr(passed, field) == value


def test_a_pool_ratio_is_resolved_against_the_pool_the_engine_sized(models):
    """SGLang's --hicache-ratio R: the host tier holds R times the device pool's pages,
    counted once the engine has sized the pool (too few for a page is one error)."""
    from dsakv.engine import EngineConfig
    from dsakv.errors import DsakvError

    flags = ["--num-pages", "8", "--enable-hierarchical-cache", "--hicache-ratio", "2.5"]
    engine = Engine(_config("serve", models["glm"], *flags))
    assert (engine.allocator.num_pages, engine.host.num_pages) == (8, 20)
    engine.close()
    few = EngineConfig.from_kwargs(models["glm"], num_pages=8, host_pool_ratio=0.1)
    with pytest.raises(DsakvError, match="0.1 times the 8-page pool holds no page"):
        Engine(few)


def test_max_total_tokens_caps_what_sizes_the_pool_as_sglangs(models):
    """SGLang's --max-total-tokens T is a cap (its model runner: the least of the pool its
    memory sizes and T, in whole pages, a warning where T is more), so it goes with the
    flags that size the pool: SGLang's own commands pair it with --mem-fraction-static. It
    was an exact --num-pages of its own, refused beside them ("both size the KV pool") and
    past the machine's memory ("cannot allocate 47832727 GiB")."""
    glm = models["glm"]
    sglang = ["--max-total-tokens", "65536", "--mem-fraction-static", "0.85", *GPU]
    config = _config("serve", glm, *sglang)
    assert (config.max_total_tokens, config.mem_fraction_static) == (65536, 0.85)
    bytes_ = _config("serve", glm, "--max-total-tokens", "4096", "--kv-cache-memory-bytes", "2G")
    assert (bytes_.max_total_tokens, bytes_.kv_budget_gib) == (4096, 2.0)
    pool = ["--num-pages", "16", "--page-size", "64"]
    capped = Engine(_config("generate", glm, "--prompt", "x", *pool, "--max-total-tokens", "512"))
    assert capped.allocator.num_pages == 8
    capped.close()


def test_a_cap_past_the_pool_leaves_it_with_a_warning(models, caplog):
    pool = ["--num-pages", "16", "--page-size", "64", "--max-total-tokens", str(10**13)]
    with caplog.at_level(logging.WARNING, logger="dsakv.engine.engine"):
        engine = Engine(_config("serve", models["glm"], *pool))
    assert engine.allocator.num_pages == 16
    engine.close()
    assert "--max-total-tokens 10000000000000 is more than the 1024 tokens" in caplog.text


def test_switches_for_what_dsakv_does_anyway_change_nothing(models, capsys):
    """SGLang's kernel choices (its DSA and MoE kernels: dsakv's are --attention-backend's),
    --quantization fp8 on an FP8 checkpoint (read as such), and its switches for what
    dsakv does without them (mixed prefill/decode steps, no overlap scheduler, shared
    experts unfused, xgrammar, cached_tokens reported, no warm-up request): taken, with no
    effect; the server's only by serve."""
    glm = models["glm"]
    engine = ["--quantization", "fp8", "--dsa-prefill-backend", "flashmla_sparse"]
    engine += ["--dsa-decode-backend", "flashmla_kv", "--nsa-prefill-backend", "fa3"]
    engine += ["--nsa-decode-backend", "aiter", "--moe-runner-backend", "deep_gemm"]
    engine += ["--disable-overlap-schedule", "--enable-mixed-chunk"]
    engine += ["--disable-shared-experts-fusion", "--enable-flashinfer-allreduce-fusion"]
    engine += ["--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first"]
    server = [["--grammar-backend", "xgrammar"], ["--enable-cache-report"]]
    server += [["--skip-server-warmup"]]
    assert_taken_and_ignored(glm, engine, server, capsys)


@pytest.mark.parametrize(
    "flags, words",
    [
        (
            ["--quantization", "awq"],
            ["--quantization: dsakv takes fp8", "quantizes nothing", "'awq'"],
        ),
        (["--quantization", "modelopt_fp4"], ["dsakv takes fp8", "'modelopt_fp4'"]),
        (["--grammar-backend", "outlines"], ["dsakv takes xgrammar", "'outlines'"]),
        (["--nsa-decode-backend", "flashattn"], ["--nsa-decode-backend: invalid choice"]),
        (["--moe-a2a-backend", "mooncake"], ["dsakv takes none or deepep", "'mooncake'"]),
        (
            ["--tp", "2", "--ep", "1", "--moe-a2a-backend", "deepep"],
            ["--moe-a2a-backend deepep splits the experts over all 2 rank(s); --ep 1"],
        ),
        (["--max-total-tokens", "63"], ["--max-total-tokens 63 holds no 64-token page"]),
        (["--max-total-tokens", "0"], ["--max-total-tokens: must be an integer >= 1"]),
        (
            ["--enable-hierarchical-cache", "--host-pool-gib", "4"],
            ["--enable-hierarchical-cache and --host-pool-gib both size the host KV tier"],
        ),
        (
            ["--enable-hierarchical-cache", "--hicache-ratio", "0"],
            ["--hicache-ratio: must be a number in (0"],
        ),
        (["--random-seed", "-1"], ["--random-seed: must be an integer in 0..2**64-1"]),
    ],
)
def test_values_dsakv_cannot_honour_are_one_error_line(models, flags, words, capsys):
    """SGLang's values asking for what dsakv does not run (another quantization, grammar
    backend or all-to-all), or sizes that contradict each other: one line, before anything
    loads."""
    port = str(free_port())
    err = _error_line(["serve", models["glm"], "--port", port, *flags], capsys)
    assert all(w in err for w in words), err


HOST_GIB = "--host-pool-gib, --swap-space or SGLang's --hicache-size"
HOST_RATIO = "--host-pool-ratio or SGLang's --enable-hierarchical-cache / --hicache-ratio"
POOL = "ask for a smaller pool (--kv-budget-gib, --num-pages, --max-total-tokens"


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--host-pool-ratio", "1e12"], [f"ask for a smaller host tier ({HOST_RATIO})"]),
        (["--enable-hierarchical-cache", "--hicache-ratio", "1e12"], [HOST_RATIO]),
        (["--host-pool-gib", "1e12"], [f"ask for a smaller host tier ({HOST_GIB})"]),
        (["--swap-space", "1e12"], [HOST_GIB]),
        (["--enable-hierarchical-cache", "--hicache-size", "1e12"], [HOST_GIB]),
        (["--num-pages", str(10**17)], [POOL]),
        (["--num-pages", str(10**25)], [POOL]),  # (past int64)
        (["--kv-budget-gib", "1e12"], [POOL]),
        (["--kv-cache-memory-bytes", "999T"], [POOL]),
    ],
)
def test_a_pool_past_the_machines_memory_is_one_error_line(models, flags, words, capsys):
    """Sizes past int64 bytes were torch's "Storage size calculation overflowed" traceback
    (exit 1), or C++ frames; each pool past what the machine has is now refused before
    torch is asked, naming its size, the memory there is, and the flags that size it."""
    err = _error_line(["generate", models["glm"], "--prompt", "x", *flags], capsys)
    what = "KV cache" if words == [POOL] else "host KV tier"  # (the device pool's, or the tier's)
    assert f"GiB of {what} on the host, which has" in err, err
    assert all(w in err for w in words), err


@pytest.mark.parametrize(
    "flags, given, not_given",
    [
        (
            ["--enable-hierarchical-cache", "--hicache-size", "1e-12"],
            f"the host tier ({HOST_GIB}): 9.31e-13 GiB holds no",
            "host_pool_gib",
        ),
        (
            ["--host-pool-ratio", "1e-9"],
            f"the host tier ({HOST_RATIO}): 1e-09 times the",
            "host_pool_ratio",
        ),
    ],
)
def test_host_tier_errors_name_the_flags_given(models, flags, given, not_given, capsys):
    """A host tier of no page named the field (host_pool_gib: 9.3e-13 GiB ...), not the
    flags given."""
    err = _error_line(["generate", models["glm"], "--prompt", "x", *flags], capsys)
    assert given in err and not_given not in err, err


def test_bench_hands_the_cap_to_its_server(models):
    """`dsakv bench --serving --engine-arg max_total_tokens=T`: the engine field is a
    `dsakv serve` flag the bench's server gets (it was no field: an unknown argument)."""
    from dsakv.bench.serving_rate import serve_flags
    from dsakv.engine import EngineConfig

    config = EngineConfig.from_kwargs(models["glm"], max_total_tokens=4096, num_pages=8)
    assert serve_flags(config, {"max_total_tokens": 4096, "num_pages": 8}) == [
        "--max-total-tokens",
        "4096",
        "--num-pages",
        "8",
    ]


def test_fp8_on_a_checkpoint_without_fp8_blocks_is_refused(glm_tiny, capsys):
    """--quantization fp8 is SGLang's online FP8 on a 16-bit checkpoint, which dsakv does not
    do: one line, not a server that runs the weights unquantized."""
    err = _error_line(["generate", glm_tiny, "--prompt", "x", "--quantization", "fp8"], capsys)
    assert "this checkpoint holds no FP8 blocks" in err and "quantizes nothing" in err


@pytest.fixture(scope="module")
def sglang_server(models, tmp_path_factory):
    """One `dsakv serve` with an SGLang-style command: the pool in tokens, a host tier twice
    its size, the seed, the DSA backends and the switches dsakv takes and ignores."""
    from .serving import TIMEOUT, ServerProcess

    flags = ["--model-path", models["glm"], "--trust-remote-code", "--tp-size", "1"]
    flags += ["--max-total-tokens", "4096", "--page-size", "64", "--random-seed", "7"]
    flags += ["--enable-hierarchical-cache", "--hicache-ratio", "2", "--quantization", "fp8"]
    flags += ["--attention-backend", "nsa", "--nsa-prefill-backend", "flashmla_sparse"]
    flags += ["--nsa-decode-backend", "flashmla_kv", "--enable-mixed-chunk"]
    flags += ["--disable-overlap-schedule", "--skip-server-warmup", "--enable-cache-report"]
    flags += ["--grammar-backend", "xgrammar", "--enable-metrics"]
    server = ServerProcess(tmp_path_factory.mktemp("sglang"), "sglang", models["glm"], *flags)
    try:
        import time

        deadline = time.monotonic() + 4 * TIMEOUT
        while True:
            try:
                if httpx.get(f"{server.url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.proc.poll() is None and time.monotonic() < deadline, server.tail()
            time.sleep(0.2)
        yield server
    finally:
        server.stop()


def test_an_sglang_command_serves(sglang_server):
    """The server answers a completion, with its pool of 4096 tokens in 64 pages and a host
    tier of twice that, as SGLang's --max-total-tokens and --hicache-ratio 2 size them."""
    from .serving import scrape_metrics

    r = httpx.post(
        f"{sglang_server.url}/v1/completions",
        json={
            "model": "m",
            "prompt": "hello",
            "max_tokens": 4,
            "temperature": 0,
            "ignore_eos": True,
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 4
    assert "cached_tokens" in body["usage"]["prompt_tokens_details"]
    metrics = scrape_metrics(sglang_server.url)
    assert metrics["dsakv_kv_pages_total"] == 64
    assert metrics["dsakv_host_pages_total"] == 128
