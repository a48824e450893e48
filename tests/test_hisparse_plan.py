"""HiSparse: `HiSparseConfig` and the planner's device/host split (DESIGN.md §13, issue 28)."""

import dataclasses
import json
import subprocess
import sys

import pytest

from dsakv.cli import main
from dsakv.config import HiSparseConfig, ModelConfig, preset
from dsakv.errors import ConfigError
from dsakv.memory import CacheLayout, plan_capacity, plan_hisparse

GLM52 = ModelConfig.resolve("glm-5.2")


def _layout(kv="fp8_ds_mla", **kw):
    return CacheLayout.for_model(GLM52, kv_cache_dtype=kv, **kw)


# --- HiSparseConfig -------------------------------------------------------------------------


@pytest.mark.parametrize("source", [None, "", "  ", "{}", {}])
def test_defaults_follow_the_model(source):
    h = HiSparseConfig.parse(source, GLM52)
    assert h == HiSparseConfig(top_k=2048, device_buffer_size=4096, host_to_device_ratio=2)
    assert h.to_dict() == {"top_k": 2048, "device_buffer_size": 4096, "host_to_device_ratio": 2}


def test_buffer_defaults_to_twice_top_k_and_values_are_kept():
    topk_512 = dataclasses.replace(GLM52, index_topk=512)
    assert HiSparseConfig.parse('{"top_k": 512}', topk_512).device_buffer_size == 1024
    h = HiSparseConfig.parse(
        {"top_k": 1024, "device_buffer_size": 1024, "host_to_device_ratio": 10},
        dataclasses.replace(GLM52, index_topk=1024),
    )
    assert (h.top_k, h.device_buffer_size, h.host_to_device_ratio) == (1024, 1024, 10)
    small = dataclasses.replace(GLM52, index_topk=64)
    assert HiSparseConfig.parse(None, small).device_buffer_size == 128
    # A raw config dict works as the model too.
    assert HiSparseConfig.parse(None, preset("deepseek-v3.2")).top_k == 2048


