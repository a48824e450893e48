"""`dsakv init-tiny` and `dsakv generate` end to end, and their bad-input handling."""

import json
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from dsakv.cli import main


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli") / "tiny"
    assert main(["init-tiny", str(d), "--preset", "glm-tiny", "--seed", "3"]) == 0
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
            (["router", "--prefill", "http://a:1", "--decode", "http://b:2", "--port", taken], "cannot listen"),  # fmt: skip
            (["serve-pd", str(tiny_dir), "--prefill-port", "9123", "--decode-port", "9123"], "must differ"),  # fmt: skip
            (["serve-pd", str(tiny_dir), "--tp", "2"], "one rank"),
        ]
        for args, message in cases:
            proc = subprocess.run(
                [sys.executable, "-m", "dsakv.cli", *args], capture_output=True, text=True
            )
            lines = proc.stderr.strip().splitlines()
            assert proc.returncode == 2 and len(lines) == 1, (args, proc.stderr[-2000:])
            assert lines[0].startswith("error:") and message in lines[0], (args, lines)

