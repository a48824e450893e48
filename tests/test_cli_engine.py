"""`dsakv init-tiny` and `dsakv generate` end to end, and their bad-input handling."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from transformers import AutoTokenizer

from dsakv.cli import main
from dsakv.procs import free_port


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli") / "tiny"
    mtp = ["--mtp", "random"]  # (a draft layer for the flags to find; fitting one takes 20 s)
    assert main(["init-tiny", str(d), "--preset", "glm-tiny", "--seed", "3", *mtp]) == 0
    return d


def test_init_tiny_writes_a_loadable_model(tiny_dir):
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["model_type"] == "glm_moe_dsa"
    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    assert tok.decode(tok.encode("héllo", add_special_tokens=False)) == "héllo"
    assert (tiny_dir / "model.safetensors").stat().st_size > 0


def test_generate_json_is_deterministic(tiny_dir, capsys):
    args = [
        "generate",
        str(tiny_dir),
        "--prompt",
        "abc",
        "--prompt",
        "hello there",
        "--max-tokens",
        "6",
        "--ignore-eos",
        "--kv-cache-dtype",
        "fp32",
        "--index-k-dtype",
        "fp32",
        "--num-pages",
        "16",
        "--page-size",
        "16",
        "--json",
    ]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    second = json.loads(capsys.readouterr().out)
    assert [r["token_ids"] for r in first] == [r["token_ids"] for r in second]
    assert [len(r["token_ids"]) for r in first] == [6, 6]
    assert {r["finish_reason"] for r in first} == {"length"}
    # Elided and dense index-K layouts generate the same tokens.
    assert main([*args, "--no-elide-index-k"]) == 0
    dense = json.loads(capsys.readouterr().out)
    assert [r["token_ids"] for r in dense] == [r["token_ids"] for r in first]


@pytest.mark.parametrize(
    "extra",
    [
        ["--max-tokens", "0"],
        ["--temperature", "-1"],
        ["--top-p", "0"],
        ["--kv-cache-dtype", "int3"],
        ["--num-pages", "0"],
        ["--index-topk-pattern", "SFFFFFFF"],
        ["--index-topk-pattern", "FF"],
        ["--device", "tpu"],
        ["--host-pool-gib", "-1"],
        ["--host-pool-gib", "nan"],
        ["--kv-budget-gib", "100000"],  # more than this machine can allocate
        ["--host-pool-gib", "0.0000001"],
        ["--max-model-len", "1"],
        # (a server's: nothing in generate's output carries them)
        ["--enable-return-routed-experts"],
        ["--enable-return-hidden-states"],
        ["--expert-distribution-recorder-mode", "stat"],
        ["--generation-config", "vllm"],  # (its sampling is its own flags')
        ["--override-generation-config", '{"temperature": 1}'],
    ],
)
def test_generate_bad_input_is_one_error_line(tiny_dir, extra, capsys):
    with pytest.raises(SystemExit) as exc:
        sys.exit(main(["generate", str(tiny_dir), "--prompt", "x", *extra]))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err


def test_bad_model_and_preset_exit_2(tmp_path):
    for args in (
        ["generate", str(tmp_path / "missing"), "--prompt", "x"],
        ["init-tiny", str(tmp_path / "m"), "--preset", "nope"],
        ["generate", "--prompt"],
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "dsakv.cli", *args], capture_output=True, text=True
        )
        assert proc.returncode == 2, args
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in proc.stderr


def test_init_tiny_never_writes_over_files(tmp_path, capsys):
    """A non-empty DIR (someone's files, or another model), a file, and a seed torch cannot
    take are each one error line; nothing already there is touched."""
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "afile").write_text("x")
    for args, message in (
        ([str(tmp_path)], "is not empty"),
        ([str(tmp_path / "afile")], "not a directory"),
        ([str(tmp_path / "new"), "--seed", str(10**20)], "--seed"),
    ):
        assert main(["init-tiny", *args, "--mtp", "none"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "notes.txt"]
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_servers_refuse_bad_addresses_before_loading(tiny_dir):
    """A port out of range or in use, a bad host, a router URL that is not http(s), ports
    serve-pd would give twice, engine flags a PD server refuses: one error line each, exit
    2, before any model loads (uvicorn used to fail after it, in its own words)."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = str(busy.getsockname()[1])
        cases = [
            (["serve", str(tiny_dir), "--port", "99999"], "1..65535"),
            (["serve", str(tiny_dir), "--port", taken], "cannot listen"),
            (["serve", str(tiny_dir), "--host", "no.such.host.invalid"], "cannot listen"),
            (["router", "--prefill", "notaurl", "--decode", "http://127.0.0.1:9"], "http(s)"),
            (["router", "--prefill", "http://a:99999", "--decode", "http://b:2"], "http(s)"),
            (
                ["router", "--prefill", "http://a:1", "--decode", "http://b:2", "--port", taken],
                "cannot listen",
            ),  # fmt: skip
            (
                ["serve-pd", str(tiny_dir), "--prefill-port", "9123", "--decode-port", "9123"],
                "must differ",
            ),  # fmt: skip
            (
                ["serve-pd", str(tiny_dir), "--tp", "2", "--dp-attention", "--nnodes", "2"]
                + ["--dist-init-addr", "127.0.0.1:29999"],
                "--dp-attention runs on one machine yet",
            ),
            (["serve-pd", str(tiny_dir), "--pp-size", "2", "--port", taken], "--pp-size > 1"),
        ]
        for args, message in cases:
            proc = subprocess.run(
                [sys.executable, "-m", "dsakv.cli", *args],
                capture_output=True,
                text=True,
                timeout=120,  # (one that starts serving instead fails, not hangs the suite)
            )
            lines = proc.stderr.strip().splitlines()
            assert proc.returncode == 2 and len(lines) == 1, (args, proc.stderr[-2000:])
            assert lines[0].startswith("error:") and message in lines[0], (args, lines)


def _run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dsakv.cli", *args], capture_output=True, text=True, env=env
    )


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("error: ") and "Traceback" not in proc.stderr
    return lines[0]


def test_model_dirs_that_cannot_be_written_are_one_error_line(tmp_path):
    """A path under a regular file, a folder nothing can be created in (/proc, whatever the
    permission bits say to root), a $DSAKV_CACHE that is a file: each was a traceback."""
    afile = tmp_path / "afile.txt"
    afile.write_text("mine")
    err = _one_error_line(_run_cli("init-tiny", str(afile / "sub"), "--mtp", "none"))
    assert f"{afile} is not a directory" in err
    if os.path.isdir("/proc"):
        err = _one_error_line(_run_cli("init-tiny", "/proc/dsakv_x", "--mtp", "none"))
        assert "/proc refuses new files" in err
    env = {**os.environ, "DSAKV_CACHE": str(afile)}
    err = _one_error_line(_run_cli("generate", "glm-tiny", "--prompt", "hi", env=env))
    assert "tiny-model cache" in err and f"{afile} is not a directory" in err
    assert afile.read_text() == "mine"


