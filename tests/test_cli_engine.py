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