@pytest.mark.parametrize(
    ("source", "match"),
    [
        ("{top_k: 1}", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ("3", "must be a JSON object"),
        ('{"topk": 2048}', "unknown key.*topk"),
        ('{"top_k": 2048, "ratio": 2, "x": 1}', r"unknown key\(s\) ratio, x"),
        ('{"top_k": "2048"}', "top_k must be an integer"),
        ('{"top_k": 2048.0}', "top_k must be an integer"),
        ('{"top_k": true}', "top_k must be an integer"),
        ('{"top_k": null}', "top_k must be an integer"),
        ('{"top_k": 0}', "top_k must be >= 1"),
        ('{"top_k": -5}', "top_k must be >= 1"),
        ('{"device_buffer_size": 2047}', r"device_buffer_size must be >= 2048 \(top_k 2048\)"),
        # The hot buffer holds what one indexer step selects: top_k is the model's.
        ('{"top_k": 100}', r"top_k 100 must be this model's index_topk \(2048\)"),
        ('{"top_k": 4096, "device_buffer_size": 8192}', "must be this model's index_topk"),
        ('{"device_buffer_size": "big"}', "device_buffer_size must be an integer"),
        ('{"host_to_device_ratio": 0}', "host_to_device_ratio must be >= 1"),
        ('{"host_to_device_ratio": 2.5}', "host_to_device_ratio must be an integer"),
        ('{"host_to_device_ratio": false}', "host_to_device_ratio must be an integer"),
    ],
)
def test_bad_values_are_one_config_error(source, match):
    with pytest.raises(ConfigError, match=match) as exc:
        HiSparseConfig.parse(source, GLM52)
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize(
    "model",
    [
        dataclasses.replace(GLM52, index_topk=0),
        dataclasses.replace(GLM52, index_n_heads=0),
        {k: v for k, v in preset("glm-5.2").items() if k != "index_topk"},
        {"model_type": "deepseek_v3", "num_hidden_layers": 61},
    ],
)
def test_model_without_indexer(model):
    with pytest.raises(ConfigError, match="needs a DSA model with an indexer"):
        HiSparseConfig.parse(None, model)


def test_buffer_past_the_kernels_bound_is_refused():
    """The kernels' sort keys pack a buffer entry's id in 16 bits: a larger buffer was
    accepted, planned, then failed the first decode step with a traceback."""
    from dsakv.config.hisparse import MAX_DEVICE_BUFFER_SIZE
    from dsakv.kernels import hisparse_ops

    assert hisparse_ops.MAX_BUFFER == MAX_DEVICE_BUFFER_SIZE == 65536
    assert HiSparseConfig(2048, 65536).device_buffer_size == 65536
    bound = r"device_buffer_size must be <= 65536 \(the HiSparse kernels"
    with pytest.raises(ConfigError, match=bound):
        HiSparseConfig(2048, 65537)
    with pytest.raises(ConfigError, match=bound):
        HiSparseConfig.parse('{"device_buffer_size": 70000}', GLM52)


def test_direct_construction_is_checked():
    with pytest.raises(ConfigError, match="device_buffer_size must be >= 2048"):
        HiSparseConfig(2048, 1000)
    with pytest.raises(ConfigError, match="host_to_device_ratio must be >= 1"):
        HiSparseConfig(8, 16, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        HiSparseConfig(8, 16).top_k = 4  # type: ignore[misc]


# --- the planner split ----------------------------------------------------------------------

# Issue 28's table: GLM-5.2, fp8_ds_mla latent (656 B × 78 layers), fp8 index-K (132 B),
# 21 full layers: r, dense and elided device bytes per device token, elided/dense device
# tokens, index-K share of device memory dense → elided.
TABLE = [
    (1, 61464, 53940, 1.139, 16.8, 5.1),
    (2, 71760, 56712, 1.265, 28.7, 9.8),
    (5, 102648, 65028, 1.579, 50.2, 21.3),
    (10, 154128, 78888, 1.954, 66.8, 35.1),
]


@pytest.mark.parametrize(("r", "dense_b", "elided_b", "ratio", "share_d", "share_e"), TABLE)
def test_issue_table(r, dense_b, elided_b, ratio, share_d, share_e):
    h = HiSparseConfig.parse({"host_to_device_ratio": r}, GLM52)
    layout = _layout()
    e = plan_hisparse(layout, h, kv_budget_gib=64)
    d = plan_hisparse(layout.dense(), h, kv_budget_gib=64)
    assert e.device_bytes_per_device_token == 78 * 656 + 21 * 132 * r == elided_b
    assert d.device_bytes_per_device_token == 78 * 656 + 78 * 132 * r == dense_b
    assert round(d.device_bytes_per_device_token / e.device_bytes_per_device_token, 3) == ratio
    assert round(100 * d.index_k_share, 1) == share_d
    assert round(100 * e.index_k_share, 1) == share_e
    # Per logical token, elision saves 57 × 132 = 7,524 B at every ratio.
    assert d.device_bytes_per_logical_token - e.device_bytes_per_logical_token == pytest.approx(
        57 * 132
    )
    assert e.device_bytes_per_logical_token == pytest.approx(78 * 656 / r + 21 * 132)
    assert e.host_bytes_per_token == d.host_bytes_per_token == 78 * 656


def test_hot_buffers_at_r10_in_64_gib():
    h = HiSparseConfig.parse('{"host_to_device_ratio": 10}', GLM52)
    layout = _layout()
    e = plan_hisparse(layout, h, kv_budget_gib=64)
    d = plan_hisparse(layout.dense(), h, kv_budget_gib=64)
    assert e.hot_buffer_slots == d.hot_buffer_slots == 4096 + 64 == 4160
    assert (d.concurrent_hot_buffers, e.concurrent_hot_buffers) == (107, 209)
    budget = 64 * 2**30
    assert e.kv_budget_bytes == budget
    assert e.device_tokens == budget // 78888 // 64 * 64 == 871040
    assert d.device_tokens == budget // 154128 // 64 * 64 == 445824
    assert e.logical_tokens == 10 * e.device_tokens
    assert e.host_bytes == e.logical_tokens * 78 * 656
    assert e.device_kv_bytes <= budget < e.device_kv_bytes + 64 * 78888
    assert e.as_dict()["concurrent_hot_buffers"] == 209 and e.as_dict()["elide_index_k"]


def test_hot_buffer_is_the_buffer_and_one_slot_in_whole_pages():
    """The planner counted `device_buffer_size + page_size` slots per hot buffer; the engine
    allocates `ceil((device_buffer_size + 1) / page_size)` pages. They differ unless the
    page size divides the buffer."""
    h = HiSparseConfig.parse('{"device_buffer_size": 2100}', GLM52)
    assert h.buffer_pages(64) == 33
    e = plan_hisparse(_layout(), h, kv_budget_gib=100)
    d = plan_hisparse(_layout().dense(), h, kv_budget_gib=100)
    assert e.hot_buffer_slots == d.hot_buffer_slots == 33 * 64 == 2112
    assert (d.concurrent_hot_buffers, e.concurrent_hot_buffers) == (708, 896)
    assert d.concurrent_hot_buffers == d.device_tokens // 64 // 33
    small = HiSparseConfig(16, 31)
    assert plan_hisparse(_layout(page_size=16), small, kv_budget_gib=1).hot_buffer_slots == 32


def test_split_follows_the_layout():
    h = HiSparseConfig.parse('{"host_to_device_ratio": 1}', GLM52)
    # r = 1 with no hot-buffer saving is the plain cell and the plain capacity.
    for layout in (_layout("fp8_e4m3"), _layout("bf16").dense(), _layout(page_size=16)):
        s = plan_hisparse(layout, h, kv_budget_gib=10)
        assert s.device_bytes_per_device_token == layout.bytes_per_token
        assert s.device_tokens == plan_capacity(layout, kv_budget_gib=10).max_total_num_tokens
    # Draft layers hold index-K too, so they count in N.
    h10 = HiSparseConfig(2048, 4096, 10)
    drafted = plan_hisparse(_layout(draft_layers=1), h10, kv_budget_gib=10)
    assert drafted.device_bytes_per_device_token == 79 * 656 + 22 * 132 * 10
    # A GPU-memory budget is the same budget plan_capacity uses.
    kw = dict(gpu_memory_gib=141, weights_gib=100, reserve_gib=2)
    assert plan_hisparse(_layout(), h10, **kw).kv_budget_bytes == (
        plan_capacity(_layout(), **kw).kv_budget_bytes
    )
    with pytest.raises(ConfigError, match="no memory left"):
        plan_hisparse(_layout(), h10, gpu_memory_gib=10, weights_gib=30)


# --- dsakv plan --enable-hisparse -------------------------------------------------------------

ACCEPT = ["glm-5.2", "--enable-hisparse", "--hisparse-config", '{"host_to_device_ratio": 10}']


def _run(*args):
    return subprocess.run(
        [sys.executable, "-m", "dsakv.cli", "plan", *args], capture_output=True, text=True
    )


def test_acceptance_command_both_latents():
    proc = _run(*ACCEPT, "--kv-cache-dtype", "fp8_ds_mla")
    assert proc.returncode == 0, proc.stderr
    row = next(x for x in proc.stdout.splitlines() if x.startswith("device bytes/device token"))
    assert row.split()[3:5] == ["154,128", "78,888"]
    assert "host:device ratio 10" in proc.stdout and "4,160 slots" in proc.stdout
    assert "66.8%" in proc.stdout and "35.1%" in proc.stdout
    proc = _run(*ACCEPT)  # default fp8_e4m3 latent, 576 B
    assert proc.returncode == 0, proc.stderr
    row = next(x for x in proc.stdout.splitlines() if x.startswith("device bytes/device token"))
    assert row.split()[3:5] == [f"{78 * 576 + 78 * 1320:,}", f"{78 * 576 + 21 * 1320:,}"]
    assert row.split()[3:5] == ["147,888", "72,648"]


def test_plan_json_and_table(capsys):
    assert main(["plan", *ACCEPT, "--kv-cache-dtype", "fp8_ds_mla", "--kv-budget-gib", "64"]) == 0
    out = capsys.readouterr().out
    hot = next(x for x in out.splitlines() if x.startswith("concurrent hot buffers"))
    assert hot.split()[3:5] == ["107", "209"]
    assert main(["plan", *ACCEPT, "--kv-cache-dtype", "fp8_ds_mla", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)["hisparse"]
    assert (r["top_k"], r["device_buffer_size"], r["host_to_device_ratio"]) == (2048, 4096, 10)
    assert r["elided"]["device_bytes_per_device_token"] == 78888
    assert r["dense"]["device_bytes_per_device_token"] == 154128
    assert r["elided"]["host_bytes_per_token"] == 51168
    assert r["device_tokens_elided_over_dense"] == 1.954
    # Without the flag the plan is unchanged.
    assert main(["plan", "glm-5.2", "--json"]) == 0
    assert "hisparse" not in json.loads(capsys.readouterr().out)
    assert main(["plan", "glm-5.2", "--enable-hisparse"]) == 0
    assert "host:device ratio 2" in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra",
    [
        ["--enable-hisparse", "--hisparse-config", "{not json"],
        ["--enable-hisparse", "--hisparse-config", '{"top_k": 0}'],
        ["--enable-hisparse", "--hisparse-config", '{"device_buffer_size": 100}'],
        ["--enable-hisparse", "--hisparse-config", '{"host_to_device_ratio": 0.5}'],
        ["--enable-hisparse", "--hisparse-config", '{"bogus": 1}'],
        ["--hisparse-config", '{"top_k": 2048}'],
        # What every engine command refuses: planned without a word.
        ["--enable-hisparse", "--hisparse-config", '{"top_k": 100}'],
        ["--enable-hisparse", "--hisparse-config", '{"device_buffer_size": 100000000000}'],
        # Past the kernels' 16-bit entry ids, though the device pool holds it.
        ["--enable-hisparse", "--hisparse-config", '{"device_buffer_size": 65537}'],
    ],
)
def test_bad_hisparse_flags_exit_2(extra, capsys):
    """(In this process: `test_acceptance_command_both_latents` runs the command itself.)"""
    with pytest.raises(SystemExit) as exc:
        sys.exit(main(["plan", "glm-5.2", *extra]))
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert exc.value.code == 2 and out == "", out
    assert len(lines) == 1 and lines[0].startswith("error: "), err


def test_plan_refuses_what_the_engine_refuses(capsys):
    """`dsakv plan` planned a top_k other than the model's and a hot buffer larger than the
    device pool; the engine refuses both, in these words."""
    flags = ["glm-5.2", "--enable-hisparse", "--hisparse-config", '{"top_k": 100}']
    assert main(["plan", *flags]) == 2
    assert "top_k 100 must be this model's index_topk (2048)" in capsys.readouterr().err
    # A 4,096-slot buffer + 1 slot is 65 pages of 64; 0.2 GiB holds 4,224 device tokens
    # elided, 3,264 dense: the layout planned (elided unless --no-elide-index-k) decides.
    flags = ["glm-5.2", "--enable-hisparse", "--kv-budget-gib", "0.2"]
    assert main(["plan", *flags]) == 0
    capsys.readouterr()
    assert main(["plan", *flags, "--no-elide-index-k"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert "pool (3264 tokens) holds less than one hot buffer (device_buffer_size 4096 " in err


def test_stages_plan_a_host_latent_each_on_a_node(capsys):
    """Under --pp-size each stage plans its own split (its layers' bytes, its budget), all
    with the least stage's device tokens; a node holds each stage's host latent once (its
    TP ranks map it): the whole model's latent for every logical token."""
    base = ["glm-5.2", "--enable-hisparse", "--tp", "8", "--gpu-memory-gib", "288", "--json"]
    assert main(["plan", *base, "--pp-size", "4"]) == 0
    split = json.loads(capsys.readouterr().out)["hisparse"]["elided"]
    assert main(["plan", *base]) == 0
    latent = json.loads(capsys.readouterr().out)["latent_bytes_per_token"]
    assert (
        len(split["stages_host_bytes"]) == 4 and split["host_bytes"] in split["stages_host_bytes"]
    )
    assert split["host_bytes_per_node"] == sum(split["stages_host_bytes"])
    assert split["host_bytes_per_node"] == split["logical_tokens"] * latent


def test_check_pool_is_the_engines_rule():
    h = HiSparseConfig(64, 128)
    h.check_pool(latent_pages=9, page_size=16)  # 129 slots: 9 pages of 16
    with pytest.raises(ConfigError, match=r"pool \(128 tokens\) holds less than one hot buffer"):
        h.check_pool(latent_pages=8, page_size=16)


# --- across ranks (TP, EP, DP attention) ----------------------------------------------------


def _plan(capsys, *flags):
    """`dsakv plan glm-5.2 --enable-hisparse FLAGS`: the table's lines and the JSON."""
    assert main(["plan", "glm-5.2", "--enable-hisparse", *flags]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert main(["plan", "glm-5.2", "--enable-hisparse", *flags, "--json"]) == 0
    return lines, json.loads(capsys.readouterr().out)


def _row(lines, name):
    """A table row's dense and elided cells."""
    return next(x for x in lines if x.startswith(name))[len(name) :].split()[:2]


@pytest.mark.parametrize(
    ("flags", "latents"),
    [
        (["--tp", "8"], 1),
        (["--tp", "8", "--dp-attention"], 8),
        (["--tp", "8", "--dp-attention", "--nnodes", "2"], 4),
        (["--tp", "8", "--nnodes", "2"], 4),
    ],
)
def test_host_memory_per_node_counts_the_host_latents_it_holds(flags, latents, capsys):
    """Under TP on one machine the ranks map one host latent (every rank's is a replica);
    across machines, and under DP attention (its own requests'), each rank holds its own.
    The table gives the node's host memory, and one rank's where each holds its own."""
    lines, r = _plan(capsys, *flags)
    assert any(x.startswith("per rank (8 ranks") for x in lines)
    per_node = _row(lines, "host memory/node (GiB)")
    per_rank = _row(lines, "host memory/rank (GiB)") if latents > 1 else [None, None]
    for cells_rank, cells_node, key in zip(per_rank, per_node, ("dense", "elided"), strict=True):
        split = r["hisparse"][key]
        assert split["host_latents_per_node"] == latents
        assert split["host_bytes_per_node"] == latents * split["host_bytes"]
        assert cells_node == f"{split['host_bytes_per_node'] / 2**30:,.3f}"
        assert cells_rank in (None, f"{split['host_bytes'] / 2**30:,.3f}")
    assert any(x.startswith("host memory/rank") for x in lines) == (latents > 1)
    # One rank: a node's is the rank's, and the table has no row for it.
    lines, r = _plan(capsys)
    assert not any(x.startswith(("host memory/", "per rank")) for x in lines)
    assert r["hisparse"]["elided"]["host_bytes_per_node"] == r["hisparse"]["elided"]["host_bytes"]


def test_nnodes_must_divide_the_ranks(capsys):
    assert main(["plan", "glm-5.2", "--enable-hisparse", "--tp", "8", "--nnodes", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: 8 ranks (--tp 8) are not divisible by --nnodes 3"), err


def test_device_budget_is_the_ranks_own(capsys):
    """Under --gpu-memory-gib the HiSparse split takes the plain plan's budget per rank:
    weights shrink with --tp (and grow under DP attention), so device tokens per rank move
    with them."""
    mem = ["--gpu-memory-gib", "1600"]  # (the bf16 preset: 1,385 GiB of weights on one rank)
    tokens = {}
    for flags in ([], ["--tp", "8"], ["--tp", "8", "--ep", "8"], ["--tp", "8", "--dp-attention"]):
        _, r = _plan(capsys, *mem, *flags)
        split = r["hisparse"]["elided"]
        assert split["kv_budget_bytes"] == r["kv_budget_bytes"], flags
        tokens[" ".join(flags)] = split["device_tokens"]
    assert tokens["--tp 8"] > tokens["--tp 8 --dp-attention"] > tokens[""]
    assert tokens["--tp 8 --ep 8"] > tokens[""]  # (whole experts a rank: weights shrink too)


@pytest.mark.parametrize(
    ("flags", "shared"),
    [
        (dict(tp=2), True),
        (dict(tp=2, ep=2), True),
        (dict(tp=2, dp_attention=True), False),
        (dict(tp=2, nnodes=2), False),  # (one rank a machine: each its own, not rank 0's)
        (dict(tp=2, dp_attention=True, nnodes=2), False),
        (dict(tp=1), False),
    ],
)
def test_the_ranks_share_a_host_latent_only_under_tp_on_one_machine(flags, shared):
    from dsakv.config.hisparse import shares_host_latent
    from dsakv.config.parallel import ParallelConfig

    pc = ParallelConfig(**flags)
    assert shares_host_latent(pc) is shared


def test_plan_reserves_a_slot_for_each_token_of_a_verify(capsys):
    """Under speculative decoding a hot buffer holds (K + 2) × top_k entries by default
    (a verify's union of K + 1 top-k, and one more) and K + 1 reserved slots, as the
    engine's: MTP's default chain with --draft-layers, or --speculative-num-steps K."""
    for flags, buffer, slots in (
        ([], 2 * 2048, 4160),
        (["--draft-layers", "1"], 5 * 2048, 10304),
        (["--speculative-num-steps", "5"], 7 * 2048, 14400),
    ):
        assert main(["plan", "glm-5.2", "--enable-hisparse", *flags, "--json"]) == 0
        r = json.loads(capsys.readouterr().out)["hisparse"]
        assert (r["device_buffer_size"], r["elided"]["hot_buffer_slots"]) == (buffer, slots)
    assert main(["plan", "glm-5.2", "--speculative-num-steps", "2"]) == 2
    assert capsys.readouterr().err == "error: --speculative-num-steps needs --enable-hisparse\n"