def test_a_file_for_the_model_names_its_folder(tiny_dir):
    err = _one_error_line(_run_cli("generate", str(tiny_dir / "config.json"), "--prompt", "x"))
    assert "is a file, not a model directory" in err and f"give its folder, {tiny_dir}" in err


def test_generate_on_a_model_without_tokenizer_says_so(tiny_dir, tmp_path, capsys):
    """The engine's own message offers token ids, which `generate` has no flag for."""
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).symlink_to(tiny_dir / name)
    assert main(["generate", str(bare), "--prompt", "x", "--num-pages", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no tokenizer, so generate cannot encode text" in err[0], err
    assert "LLM.generate, takes token ids" in err[0]


@pytest.mark.parametrize(
    "extra, both",
    [
        (["--speculative-num-steps", "2"], ("--speculative-num-steps", "--speculative-algorithm")),
        (
            ["--hicache-write-policy", "write_back"],
            ("--hicache-write-policy", "--hicache-storage-backend"),
        ),
        (
            ["--hicache-storage-prefetch-timeout", "1"],
            ("--hicache-storage-prefetch-timeout", "--hicache-storage-backend"),
        ),
        (["--kv-budget-gib", "1", "--num-pages", "8"], ("--num-pages", "--kv-budget-gib")),
    ],
)
def test_flags_that_would_be_ignored_are_refused(tiny_dir, extra, both, capsys):
    """Each was dropped (or, for the pool size, overridden) without a word."""
    with pytest.raises(SystemExit) as exc:
        sys.exit(main(["generate", str(tiny_dir), "--prompt", "x", *extra]))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert all(flag in err[0] for flag in both), err


def test_serve_pd_holds_the_routers_port_while_its_servers_start(tiny_dir, monkeypatch, capsys):
    """serve-pd checked the router's port free, then bound it once both servers were up
    (minutes, on a real model): a process that took it meanwhile failed the router in
    uvicorn's words. Now it is held from the check on and given back at the end."""
    from dsakv.disagg import launch
    from dsakv.errors import DsakvError
    from dsakv.procs import free_port

    from .serving import port_taken

    port, held = free_port(), []

    def wait_healthy(urls, procs, timeout):  # while the servers would be loading
        held.append(port_taken(port))
        raise DsakvError("stopped here")

    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    monkeypatch.setattr(launch, "serve_command", lambda *args: sleeper)
    monkeypatch.setattr(launch, "wait_healthy", wait_healthy)
    assert main(["serve-pd", str(tiny_dir), "--port", str(port)]) == 2
    assert held == [True]
    assert capsys.readouterr().err.strip() == "error: stopped here"
    assert not port_taken(port)


def test_max_model_len_past_the_positions_or_the_pool_is_refused(tiny_dir, capsys):
    """--max-model-len above max_position_embeddings (glm-tiny: 16384), or above what the
    pool holds (8 pages of 64 tokens here), was cut to it without a word; vLLM refuses
    both (its RoPE tables end there; one request could never reach it), and so does dsakv."""
    args = ["generate", str(tiny_dir), "--prompt", "x", "--max-tokens", "1", "--num-pages", "8"]
    for asked, named in (("16385", "16384"), ("513", "512")):
        assert main([*args, "--max-model-len", asked]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"max_model_len {asked}" in err[0] and named in err[0], err
    assert main([*args, "--max-model-len", "512"]) == 0


def test_engine_flags_are_read_from_their_definitions(tiny_dir, tmp_path):
    """`engine_config_from_args` reads every flag `add_engine_args` / `add_storage_args`
    define (a hand-kept list could miss a new one): each is an `EngineConfig` field, or
    turns one off; a flag of the command that is not an engine flag (generate's sampling
    --seed) stays out."""
    import argparse
    from dataclasses import fields

    from dsakv.cli import build_parser, engine_config_from_args
    from dsakv.cli.args import FOLDED, OFF_FLAGS, actions, add_engine_args, add_storage_args
    from dsakv.engine import EngineConfig

    names = {f.name for f in fields(EngineConfig)}
    for action in actions(add_engine_args) + actions(add_storage_args):
        if action.dest in FOLDED:  # (SGLang's / vLLM's, checked and set as dsakv's own)
            assert action.help == argparse.SUPPRESS, action.dest
            continue
        assert OFF_FLAGS.get(action.dest, (action.dest,))[0] in names, action.dest
    generate = ["generate", str(tiny_dir), "--prompt", "x", "--seed", "5"]
    args = build_parser().parse_args(
        [*generate, "--no-elide-index-k", "--no-prefix-cache", "--host-pool-gib", "0"]
        + ["--disable-deterministic-inference", "--index-topk-freq", "2", "--node-rank", "0"]
    )
    config = engine_config_from_args(args)
    assert (config.elide_index_k, config.enable_prefix_cache) == (False, False)
    assert config.enable_deterministic_inference is False and config.seed == 0
    assert config.index_topk_freq == 2
    storage = ["--hicache-storage-backend", "file", "--hicache-storage-dir", str(tmp_path)]
    config = engine_config_from_args(build_parser().parse_args([*generate, *storage]))
    assert (config.hicache_storage_backend, config.hicache_storage_dir) == ("file", str(tmp_path))


def test_the_command_exits_cleanly_with_an_engine_thread_still_in_torch():
    """Ctrl-C while `dsakv serve` loads leaves its engine thread inside torch; the
    interpreter's exit then aborted the process in C++ ("terminate called without an active
    exception", SIGABRT) about one time in four. Here such a thread is kept busy on purpose
    (the interpreter's exit would abort every time) and the command must still end with
    its own exit code."""
    script = textwrap.dedent(
        """
        import sys, threading, torch
        from dsakv.cli import run
        a = torch.randn(1200, 1200)
        def load():
            while True:
                a @ a
        threading.Thread(target=load, name="dsakv-engine", daemon=True).start()
        sys.argv = ["dsakv", "plan", "glm-5.2", "--no-such-flag"]
        run()
        """
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "terminate called" not in r.stderr, r.stderr
    assert r.returncode == 2, (r.returncode, r.stderr)


def test_ctrl_c_while_torch_imports_ends_the_command_with_130():
    """A Ctrl-C in the second the command spends importing torch printed a 50-line
    traceback, or was swallowed inside torch's imports (the command then ran to the end,
    or failed on a half-loaded numpy). Here the SIGINT lands inside torch's imports every
    time: it must end the command as a Ctrl-C does later on, with 130 and no traceback.
    (A command that loads torch: `dsakv plan` and `router` load none.)"""
    script = textwrap.dedent(
        """
        import os, signal, sys
        signal.signal(signal.SIGINT, signal.default_int_handler)  # (a background job's is off)
        class Interrupt:
            def find_spec(self, name, path=None, target=None):
                if name == "torch._tensor_docs":
                    os.kill(os.getpid(), signal.SIGINT)
                return None
        sys.meta_path.insert(0, Interrupt())
        from dsakv.cli import run
        sys.argv = ["dsakv", "serve", "/no-such-model"]  # (if not interrupted: exit 2, error)
        run()
        """
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stderr, r.stdout) == (130, "", "")


@pytest.mark.parametrize("timeout", ["-1", "0", "nan", "inf"])
def test_serve_pd_checks_the_timeout_before_its_servers_start(
    tiny_dir, timeout, monkeypatch, capsys
):
    """`serve-pd --disaggregation-timeout -1` started both servers, each of which printed
    the error, then printed a third line itself; `serve` takes the same flag."""
    from dsakv.disagg import launch

    started = []
    monkeypatch.setattr(launch, "serve_pd", lambda *args, **kw: started.append(args))
    flag = ["--disaggregation-timeout", timeout]
    for args in (
        ["serve-pd", str(tiny_dir), "--port", "18450", *flag],
        ["serve", str(tiny_dir), "--port", "18451", "--disaggregation-mode", "decode", *flag],
    ):
        with pytest.raises(SystemExit) as exc:
            sys.exit(main(args))
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: argument --disaggregation-timeout")
        assert started == []


def test_init_tiny_refuses_an_empty_path(tmp_path, monkeypatch, capsys):
    """`init-tiny ""` (the current directory to pathlib) said "error:  is not empty"."""
    monkeypatch.chdir(tmp_path)
    assert main(["init-tiny", "", "--mtp", "none"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: init-tiny needs a directory to write into, got an empty path"]
    assert list(tmp_path.iterdir()) == []


def test_engine_arg_past_jsons_limits_is_a_string():
    """`bench --engine-arg KEY=VALUE` takes VALUE as JSON, else as the string it is: JSON's
    nesting limit (a RecursionError, not a JSONDecodeError) was a traceback."""
    from dsakv.cli import build_parser

    deep = "[" * 100000 + "]" * 100000
    args = build_parser().parse_args(["bench", "--serving", "--engine-arg", f"x={deep}"])
    assert args.engine_arg == [("x", deep)]
    args = build_parser().parse_args(["bench", "--serving", "--engine-arg", "num-pages=8"])
    assert args.engine_arg == [("num_pages", 8)]


def _parse_error(argv: list[str], capsys) -> str:
    """The one `error:` line (exit 2) the parser gives `argv`."""
    from dsakv.cli import build_parser

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.mark.parametrize(
    "flags, field, value",
    [
        (["--kv-cache-dtype", "auto"], "kv_cache_dtype", None),  # None: EngineConfig's default
        (["--kv-cache-dtype", "fp8"], "kv_cache_dtype", "fp8_e4m3"),
        (["--kv-cache-dtype", "bfloat16"], "kv_cache_dtype", "bf16"),
        (["--dtype", "half"], "dtype", "float16"),
        (["--dtype", "float"], "dtype", "float32"),
        (["--speculative-algorithm", "NEXTN"], "speculative_algorithm", "mtp"),
        (["--speculative-algorithm", "EAGLE"], "speculative_algorithm", "mtp"),
        (["--speculative-algorithm", "eagle"], "speculative_algorithm", "mtp"),
        (["--tp-size", "2"], "tp", 2),
        (["--tensor-parallel-size", "2"], "tp", 2),
        (["--tp", "2", "--ep-size", "2"], "ep", 2),
        (["--tp", "2", "--expert-parallel-size", "2"], "ep", 2),
        (["--seed", "7"], "seed", 7),
        (["--tp", "2", "--dp-size", "2", "--enable-dp-attention"], "dp_attention", True),
        (["--tp", "2", "--dp", "2", "--enable-dp-attention"], "dp_attention", True),
        (["--tp", "2", "--data-parallel-size", "2", "--dp-attention"], "dp_attention", True),
        (["--data-parallel-size", "2"], "dp_attention", True),  # vLLM's: DP attention, tp 2
        (["--dp-size", "1"], "dp_attention", False),
        (["--chunked-prefill-size", "-1"], "chunked_prefill_size", 16384),  # the positions
        (["--chunked-prefill-size", "-1", "--max-model-len", "900"], "chunked_prefill_size", 900),
        (
            ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3"]
            + ["--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"],
            "speculative_num_steps",
            3,
        ),
        (
            ["--speculative-algorithm", "EAGLE", "--speculative-num-draft-tokens", "4"],
            "speculative_num_steps",
            None,  # dsakv's default 3 drafts: 4 tokens verified
        ),
        (
            ["--speculative-config", '{"method": "deepseek_mtp", "num_speculative_tokens": 2}'],
            "speculative_num_steps",
            2,
        ),
        # vLLM's defaults: the model's own MTP layer, one draft per step
        (["--speculative-config", '{"method": "mtp"}'], "speculative_num_steps", 1),
        (["--speculative-config", '{"num_speculative_tokens": 2}'], "speculative_num_steps", 2),
        (["--speculative-config.method", "mtp"], "speculative_num_steps", 1),
        (["--speculative-config.num_speculative_tokens", "2"], "speculative_num_steps", 2),
        (
            ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}'],
            "speculative_algorithm",
            "mtp",
        ),
        (
            ["--speculative-config.method", "mtp", "--speculative-config.num_speculative_tokens"]
            + ["2"],
            "speculative_num_steps",
            2,
        ),
        (["--max-num-seqs", "3"], "max_running_requests", 3),
        (["--block-size", "32"], "page_size", 32),
        (["--context-length", "900"], "max_model_len", 900),
        (["--max-num-batched-tokens", "700"], "chunked_prefill_size", 700),
        (["--disable-radix-cache"], "enable_prefix_cache", False),
        (["--no-enable-prefix-caching"], "enable_prefix_cache", False),
        (["--enable-prefix-caching"], "enable_prefix_cache", True),
        (["--no-enable-prefix-caching", "--enable-prefix-caching"], "enable_prefix_cache", True),
        (["-tp", "2"], "tp", 2),
        (["-dp", "2"], "dp_attention", True),  # (vLLM's -dp N alone: --tp N --dp-attention)
        (["-tp", "2", "--enable-expert-parallel"], "ep", 2),
        (["-dp", "2", "--enable-expert-parallel"], "ep", 2),
        (["--enable-expert-parallel"], "ep", 1),
        (["--enforce-eager"], "disable_cuda_graph", True),
        (["--swap-space", "2"], "host_pool_gib", 2.0),
        (["--cuda-graph-max-bs", "16"], "cuda_graph_max_bs", 16),
        (["--enable-chunked-prefill"], "chunked_prefill_size", None),  # (vLLM's default)
        (["--no-enable-chunked-prefill"], "chunked_prefill_size", 16384),  # prompts whole
        (["--no-enable-chunked-prefill", "--max-model-len", "900"], "chunked_prefill_size", 900),
        (
            ["--no-enable-chunked-prefill", "--max-num-batched-tokens", "20000"],
            "chunked_prefill_size",
            20000,
        ),
        # SGLang's cap on a step's prompt tokens: binds only where prompts run whole
        (["--max-prefill-tokens", "16384"], "chunked_prefill_size", None),
        (
            ["--max-prefill-tokens", "8192", "--chunked-prefill-size", "8192"],
            "chunked_prefill_size",
            8192,
        ),
        (
            ["--chunked-prefill-size", "-1", "--max-prefill-tokens", "20000"],
            "chunked_prefill_size",
            20000,
        ),
        (
            ["--chunked-prefill-size", "-1", "--max-prefill-tokens", "100"],
            "chunked_prefill_size",
            16384,
        ),
        (["--schedule-policy", "lpm"], "scheduling_policy", "lpm"),
        (["--schedule-policy", "fcfs"], "scheduling_policy", None),
        (["--schedule-policy", "fcfs", "--enable-priority-scheduling"], "priority_sign", -1),
    ],
)
def test_vllm_and_sglang_spellings_mean_dsakvs_own(tiny_dir, flags, field, value, capsys):
    """What users paste from vLLM's / SGLang's GLM-5 and DeepSeek-V3.2 launch commands was
    "invalid choice" or "unrecognized arguments"; each now sets what dsakv's own spelling
    does, on every command that takes it."""
    from dataclasses import fields

    from dsakv.cli import build_parser, engine_config_from_args
    from dsakv.engine import EngineConfig

    if value is None:
        value = {f.name: f.default for f in fields(EngineConfig)}[field]
    for command in ("serve", "serve-pd", "generate"):
        if command == "generate" and field == "seed":
            continue  # (generate's --seed is the requests')
        extra = ["--prompt", "x"] if command == "generate" else []
        args = build_parser().parse_args([command, str(tiny_dir), *extra, *flags])
        config = engine_config_from_args(args)
        assert getattr(config, field) == value, command
        assert config.parallel.dp == (config.tp if config.dp_attention else 1)
    if field in ("kv_cache_dtype", "tp", "ep", "dp_attention"):
        assert main(["plan", "glm-5", *flags, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)[field] == value


def test_dsakvs_own_spellings_stay_what_help_and_errors_name(capsys, monkeypatch):
    """The aliases are read before `choices`: --help lists dsakv's names alone, a bad value
    is one line naming them, and `half` is refused as float16 is where float16 is."""
    from dsakv.cli import build_parser

    monkeypatch.setenv("COLUMNS", "200")  # (no help line wrapped)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--kv-cache-dtype {fp8_e4m3,fp8_ds_mla,bf16,fp32}" in out
    assert "--dtype {auto,float32,bfloat16,float16}" in out
    assert "--speculative-algorithm {mtp,ngram}" in out
    assert "--tp TP tensor-parallel ranks, one process each (also --tp-size," in out
    assert "--tp-size TP" not in out
    for hidden in ("--enable-dp-attention", "--dp-size", "--speculative-config"):
        assert f"[{hidden}" not in out and f"  {hidden}" not in out, hidden  # (usage, list)
    assert "--dp-attention each rank schedules its own requests (also --enable-dp-att" in out
    err = _parse_error(["serve", "m", "--kv-cache-dtype", "fp8_e5m2"], capsys)
    assert "invalid choice: 'fp8_e5m2' (choose from 'fp8_e4m3', 'fp8_ds_mla'" in err
    err = _parse_error(["serve", "m", "--tp-size", "0"], capsys)
    assert "argument --tp-size: must be an integer >= 1, got '0'" in err
    err = _parse_error(["serve", "m", "--speculative-algorithm", "EAGLE3"], capsys)
    assert "invalid choice: 'EAGLE3' (choose from 'mtp', 'ngram')" in err
    calibrate = ["calibrate-pattern", "m", "--dtype"]
    assert _parse_error([*calibrate, "half"], capsys) == _parse_error(
        [*calibrate, "float16"], capsys
    )
    args = build_parser().parse_args([*calibrate, "float", "--kv-cache-dtype", "fp8"])
    assert (args.dtype, args.kv_cache_dtype) == ("float32", "fp8_e4m3")


def test_switches_dsakv_needs_not_are_taken_and_ignored(tiny_dir, capsys):
    """--trust-remote-code (no remote code runs here) and serve's --enable-auto-tool-choice
    (tool_choice "auto" needs no switch) are in every vLLM / SGLang launch command: they
    change nothing."""
    from dsakv.cli import build_parser, engine_config_from_args

    def config(*argv: str):
        return engine_config_from_args(build_parser().parse_args(list(argv)))

    serve = ["serve", str(tiny_dir)]
    ignored = ["--trust-remote-code", "--enable-auto-tool-choice"]
    assert config(*serve, *ignored) == config(*serve)
    generate = ["generate", str(tiny_dir), "--prompt", "x"]
    assert config(*generate, "--trust-remote-code") == config(*generate)
    assert config("serve-pd", str(tiny_dir), "--trust-remote-code") == config(*serve)
    err = _parse_error([*generate, "--enable-auto-tool-choice"], capsys)
    assert "unrecognized arguments: --enable-auto-tool-choice" in err


def test_the_engine_seed_is_a_flag_passed_on(tiny_dir, capsys):
    """`EngineConfig.seed` (what unseeded requests' shared generator starts from) had no
    flag: serve takes vLLM's --seed, serve-pd hands it (and the aliased flags, under
    dsakv's names) to its servers, and bench --serving can ask for it."""
    from dsakv.bench.serving_rate import serve_flags
    from dsakv.cli import build_parser
    from dsakv.cli.args import add_engine_args, given_flags
    from dsakv.engine import EngineConfig

    args = build_parser().parse_args(
        ["serve-pd", str(tiny_dir), "--seed", "7", "--tp-size", "2", "--dtype", "half"]
    )
    flags = given_flags(args, add_engine_args)
    assert " ".join(flags) == "--dtype float16 --seed 7 --tp 2", flags
    config = EngineConfig.from_kwargs(str(tiny_dir), seed=3)
    assert serve_flags(config, {"seed": 3}) == ["--seed", "3"]
    err = _parse_error(["serve", "m", "--seed", str(2**64)], capsys)
    assert "--seed: must be an integer in 0..2**64-1" in err


def test_an_api_key_no_client_can_send_is_refused(capsys):
    """`--api-key` of serve, router and serve-pd: empty (an unset `--api-key "$KEY"` left
    every route open) or with a character outside visible ASCII (a space can never match;
    the router failed every request it relayed) is one error line, exit 2."""
    commands = [
        ["serve", "m"],
        ["router", "--prefill", "http://a:1", "--decode", "http://b:1"],
        ["serve-pd", "m"],
    ]
    for command in commands:
        for key, said in [("", "must not be empty"), ("sk ", "' ' at position 2"),
                          ("cl\u00e9", "'\u00e9' at position 2")]:  # fmt: skip
            err = _parse_error([*command, "--api-key", key], capsys)
            assert err.startswith("error: argument --api-key: an API key ") and said in err, err


def test_router_urls_are_one_server_each_and_carry_no_credentials(capsys):
    """`dsakv router`: a server given twice under any spelling (it was twice in the round
    robin, or a prefill server a decode server too), a URL with a user and password, a query,
    a fragment or port 0: one error line (no password in it), exit 2, before it listens."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = str(busy.getsockname()[1])  # (before the fix: "cannot listen", not a hang)
        for decode, said in [
            (["http://b:1", "HTTPS://b:1"], "--decode http://b:1 and --decode HTTPS://b:1"),
            (["http://A:1/"], "--prefill http://a:1 and --decode http://A:1/ are one server"),
            (["http://u:secret@b:1"], "no user or password"),
            (["http://b:1#x"], "no query or fragment"),
            (["http://b:0"], "1..65535"),
        ]:
            flags = [f for url in decode for f in ("--decode", url)]
            assert main(["router", "--prefill", "http://a:1", *flags, "--port", taken]) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and said in err[0] and "secret" not in err[0], err


def test_flags_are_never_abbreviated(capsys):
    """argparse took `--dp 2` (SGLang's) for `--dp-attention`, then failed on "2", and any
    prefix for a flag: each is now the unknown flag it is, on every command (and `--dp`
    SGLang's DP size)."""
    import argparse

    from dsakv.cli import build_parser

    parser = build_parser()
    assert parser.allow_abbrev is False
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert all(p.allow_abbrev is False for p in sub.choices.values())
    args = parser.parse_args(["serve", "m", "--dp", "2"])
    assert (args.dp_size, args.dp_attention) == (("--dp", 2), False)
    assert "unrecognized arguments: --dp-att" in _parse_error(["serve", "m", "--dp-att"], capsys)
    err = _parse_error(["plan", "glm-5", "--kv-budget", "10"], capsys)
    assert "unrecognized arguments: --kv-budget 10" in err


def test_several_served_model_names_reach_the_servers(tiny_dir, monkeypatch):
    """vLLM's `--served-model-name a b` (nargs): serve takes the list, serve-pd hands every
    name to its two servers (it passed the list as one argument)."""
    from dsakv.cli import build_parser
    from dsakv.disagg import launch

    args = build_parser().parse_args(["serve", str(tiny_dir), "--served-model-name", "a", "b/c"])
    assert args.served_model_name == ["a", "b/c"]
    started = []
    monkeypatch.setattr(launch, "serve_pd", lambda *a, **kw: started.append(a))
    port = str(free_port())
    assert main(["serve-pd", str(tiny_dir), "--port", port, "--served-model-name", "a", "b/c"]) == 0
    flags = started[0][1]
    i = flags.index("--served-model-name")
    assert flags[i : i + 3] == ["--served-model-name", "a", "b/c"]


_DP_ATTENTION = ["--tp", "2", "--enable-dp-attention"]
_EAGLE = ["--speculative-algorithm", "EAGLE"]


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--dp-size", "2"], ["--dp-size 2 without DP attention", "sglang-router", "--tp 2 --dp"]),
        (["--tp", "2", "--data-parallel-size", "2"], ["is (as vLLM's) 4 ranks", "--tp 4 --dp"]),
        ([*_DP_ATTENTION, "--dp", "1"], ["--dp 1 with --tp 2", "one DP rank per TP rank"]),
        ([*_DP_ATTENTION, "--dp", "4"], ["--dp 4 with --tp 2", "give --dp 2"]),
        (["--dp", "0"], ["argument --dp: must be an integer >= 1, got '0'"]),
        (["--chunked-prefill-size", "0"], ["an integer >= 1, or -1 (no chunking), got '0'"]),
        (["--chunked-prefill-size", "-2"], ["an integer >= 1, or -1 (no chunking), got '-2'"]),
        ([*_EAGLE, "--speculative-eagle-topk", "4"], ["--speculative-eagle-topk 4", "one chain"]),
        (
            [*_EAGLE, "--speculative-num-steps", "2", "--speculative-num-draft-tokens", "4"],
            ["--speculative-num-draft-tokens 4", "a chain of 2 drafts", "give 3"],
        ),
        ([*_EAGLE, "--speculative-num-draft-tokens", "8"], ["chain of 3 drafts", "give 4"]),
        (["--speculative-eagle-topk", "1"], ["--speculative-eagle-topk needs --speculative-alg"]),
        (["--speculative-num-draft-tokens", "4"], ["--speculative-num-draft-tokens needs"]),
        (
            ["--speculative-config", '{"method": "eagle3", "num_speculative_tokens": 2}'],
            ["takes {"],
        ),
        (["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 0}'], ["dsakv"]),
        (["--speculative-config", "mtp"], ["--speculative-config: dsakv takes {"]),
        (
            [*_EAGLE, "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}'],
            ["--speculative-config and --speculative-algorithm", "give one"],
        ),
        (
            ["--speculative-config.method", "eagle3"]
            + ["--speculative-config.num_speculative_tokens", "2"],
            ['got \'{"method": "eagle3", "num_speculative_tokens": 2}\''],
        ),
        (
            ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}']
            + ["--speculative-config.method", "mtp"],
            ["--speculative-config and --speculative-config.KEY: give one"],
        ),
        (["--max-num-seqs", "0"], ["argument --max-num-seqs: must be an integer >= 1, got '0'"]),
        (["--block-size", "x"], ["argument --block-size: must be an integer >= 1, got 'x'"]),
        (["--context-length", "0"], ["argument --context-length: must be an integer >= 1"]),
        (["--max-num-batched-tokens", "-1"], ["--max-num-batched-tokens: must be an integer >="]),
        (["--load-format", "pt"], ["--load-format: dsakv takes auto or safetensors", "'pt'"]),
        (["--tokenizer-mode", "deepseek_v32"], ["deepseek_v32 is DeepSeek-V3.2's", "glm_moe_dsa"]),
        (["--tokenizer-mode", "slow"], ["--tokenizer-mode: dsakv takes auto or hf or deepseek_v3"]),
        (["--chat-template-content-format", "openai"], ["dsakv takes auto or string"]),
        (["--speculative-config", "{}"], ["--speculative-config: dsakv takes {"]),
        (
            ["-tp", "2", "--ep", "1", "--enable-expert-parallel"],
            ["--enable-expert-parallel splits the experts over all 2 rank(s); --ep 1"],
        ),
        (["-tp", "2", "-dp", "2"], ["-dp 2 with --tp 2 is (as vLLM's) 4 ranks"]),
        (["--revision", "main"], ["--revision: dsakv loads local folders only", "download"]),
        (["--tokenizer-revision", "v1"], ["--tokenizer-revision: dsakv loads local folders"]),
        (["--tokenizer", "org/name"], ["--tokenizer org/name is not a directory", "no Hub"]),
        (["--max-seq-len-to-capture", "8192"], ["vLLM's (gone since", "--cuda-graph-max-bs"]),
        (["--cuda-graph-max-bs", "0"], ["--cuda-graph-max-bs: must be an integer >= 1"]),
        (["--enforce-eager", "--enable-torch-compile"], ["--enforce-eager", "contradict"]),
        (["--tp", "2", "--enable-torch-compile"], ["runs on one rank", "not 2 (--tp 2"]),
        (
            ["--no-enable-chunked-prefill", "--max-num-batched-tokens", "2048"],
            ["budget of 2048", "the context length, 16384", "as vLLM requires"],
        ),
        (["--enable-chunked-prefill", "--chunked-prefill-size", "-1"], ["contradict"]),
        (["--max-prefill-tokens", "100"], ["--max-prefill-tokens 100 is below the 512-token"]),
        (["--schedule-policy", "lof"], ["dsakv takes fcfs or lpm", "got 'lof'"]),
        (["--schedule-policy", "priority"], ["--enable-priority-scheduling", "'priority'"]),
        (
            ["--schedule-policy", "lpm", "--scheduling-policy", "priority"],
            ["--schedule-policy lpm and --scheduling-policy priority: give one"],
        ),
        (["--schedule-policy", "lpm", "--enable-priority-scheduling"], ["by cached prefix"]),
        (["-d", "2"], ["unrecognized arguments: -d 2"]),  # (not -dp: no flag is abbreviated)
        (["-t", "2"], ["unrecognized arguments: -t 2"]),
    ],
)
def test_sglang_and_vllm_flags_dsakv_cannot_honour_are_one_error_line(
    tiny_dir, flags, words, capsys
):
    """SGLang's DP size, chunking switch and EAGLE tree shape, and vLLM's DP size and
    speculative config, where dsakv has no such layout: one `error:` line, exit 2, before
    anything loads (serve's port is taken, then given back)."""
    for command in (["generate", "--prompt", "x"], ["serve", "--port", "23417"]):
        with pytest.raises(SystemExit) as exc:
            sys.exit(main([command[0], str(tiny_dir), *command[1:], *flags]))
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), err
        assert all(w in err[0] for w in words), err


def test_plan_takes_sglangs_dp_attention_as_the_engine_does(capsys):
    """`dsakv plan` lays out what `serve` would run: SGLang's DP-attention launch flags plan
    dsakv's DP attention, and what serve refuses plan refuses."""
    assert main(["plan", "glm-5", "--tp", "8", "--json", "--dp-attention"]) == 0
    own = json.loads(capsys.readouterr().out)
    assert own["dp_attention"] is True
    sglang = ["--tp-size", "8", "--dp-size", "8", "--enable-dp-attention"]
    assert main(["plan", "glm-5", "--json", *sglang]) == 0
    assert json.loads(capsys.readouterr().out) == own
    for flags, words in (
        (["--tp", "8", "--dp", "4", "--enable-dp-attention"], "--dp 4 with --tp 8"),
        (["--tp", "8", "--dp", "8"], "--dp 8 without DP attention"),
    ):
        assert main(["plan", "glm-5", *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], err


def test_no_chunking_prefills_a_long_prompt_in_one_step(tiny_dir):
    """SGLang's `--chunked-prefill-size -1` (refused before): the budget is the context,
    so the first step runs a prompt far past the default 512-token chunk whole and samples
    its first token."""
    from dsakv.cli import build_parser, engine_config_from_args
    from dsakv.engine import Engine, SamplingParams

    prompt = [(7 * i) % 200 + 3 for i in range(1500)]
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    base = ["generate", str(tiny_dir), "--prompt", "x", "--num-pages", "32", "--page-size", "64"]
    for flags, computed in (([], 512), (["--chunked-prefill-size", "-1"], 1500)):
        config = engine_config_from_args(build_parser().parse_args([*base, *flags]))
        engine = Engine(config)
        try:
            req = engine.add_request(prompt, params)
            engine.step()
            assert (req.num_computed, len(req.output_ids)) == (computed, computed // 1500)
        finally:
            engine.close()


def test_serve_pd_passes_sglangs_flags_on_as_dsakvs(tiny_dir):
    """serve-pd's servers get dsakv's flags for what SGLang's / vLLM's meant (the hidden
    spellings are not passed on: a server would get no MTP from a dropped
    --speculative-config)."""
    from dsakv.cli import build_parser, engine_config_from_args
    from dsakv.cli.args import add_engine_args, given_flags

    def passed(*flags: str) -> str:
        args = build_parser().parse_args(["serve-pd", str(tiny_dir), *flags])
        engine_config_from_args(args)
        return " ".join(given_flags(args, add_engine_args))

    sglang = ["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", *_EAGLE]
    sglang += ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1"]
    sglang += ["--speculative-num-draft-tokens", "4", "--chunked-prefill-size", "-1"]
    assert passed(*sglang) == (
        "--chunked-prefill-size 16384 --speculative-algorithm mtp --speculative-num-steps 3 "
        "--tp 2 --dp-attention"
    )
    vllm = '{"method": "deepseek_mtp", "num_speculative_tokens": 2}'
    assert passed("--speculative-config", vllm) == (
        "--speculative-algorithm mtp --speculative-num-steps 2"
    )
    dotted = ["--speculative-config.method", "mtp", "--speculative-config.num_speculative_tokens"]
    vllm_flags = ["--max-num-seqs", "3", "--block-size", "32", "--context-length", "900"]
    vllm_flags += ["--max-num-batched-tokens", "700", "--no-enable-prefix-caching", *dotted, "1"]
    assert passed(*vllm_flags) == (
        "--page-size 32 --chunked-prefill-size 700 --max-running-requests 3 --max-model-len 900 "
        "--no-prefix-cache --speculative-algorithm mtp --speculative-num-steps 1"
    )
    assert passed("--disable-radix-cache", "--enable-prefix-caching") == ""


def test_vllm_switches_for_what_dsakv_does_anyway_change_nothing(tiny_dir, capsys, monkeypatch):
    """vLLM's --load-format and --tokenizer-mode with the values dsakv runs as it is (a
    safetensors checkpoint, transformers' fast tokenizer), serve's --disable-log-requests
    (dsakv logs none) and --uvicorn-log-level info (its server's level) were "unrecognized
    arguments"; they change no engine field, another value is one error line, and --help
    names dsakv's own flags, not the hidden spellings."""
    from dsakv.cli import build_parser, engine_config_from_args

    def config(*argv: str):
        return engine_config_from_args(build_parser().parse_args(list(argv)))

    taken = ["--load-format", "auto", "--load-format", "safetensors", "--tokenizer-mode", "hf"]
    serve, generate = ["serve", str(tiny_dir)], ["generate", str(tiny_dir), "--prompt", "x"]
    server_only = ["--disable-log-requests", "--uvicorn-log-level", "info", "--enable-metrics"]
    server_only += ["--max-log-len", "100"]  # (SGLang's /metrics is always on; no prompt logged)
    server_only += ["--disable-log-stats"]  # (vLLM's: dsakv logs no stats line)
    assert config(*serve, *taken, *server_only) == config(*serve)
    assert config(*generate, *taken, "--tokenizer-mode", "auto") == config(*generate)
    assert config("serve-pd", str(tiny_dir), *taken) == config(*serve)
    assert config(*serve, "--uvicorn-log-level", "debug") == config(*serve)
    err = _parse_error([*serve, "--uvicorn-log-level", "loud"], capsys)
    assert "--uvicorn-log-level: invalid choice: 'loud'" in err
    assert "unrecognized arguments: --disable-log-requests" in _parse_error(
        [*generate, "--disable-log-requests"], capsys
    )
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--max-running-requests MAX_RUNNING_REQUESTS concurrency cap (also --max-num-s" in out
    assert "--no-prefix-cache disable the radix cache (also --disable-radix-cache, --no-ena" in out
    for hidden in ("--max-num-seqs", "--block-size", "--context-length", "--enable-prefix-cach"):
        assert f"[{hidden}" not in out and f"  {hidden}" not in out, hidden


def test_uvicorn_log_level_reaches_the_server(tiny_dir, tmp_path):
    """vLLM's --uvicorn-log-level warning: the server answers, and uvicorn's info lines
    (startup, each request) are not logged; dsakv's own "serving" line is."""
    import httpx

    from .serving import ServerProcess

    server = ServerProcess(tmp_path, "quiet", str(tiny_dir), "--uvicorn-log-level", "warning")
    try:
        server.wait_healthy()
        httpx.get(f"{server.url}/v1/models", timeout=5)
    finally:
        server.stop()
    log = server.log.read_text()
    assert "dsakv: serving 'm'" in log
    assert "Application startup complete" not in log and '"GET /health' not in log, log


def test_the_model_as_sglangs_and_vllms_flag(tiny_dir, capsys):
    """SGLang's --model-path and vLLM's --model name the model as the positional does (on
    generate, serve and serve-pd); the model given twice, differently, is one error line."""
    from dsakv.cli import build_parser, engine_config_from_args
    from dsakv.cli.args import fold_model_option

    def config(*argv: str):
        args = build_parser().parse_args(list(argv))
        fold_model_option(args)
        return engine_config_from_args(args)

    for command in (["serve"], ["serve-pd"], ["generate", "--prompt", "x"]):
        want = config(*command, str(tiny_dir))
        assert config(*command, "--model-path", str(tiny_dir)) == want
        assert config(*command, "--model", str(tiny_dir)) == want
        assert config(*command, str(tiny_dir), "--model", str(tiny_dir)) == want
    code = main(["generate", "glm-tiny", "--model-path", str(tiny_dir), "--prompt", "x"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "the model is given twice" in err[0], err


def test_a_tokenizer_from_another_folder_encodes_and_templates(tiny_dir, tmp_path):
    """vLLM's --tokenizer DIR (SGLang's --tokenizer-path) was "unrecognized arguments": the
    server encodes with DIR's tokenizer (here one that adds a BOS, which the model's does
    not) and renders chats with DIR's chat template. With vLLM's --disable-uvicorn-access-log
    uvicorn still logs its startup, but no line per request."""
    import httpx
    from transformers import AutoTokenizer

    from dsakv.config.presets import BOS_ID
    from dsakv.models.tiny import write_tokenizer

    from .serving import ServerProcess

    other = tmp_path / "tokenizer"
    write_tokenizer(other, "deepseek_v32")
    tok = AutoTokenizer.from_pretrained(str(other))
    tok.chat_template = (
        "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
        "{% if add_generation_prompt %}=>{% endif %}"
    )
    tok.save_pretrained(str(other))
    templated = tok.encode("<<hi>>=>", add_special_tokens=False)
    flags = ["--tokenizer-path", str(other), "--disable-uvicorn-access-log", "--num-pages", "8"]
    server = ServerProcess(tmp_path, "tok", str(tiny_dir), *flags)
    try:
        server.wait_healthy()

        def post(path: str, **body) -> dict:
            return httpx.post(f"{server.url}{path}", json=body, timeout=60).json()

        assert post("/tokenize", prompt="hi")["tokens"] == [BOS_ID, ord("h"), ord("i")]
        chat = [{"role": "user", "content": "hi"}]
        assert post("/tokenize", messages=chat)["tokens"] == templated
        out = post("/v1/chat/completions", model="m", messages=chat, max_tokens=1)
        assert out["usage"]["prompt_tokens"] == len(templated)
        info = httpx.get(f"{server.url}/model_info", timeout=5).json()
        assert info["tokenizer_path"] == str(other)
    finally:
        server.stop()
    log = server.log.read_text()
    assert "Application startup complete" in log, log
    assert '"POST /tokenize' not in log and '"GET /health' not in log, log


def test_a_tokenizer_past_the_models_vocabulary(tiny_dir, tmp_path, capsys):
    """A tokenizer with an EOS added past the model's vocabulary: as --tokenizer it is
    refused at the start, on one line; as the model's own, that EOS is no stop token the
    model could sample and a bad word of it is the request's error (banned, each failed
    the step mid-request with an IndexError)."""
    import shutil

    from dsakv import LLM, SamplingParams
    from dsakv.errors import DsakvError
    from dsakv.models.tiny import write_tokenizer

    big = tmp_path / "tokenizer"
    write_tokenizer(big)
    tok = AutoTokenizer.from_pretrained(str(big))
    tok.add_special_tokens({"eos_token": "<|end_of_text|>"})  # (id 264: the vocabulary's end)
    tok.save_pretrained(str(big))
    argv = ["generate", str(tiny_dir), "--prompt", "x", "--device", "cpu", "--tokenizer", str(big)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has 265 tokens, more than the model's vocabulary of 264" in err[0]
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    tok.save_pretrained(str(model))
    with LLM(str(model), device="cpu", num_pages=8) as llm:
        params = SamplingParams(max_tokens=4, min_tokens=3, temperature=0)
        assert len(llm.generate("abc", params, use_tqdm=False)[0].token_ids) >= 3
        with pytest.raises(DsakvError, match="bad_words has tokens outside the vocabulary"):
            llm.generate("abc", SamplingParams(bad_words=["<|end_of_text|>"]), use_tqdm=False)
        assert not llm.engine.has_unfinished()


def test_sglangs_log_level_sets_the_loggers_and_uvicorns(tiny_dir, monkeypatch, capsys):
    """SGLang's --log-level was "unrecognized arguments": it sets every logger's level (-v's
    is info; another with -v is one error line) and uvicorn's unless vLLM's
    --uvicorn-log-level says otherwise; serve-pd hands them, and vLLM's
    --disable-uvicorn-access-log, to its two servers."""
    import logging

    from dsakv.cli import build_parser
    from dsakv.cli.args import log_level, uvicorn_log_level
    from dsakv.disagg import launch

    def levels(*flags: str) -> tuple[int, str]:
        args = build_parser().parse_args(["serve", str(tiny_dir), *flags])
        return log_level(args), uvicorn_log_level(args)

    assert levels() == (logging.WARNING, "info")
    assert levels("--log-level", "info") == (logging.INFO, "info")
    assert levels("--log-level", "trace") == (logging.DEBUG, "trace")
    both = ["--log-level", "error", "--uvicorn-log-level", "debug"]
    assert levels(*both) == (logging.ERROR, "debug")
    assert main(["-v", "serve", str(tiny_dir), "--log-level", "error"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: -v (info) and --log-level error disagree: give one"]
    started = []
    monkeypatch.setattr(launch, "serve_pd", lambda *a, **kw: started.append(a))
    flags = ["--log-level", "warning", "--disable-uvicorn-access-log"]
    assert main(["serve-pd", str(tiny_dir), "--port", str(free_port()), *flags]) == 0
    passed = " ".join(started[0][1])
    want = "--uvicorn-log-level warning --log-level warning --disable-uvicorn-access-log"
    assert passed.endswith(want), passed
    assert main(["-v", "serve-pd", str(tiny_dir), "--port", str(free_port())]) == 0
    passed = " ".join(started[1][1])  # (-v reached neither server)
    assert passed.endswith("--uvicorn-log-level info --log-level info"), passed


def test_cuda_graph_max_bs_caps_the_padded_decode_batches(tiny_dir):
    """SGLang's --cuda-graph-max-bs N: decode batches of up to N run padded (captured as
    CUDA graphs on a GPU), larger ones eagerly; the cap was fixed at 128. (The triton
    backend pads its decode steps on a CPU too, where nothing is captured.)"""
    from dsakv.cli import build_parser, engine_config_from_args
    from dsakv.engine import Engine

    base = ["generate", str(tiny_dir), "--prompt", "x", "--device", "cpu", "--num-pages", "8"]
    base += ["--attention-backend", "triton", "--max-num-seqs", "8"]
    for flags, buckets in (([], [1, 2, 4, 8]), (["--cuda-graph-max-bs", "4"], [1, 2, 4])):
        engine = Engine(engine_config_from_args(build_parser().parse_args([*base, *flags])))
        try:
            assert engine.runner.decode_graphs.buckets == buckets
        finally:
            engine.close()


def test_lpm_admits_the_request_with_a_cached_prefix_first(tiny_dir):
    """SGLang's --schedule-policy lpm: of the waiting requests, the one whose prompt the
    prefix cache holds most of is admitted first, ahead of one that came earlier (fcfs
    admits in arrival order)."""
    from dsakv.cli import build_parser, engine_config_from_args
    from dsakv.engine import Engine, SamplingParams

    shared = [(5 * i) % 200 + 3 for i in range(48)]  # three 16-token pages
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    base = ["generate", str(tiny_dir), "--prompt", "x", "--page-size", "16", "--num-pages", "32"]
    base += ["--chunked-prefill-size", "64"]
    for policy, first in (("fcfs", "fresh"), ("lpm", "cached")):
        args = build_parser().parse_args([*base, "--schedule-policy", policy])
        engine = Engine(engine_config_from_args(args))
        try:
            warm = engine.add_request([*shared, 7], params)
            while not warm.finished:
                engine.step()
            longer = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
            fresh = engine.add_request([(3 * i) % 200 + 9 for i in range(60)], longer)
            cached = engine.add_request([*shared, 11, 12, 13], longer)
            engine.step()
            admitted = {fresh.rid: "fresh", cached.rid: "cached"}
            order = [admitted[r.rid] for r in engine.scheduler.running]
            assert order[0] == first, (policy, order)
            assert cached.metrics.prefix_hit_tokens == 48
        finally:
            engine.close()


@pytest.mark.parametrize(
    "engine_args, flags",
    [
        ({"enable_hisparse": True}, ["--enable-hisparse"]),
        (  # (a dict, as --engine-arg parses JSON: Python's repr was no flag value)
            {"enable_hisparse": True, "hisparse_config": {"host_to_device_ratio": 2}},
            ["--enable-hisparse", "--hisparse-config", '{"host_to_device_ratio": 2}'],
        ),
        (
            {"enable_priority_scheduling": True, "schedule_low_priority_values_first": True},
            ["--enable-priority-scheduling", "--schedule-low-priority-values-first"],
        ),
        (  # (dsakv's own "off" switches, and a value no switch gives: the default)
            dict(
                enable_deterministic_inference=False, elide_index_k=True, enable_prefix_cache=False
            ),
            ["--disable-deterministic-inference", "--no-prefix-cache"],
        ),
    ],
)
def test_bench_serving_takes_every_switch_as_an_engine_arg(tiny_dir, engine_args, flags):
    """`bench --serving --engine-arg enable_hisparse=true` (or SGLang's priority switches)
    failed as "unrecognized arguments: True": `serve_flags` knew the switches from a list
    of its own, which missed those added since; it reads them from the CLI now."""
    from dsakv.bench.serving_rate import serve_flags
    from dsakv.engine import EngineConfig

    config = EngineConfig.from_kwargs(str(tiny_dir), **engine_args)
    assert serve_flags(config, engine_args) == flags


def test_bench_serving_hands_a_json_engine_arg_to_serve_as_json(tiny_dir):
    """`bench --serving --engine-arg hisparse_config={...}` failed: the object went to
    `dsakv serve` as Python's repr, and serve's config (that text) was then compared with
    the object. Its JSON goes now, and serve's config is the one asked for."""
    from dataclasses import replace

    from dsakv.bench.serving_rate import serve_flags
    from dsakv.cli import build_parser, engine_config_from_args
    from dsakv.cli.bench import _engine_arg
    from dsakv.engine import EngineConfig

    given = ["enable_hisparse=true", 'hisparse_config={"top_k": 4, "host_to_device_ratio": 3}']
    engine_args = dict(_engine_arg(text) for text in given)  # (as `bench` parses them)
    config = EngineConfig.from_kwargs(str(tiny_dir), **engine_args)
    flags = serve_flags(config, engine_args)
    served = engine_config_from_args(build_parser().parse_args(["serve", str(tiny_dir), *flags]))
    assert json.loads(served.hisparse_config) == engine_args["hisparse_config"]
    assert replace(served, hisparse_config=config.hisparse_config) == config
