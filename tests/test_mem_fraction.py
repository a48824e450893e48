"""The KV pool sized from GPU memory: SGLang's --mem-fraction-static (and vLLM's
--gpu-memory-utilization, refused). CI has no GPU: the arithmetic the CUDA path runs is
`gpu_kv_budget_bytes` / `static_kv_budget_bytes`, checked here on hand-computed numbers."""

from __future__ import annotations

import math
import socket

import pytest
import torch

from dsakv.cli import build_parser, engine_config_from_args, main
from dsakv.engine import EngineConfig
from dsakv.errors import ConfigError, DsakvError
from dsakv.memory import CacheLayout, plan_capacity
from dsakv.memory.capacity import gpu_kv_budget_bytes, static_kv_budget_bytes

GIB = 1 << 30
FLAGS = ("--mem-fraction-static", "--gpu-memory-utilization")
CPU_DEVICES = ("cpu",) if torch.cuda.is_available() else ("cpu", "auto")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("memfrac") / "tiny"
    mtp = ["--mtp", "random"]  # (a draft layer for the flags to find; fitting one takes 20 s)
    assert main(["init-tiny", str(d), "--preset", "glm-tiny", "--seed", "3", *mtp]) == 0
    return d


def test_static_budget_is_the_fraction_less_what_is_used():
    # An 80 GiB GPU with 50 GiB in use after the load, F 0.85: SGLang's
    # free - total × (1 - F) = 30 - 12 = 18 GiB.
    assert static_kv_budget_bytes(80 * GIB, 0.85, 50 * GIB) == 18 * GIB
    assert static_kv_budget_bytes(80 * GIB, 0.75, 50 * GIB) == 10 * GIB
    assert static_kv_budget_bytes(1000, 1.0, 999) == 1
    # 80 × 0.75 = 60 GiB kept, all of it the weights': nothing for the KV.
    with pytest.raises(ConfigError) as e:
        static_kv_budget_bytes(80 * GIB, 0.75, 60 * GIB)
    assert "weights take 60.00 GiB of 80.00 GiB; --mem-fraction-static 0.75 leaves no KV room" in (
        str(e.value)
    )
    for bad in (0, 1.5, math.nan, -0.1):
        with pytest.raises(ConfigError, match="mem_fraction_static must be in"):
            static_kv_budget_bytes(80 * GIB, bad, GIB)


def test_ranks_get_the_least_ranks_budget_and_one_without_room_refuses_for_all():
    """The engine's CUDA path, SGLang's: each rank's free memory (before, after) the load,
    all-gathered; the pool is after − before × (1 − F), what was in use before the load
    (another process, the CUDA context) not counted against the fraction."""
    assert gpu_kv_budget_bytes(0.85, [(80 * GIB, 30 * GIB)]) == 18 * GIB
    # 20 GiB held by another process before the load: SGLang's 60 × 0.85 − 30 = 21 GiB
    assert gpu_kv_budget_bytes(0.85, [(60 * GIB, 30 * GIB)]) == 21 * GIB
    # Rank 1 had 5 GiB less free: 25 − 75 × 0.15 = 13.75 GiB for both.
    two = [(80 * GIB, 30 * GIB), (75 * GIB, 25 * GIB)]
    assert gpu_kv_budget_bytes(0.85, two) == int(75 * GIB * 0.85) - 50 * GIB
    with pytest.raises(ConfigError) as e:
        gpu_kv_budget_bytes(0.85, [(80 * GIB, 30 * GIB), (80 * GIB, 10 * GIB)])
    assert "weights of rank 1 take 70.00 GiB of 80.00 GiB" in str(e.value)
    assert "--mem-fraction-static 0.85 leaves no KV room" in str(e.value)
    with pytest.raises(ConfigError) as e:
        gpu_kv_budget_bytes(0.5, [(80 * GIB, 30 * GIB)])
    assert "rank" not in str(e.value) and "take 50.00 GiB of 80.00 GiB" in str(e.value)


