"""scripts/peer_llamacpp.py without llama.cpp: its argument errors and pure helpers."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "peer_llamacpp.py"


@pytest.fixture(scope="module")
def peer():
    spec = importlib.util.spec_from_file_location("peer_llamacpp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# Captured from llama-batched-bench (llama.cpp 0c1e570, the glm-bench f32 GGUF, a busy machine):
# `-npp 16 -ntg 8 -npl 1,2 -c 64 -fa on -t 1`, stdout and stderr together.
BATCHED_BENCH = """\
0.00.160.135 W load: special_eos_id is not in special_eog_ids - the tokenizer config may be incorrect
0.00.456.882 W llama_context: n_ctx is not divisible by n_seq_max - rounding down to 512

llama_batched_bench: n_kv_max = 512, n_batch = 2048, n_ubatch = 512, flash_attn = 1, \
is_pp_shared = 0, is_tg_separate = 0, n_gpu_layers = -1, n_threads = 1, n_threads_batch = 1

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    16 |      8 |    1 |     24 |    0.879 |    18.21 |    1.013 |     7.90 |    1.892 |    12.69 |
|    16 |      8 |    2 |     48 |    1.283 |    24.94 |    1.910 |     8.38 |    3.193 |    15.03 |

"""

# llama-bench -o json's stdout, trimmed to the fields the script reads and a few more.
LLAMA_BENCH_JSON = """\
[
  {
    "build_commit": "0c1e570",
    "n_prompt": 128,
    "n_gen": 0,
    "avg_ts": 1012.5,
    "stddev_ts": 0.0
  },
  {
    "build_commit": "0c1e570",
    "n_prompt": 1024,
    "n_gen": 0,
    "avg_ts": 801.25,
    "stddev_ts": 0.0
  }
]
"""


def test_parse_batched_bench(peer):
    rows = peer.parse_batched_bench(BATCHED_BENCH)
    assert sorted(rows) == [1, 2]
    assert rows[1] == {"pp": 16, "tg": 8, "s_pp": 18.21, "s_tg": 7.90}
    assert rows[2]["s_tg"] == 8.38
    assert peer.parse_batched_bench("no table here\n| PP | TG |") == {}


def test_parse_llama_bench(peer):
    assert peer.parse_llama_bench(LLAMA_BENCH_JSON) == {128: 1012.5, 1024: 801.25}


def test_compare_tokens_and_logprob_gap(peer):
    assert peer.compare_tokens([1, 2, 3], [1, 2, 3]) == (3, 3, None)
    assert peer.compare_tokens([1, 2, 3], [1, 5, 3]) == (2, 3, 1)
    assert peer.compare_tokens([1, 2], [1, 2, 3]) == (2, 3, 2)
    a = [{1: -0.5, 2: -1.0}, {3: -0.1}]
    b = [{1: -0.5, 2: -1.25}, {4: -0.1}]
    assert peer.logprob_gap(a, b) == 0.25
    assert peer.logprob_gap([], []) == 0


def test_table(peer):
    rates = {"decode 1 req": {"llama.cpp": [50.0, 40.0, 60.0], "dsakv": [100.0, 40.0, 90.0]}}
    header, rule, row = peer.table(rates)
    assert header.startswith("| workload | llama.cpp tok/s | dsakv tok/s")
    assert row == "| decode 1 req | 50.0 (40.0-60.0) | 90.0 (40.0-100.0) | 1.50 (1.00-2.00) |"


def test_find_tools_errors(peer, tmp_path):
    with pytest.raises(peer.PeerError, match="no llama.cpp checkout"):
        peer.find_tools(tmp_path / "absent", "build")
    with pytest.raises(peer.PeerError, match="convert_hf_to_gguf.py not found"):
        peer.find_tools(tmp_path, "build")
    (tmp_path / "convert_hf_to_gguf.py").write_text("")
    with pytest.raises(peer.PeerError, match="no build dir"):
        peer.find_tools(tmp_path, "build")
    bin_dir = tmp_path / "build" / "bin"
    bin_dir.mkdir(parents=True)
    with pytest.raises(peer.PeerError, match="llama-server missing"):
        peer.find_tools(tmp_path, "build")
    for name in peer.BINARIES:
        (bin_dir / name).write_text("")
    tools = peer.find_tools(tmp_path, str(tmp_path / "build"))  # an absolute --build too
    assert tools["llama-bench"] == bin_dir / "llama-bench"


def test_main_one_line_error(peer, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        peer.main(["--llama-cpp", str(tmp_path / "absent"), "--rounds", "0"])
    assert str(e.value) == f"peer_llamacpp: no llama.cpp checkout at {tmp_path / 'absent'}"


def test_argument_errors(peer, capsys):
    with pytest.raises(SystemExit):
        peer.parse_args([])  # --llama-cpp is required
    with pytest.raises(SystemExit):
        peer.parse_args(["--llama-cpp", "x", "--outtype", "q4_0"])
    with pytest.raises(SystemExit):
        peer.parse_args(["--llama-cpp", "x", "--rounds", "-1"])
    args = peer.parse_args(["--llama-cpp", "x", "--npl", "1,8", "--outtype", "bf16"])
    assert args.npl == [1, 8] and args.outtype == ["bf16"] and args.rounds == 4