def test_plan_sizes_its_budget_with_the_same_function(capsys):
    layout = CacheLayout.for_model("glm-5.2")
    cap = plan_capacity(layout, gpu_memory_gib=80, mem_fraction_static=0.85, weights_gib=50)
    assert cap.kv_budget_bytes == static_kv_budget_bytes(80 * GIB, 0.85, 50 * GIB) == 18 * GIB
    with pytest.raises(ConfigError, match=r"weights and reserve take 62\.00 GiB of 64\.00 GiB"):
        plan_capacity(layout, gpu_memory_gib=64, weights_gib=60, reserve_gib=2)
    argv = ["plan", "glm-5", "--gpu-memory-gib", "10", "--weights-gib", "30"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert "weights take 30.00 GiB of 10.00 GiB; --mem-fraction-static 0.9" in err[0]


@pytest.mark.parametrize("device", CPU_DEVICES)
@pytest.mark.parametrize("field", ["mem_fraction_static", "gpu_memory_utilization"])
def test_engine_config_refuses_a_gpu_fraction_on_the_cpu(device, field):
    with pytest.raises(DsakvError) as e:
        EngineConfig("m", device=device, **{field: 0.85})
    flag = "--" + field.replace("_", "-")
    assert f"{flag} sizes the KV pool from GPU memory" in str(e.value)
    assert "host RAM: give --kv-budget-gib" in str(e.value)


def test_engine_config_takes_sglangs_fraction_on_a_gpu_and_refuses_vllms():
    assert EngineConfig("m", device="cuda", mem_fraction_static=0.85).mem_fraction_static == 0.85
    with pytest.raises(DsakvError, match="--gpu-memory-utilization .* cannot be honoured: give"):
        EngineConfig("m", device="cuda", gpu_memory_utilization=0.9)
    for bad in (0, 1.5, "0.5", math.nan):
        with pytest.raises(DsakvError, match=r"mem_fraction_static must be a number in \(0, 1\]"):
            EngineConfig("m", device="cuda", mem_fraction_static=bad)


@pytest.mark.parametrize(
    "kw, both",
    [
        ({"mem_fraction_static": 0.85, "kv_budget_gib": 1.0}, FLAGS[:1] + ("--kv-budget-gib",)),
        ({"mem_fraction_static": 0.85, "num_pages": 8}, FLAGS[:1] + ("--num-pages",)),
        ({"gpu_memory_utilization": 0.9, "kv_budget_gib": 1.0}, FLAGS[1:] + ("--kv-budget-gib",)),
        ({"mem_fraction_static": 0.85, "gpu_memory_utilization": 0.9}, FLAGS),
        ({"kv_budget_gib": 1.0, "num_pages": 8}, ("--kv-budget-gib", "--num-pages")),
    ],
)
def test_one_way_to_size_the_pool(kw, both):
    with pytest.raises(DsakvError, match="size the KV pool: give one") as e:
        EngineConfig("m", device="cuda", **kw)
    assert all(flag in str(e.value) for flag in both)


def test_an_engine_on_the_cpu_past_its_config_refuses_the_fraction(tiny_dir):
    """The engine's own guard: a config for cuda, the engine handed a CPU device."""
    from dsakv.engine.engine import Engine

    config = EngineConfig(str(tiny_dir), device="cuda", mem_fraction_static=0.85)
    with pytest.raises(DsakvError, match="host RAM: give --kv-budget-gib"):
        Engine(config, device=torch.device("cpu"))


def test_the_flags_parse_on_serve_serve_pd_generate_and_bench(tiny_dir):
    from dsakv.bench import serving_rate

    for command in ("serve", "serve-pd", "generate"):
        extra = ["--prompt", "x"] if command == "generate" else []
        argv = [command, str(tiny_dir), *extra, "--device", "cuda", "--mem-fraction-static", ".85"]
        assert engine_config_from_args(build_parser().parse_args(argv)).mem_fraction_static == 0.85
        argv = [command, str(tiny_dir), *extra, "--gpu-memory-utilization", "0.9"]
        assert build_parser().parse_args(argv).gpu_memory_utilization == 0.9
    args = build_parser().parse_args(
        ["bench", "--serving", "--engine-arg", "mem-fraction-static=0.85"]
    )
    assert args.engine_arg == [("mem_fraction_static", 0.85)]
    engine_args = {"device": "cuda", "mem_fraction_static": 0.85}  # (bench's serving section)
    config = EngineConfig.from_kwargs(str(tiny_dir), **engine_args)
    flags = serving_rate.serve_flags(config, engine_args)
    assert flags == ["--device", "cuda", "--mem-fraction-static", "0.85"]


def _free_port() -> int:
    for port in range(31000, 32000):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 31000-31999")


@pytest.mark.parametrize("flag, value", [(FLAGS[0], "0.85"), (FLAGS[1], "0.9")])
def test_the_cli_refuses_a_gpu_fraction_on_the_cpu_in_one_line(tiny_dir, flag, value, capsys):
    runs = [
        ["generate", str(tiny_dir), "--prompt", "x", "--device", "cpu", flag, value],
        ["serve", str(tiny_dir), "--port", str(_free_port()), "--device", "cpu", flag, value],
        ["bench", "--serving", "--model", str(tiny_dir), "--engine-arg", f"{flag[2:]}={value}"],
    ]
    for argv in runs:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), (argv, err)
        assert flag in err[0] and "give --kv-budget-gib" in err[0], err


def test_the_cli_refuses_two_pool_sizes_and_a_fraction_past_one(tiny_dir, capsys):
    argv = ["generate", str(tiny_dir), "--prompt", "x", "--mem-fraction-static", "0.85"]
    assert main([*argv, "--kv-budget-gib", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--kv-budget-gib and --mem-fraction-static both size" in err[0]
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([*argv[:-1], "1.5"])
    assert e.value.code == 2
    assert "--mem-fraction-static: must be a number in (0, 1]" in capsys.readouterr().err
