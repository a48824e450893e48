import json
import os
import subprocess
import sys

import pytest

from dsakv.cli import main


def _plan_json(capsys, *args):
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_sglang_figures(capsys):
    base = ["glm-5.2", "--kv-cache-dtype", "fp8_e4m3", "--index-k-dtype", "fp8"]
    dense = _plan_json(
        capsys, *base, "--draft-layers", "1", "--kv-budget-gib", "134.127", "--no-elide-index-k"
    )
    assert (dense["bytes_per_token"], dense["max_total_num_tokens"]) == (55932, 2574848)
    elided = _plan_json(capsys, *base, "--draft-layers", "1", "--kv-budget-gib", "135.376")
    assert (elided["bytes_per_token"], elided["max_total_num_tokens"]) == (48408, 3002752)
    assert elided["bytes_per_token_dense"] == 55932
    target = _plan_json(capsys, *base, "--draft-layers", "0", "--kv-budget-gib", "100")
    assert (target["bytes_per_token"], target["bytes_per_token_dense"]) == (47700, 55224)
    assert target["num_full_layers"] == 21 and target["num_shared_layers"] == 57
    assert target["indexer_types"][:4] == ["full", "full", "full", "shared"]
    assert target["model_type"] == "glm_moe_dsa" and target["num_layers"] == 78
    assert abs(target["indexer_weight_bytes_saved"] / 2**30 - 0.995) < 0.001
    assert target["max_total_num_tokens_dense"] < target["max_total_num_tokens"]


def test_plan_overrides_and_gpu_budget(capsys):
    r = _plan_json(capsys, "glm-5.2", "--no-index-share", "--kv-budget-gib", "10")
    assert r["num_shared_layers"] == 0 and r["bytes_per_token"] == 55224
    r = _plan_json(
        capsys, "deepseek-v3.2", "--index-topk-freq", "2", "--index-skip-topk-offset", "1"
    )
    assert r["num_full_layers"] == 31
    r = _plan_json(capsys, "glm-5.2", "--gpu-memory-gib", "288", "--tp", "8")
    assert r["max_total_num_tokens"] > 0 and r["weight_bytes_per_rank"] > 0
    # At the same GPU memory the dense layout also pays for every indexer's weights.
    assert r["max_total_num_tokens_dense"] < r["max_total_num_tokens"]


def test_plan_table(capsys):
    assert main(["plan", "glm-5.2"]) == 0
    out = capsys.readouterr().out
    assert "47,700" in out and "55,224" in out and "+15.77%" in out
    assert "FFFSSSFSSSF" in out and "0.995 GiB" in out


def test_plan_from_path(tmp_path, capsys):
    from dsakv.config import preset

    (tmp_path / "config.json").write_text(json.dumps(preset("glm-5.2")))
    assert _plan_json(capsys, str(tmp_path), "--kv-budget-gib", "1")["num_full_layers"] == 21


@pytest.mark.parametrize(
    "args",
    [
        ["plan", "no-such-model"],
        ["plan", "glm-5.2", "--kv-budget-gib", "0"],
        ["plan", "glm-5.2", "--kv-budget-gib", "-3"],
        ["plan", "glm-5.2", "--kv-cache-dtype", "int4"],
        ["plan", "glm-5.2", "--index-k-dtype", "fp4"],
        ["plan", "glm-5.2", "--index-topk-pattern", "SFF"],
        ["plan", "glm-5.2", "--index-topk-pattern", "F" * 77 + "X"],
        ["plan", "glm-5.2", "--index-topk-freq", "0"],
        ["plan", "glm-5.2", "--index-skip-topk-offset", "0"],
        ["plan", "glm-5.2", "--index-topk-pattern", "S" + "F" * 77],
        ["plan", "glm-5.2", "--draft-layers", "-1"],
        ["plan", "glm-5.2", "--tp", "0"],
        ["plan", "glm-5.2", "--page-size", "0"],
        ["plan", "glm-5.2", "--gpu-memory-gib", "8"],
        ["plan", "glm-5.2", "--kv-budget-gib", "inf"],
        ["plan", "glm-5.2", "--kv-budget-gib", "1e400"],
        ["plan", "glm-5.2", "--kv-budget-gib", "1e300"],  # (overflowed into a traceback)
        ["plan", "glm-5.2", "--weights-gib", "1e308", "--gpu-memory-gib", "80"],
        ["plan", "glm-5.2", "--draft-layers", "100000000000"],
        ["plan", "glm-5.2", "--gpu-memory-gib", "80", "--reserve-gib", "-1000"],
        ["plan", "glm-5.2", "--gpu-memory-gib", "288", "--tp", "8", "--weights-gib", "nan"],
        ["plan", "glm-5.2", "--gpu-memory-gib", "nan"],
        ["plan", "glm-5.2", "--gpu-memory-gib", "80", "--mem-fraction-static", "nan"],
        ["plan", "glm-5.2", "--gpu-memory-gib", "80", "--reserve-gib", "inf"],
        ["plan", "glm-5.2", "--kv-budget-gib", "10", "--gpu-memory-gib", "80"],
        ["plan", "glm-5.2", "--kv-budget-gib", "10", "--weights-gib", "5"],
        ["plan", "glm-5.2", "--bogus-flag"],
        ["plan"],
    ],
)
def test_bad_input_is_one_error_line(args, capsys):
    with pytest.raises(SystemExit) as exc:
        sys.exit(main(args))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err


def test_bad_config_files_exit_2(tmp_path, capsys):
    from dsakv.config import preset

    cases = {
        "unknown_type": {**preset("glm-5"), "model_type": "llama", "architectures": []},
        "missing_field": {k: v for k, v in preset("glm-5").items() if k != "kv_lora_rank"},
        "bad_type": {**preset("glm-5"), "indexer_types": 5},
        "bad_range": {**preset("glm-5"), "num_experts_per_tok": 1000},
        "not_utf8": b"\xb8\x00\x00\x00garbage",
        "model_type_list": {**preset("glm-5"), "model_type": ["glm_moe_dsa"]},  # (unhashable)
    }
    for name, cfg in cases.items():
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_bytes(cfg if isinstance(cfg, bytes) else json.dumps(cfg).encode())
        assert main(["plan", str(d)]) == 2, name
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:"), (name, lines)


@pytest.mark.parametrize("dense", [False, True])
def test_reported_weights_are_the_ones_the_budget_subtracted(capsys, dense):
    """`--no-elide-index-k --gpu-memory-gib`: the budget subtracted the dense weights (every
    indexer built) while weight_bytes_per_rank and the text showed the elided ones."""
    flags = ["glm-5.2", "--gpu-memory-gib", "288", "--tp", "8"]
    flags += ["--no-elide-index-k"] if dense else []
    r = _plan_json(capsys, *flags)
    assert abs(int(288 * 0.9 * 2**30) - r["weight_bytes_per_rank"] - r["kv_budget_bytes"]) <= 1
    elided = _plan_json(capsys, "glm-5.2", "--gpu-memory-gib", "288", "--tp", "8")
    extra = r["weight_bytes_per_rank"] - elided["weight_bytes_per_rank"]
    assert extra == (r["indexer_weight_bytes_saved"] if dense else 0)
    assert main(["plan", *flags]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("weights"))
    assert f"{r['weight_bytes_per_rank'] / 2**30:,.3f}" in row.split()[2 if dense else 3]


def test_a_model_directory_wins_over_the_preset_of_its_name(tmp_path, monkeypatch, capsys):
    """`dsakv plan glm-5.2` took the preset though ./glm-5.2 is a model directory, which
    `dsakv generate glm-5.2` takes: one argument, two models."""
    from dsakv.config import preset
    from dsakv.models.tiny import resolve_model_dir

    monkeypatch.chdir(tmp_path)
    (tmp_path / "glm-5.2").mkdir()
    (tmp_path / "glm-5.2" / "config.json").write_text(json.dumps(preset("glm-5")))  # all full
    assert _plan_json(capsys, "glm-5.2")["num_full_layers"] == 78
    assert _plan_json(capsys, "glm-5")["num_full_layers"] == 78  # (no folder: the preset)
    assert _plan_json(capsys, "deepseek-v3.2")["num_layers"] == 61
    # The engine commands' rule, for a tiny preset's name (a folder: no model generated).
    monkeypatch.setenv("DSAKV_CACHE", str(tmp_path / "cache"))
    (tmp_path / "glm-tiny").mkdir()
    (tmp_path / "glm-tiny" / "config.json").write_text("{}")
    assert resolve_model_dir("glm-tiny") == "glm-tiny"
    assert not (tmp_path / "cache").exists()


def test_output_to_a_closed_pipe_exits_quietly():
    """`dsakv plan … | head -1` printed a BrokenPipeError traceback."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsakv.cli", "plan", "glm-5.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.stdout.close()  # the reader is gone before the plan is printed
    err = proc.stderr.read()
    assert proc.wait() == 141 and err == "", err


def test_a_gain_from_nothing_is_not_a_number(capsys):
    """A budget too small for one dense page gave "+0.00%" more tokens from 0 to 64."""
    r = _plan_json(capsys, "glm-5.2", "--kv-budget-gib", "0.003")
    assert (r["max_total_num_tokens_dense"], r["max_total_num_tokens"]) == (0, 64)
    assert r["token_gain_pct"] is None
    assert main(["plan", "glm-5.2", "--kv-budget-gib", "0.003"]) == 0
    out = capsys.readouterr().out
    assert "+0.00%" not in out
    row = next(line for line in out.splitlines() if line.startswith("max_total_num_tokens"))
    assert row.split()[1:] == ["0", "64", "n/a"]


def test_unknown_quantization_needs_the_weights_given(tmp_path, capsys):
    """An unknown quantization_config was priced as bf16 without a word. The budget from
    GPU memory needs the weights: one error line; an explicit budget does not."""
    from dsakv.config import preset

    awq = {**preset("glm-5.2"), "quantization_config": {"quant_method": "awq", "bits": 4}}
    (tmp_path / "config.json").write_text(json.dumps(awq))
    assert main(["plan", str(tmp_path), "--gpu-memory-gib", "80"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "quant_method 'awq'" in err[0] and "--weights-gib" in err[0], err
    r = _plan_json(capsys, str(tmp_path), "--gpu-memory-gib", "80", "--weights-gib", "40")
    assert r["weight_bytes_per_rank"] == 40 * 2**30
    r = _plan_json(capsys, str(tmp_path), "--kv-budget-gib", "10")
    assert r["weight_bytes_per_rank"] is None and r["max_total_num_tokens"] > 0
    assert main(["plan", str(tmp_path), "--kv-budget-gib", "10"]) == 0
    assert "n/a (unknown weights)" in capsys.readouterr().out


def _one_error_line(proc: subprocess.CompletedProcess, code: int = 2) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("error: ") and "Traceback" not in proc.stderr
    return lines[0]


def _run_plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dsakv.cli", "plan", *args], capture_output=True, text=True
    )


def test_json_past_its_limits_is_one_error_line(tmp_path):
    """json.loads refuses an integer of over 4,300 digits with a ValueError and deep nesting
    with a RecursionError, not a JSONDecodeError: config.json and generation_config.json
    gave tracebacks (exit 1)."""
    from dsakv.config import preset

    text = json.dumps(preset("glm-5.2"))
    deep = "[" * 100000 + "]" * 100000
    cases = [  # (config.json, generation_config.json or None, what the error says)
        (text[:-1] + ', "index_topk_freq": ' + "4" * 5000 + "}", None, "4300 digits"),
        (text[:-1] + f', "x": {deep}}}', None, "nested too deeply"),
        (text, deep, "generation_config.json is not a JSON object: nested too deeply"),
    ]
    for i, (config, generation, message) in enumerate(cases):
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / "config.json").write_text(config)
        if generation is not None:
            (tmp_path / str(i) / "generation_config.json").write_text(generation)
        assert message in _one_error_line(_run_plan(str(tmp_path / str(i))))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--weights-gib", "10"], "--weights-gib needs --gpu-memory-gib"),
        (["--reserve-gib", "10"], "--reserve-gib needs --gpu-memory-gib"),
        (["--mem-fraction-static", "0.5"], "--mem-fraction-static needs --gpu-memory-gib"),
        (["--kv-budget-gib", "10", "--reserve-gib", "0"], "--reserve-gib needs --gpu-memory-gib"),
        (["--gpu-memory-gib", "80", "--mem-fraction-static", "0"], "in (0, 1], got '0'"),
        (["--gpu-memory-gib", "80", "--mem-fraction-static", "1.5"], "in (0, 1], got '1.5'"),
    ],
)
def test_gpu_memory_flags_need_gpu_memory(flags, message, capsys):
    """--weights-gib / --reserve-gib without --gpu-memory-gib blamed kv_budget_gib, which the
    CLI had filled in itself; --mem-fraction-static was dropped without a word; its range
    read (0, 1e+12]."""
    with pytest.raises(SystemExit) as exc:
        sys.exit(main(["plan", "glm-5.2", *flags]))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_gpu_memory_flags_size_the_budget(capsys):
    base = ["glm-5.2", "--gpu-memory-gib", "100", "--weights-gib", "40"]
    r = _plan_json(capsys, *base, "--mem-fraction-static", "1", "--reserve-gib", "10")
    assert r["kv_budget_bytes"] == 50 * 2**30
    assert _plan_json(capsys, *base)["kv_budget_bytes"] == int(90 * 2**30) - 40 * 2**30


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
@pytest.mark.parametrize("extra", [[], ["--json"]])
def test_output_that_cannot_be_written_is_one_error_line(extra):
    """`dsakv plan glm-5.2 > /dev/full` was an OSError traceback: now one line, and status 1
    (nothing the user gave was wrong), as other CLIs report a write error."""
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [sys.executable, "-m", "dsakv.cli", "plan", "glm-5.2", *extra],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
        )
    err = _one_error_line(proc, code=1)
    assert "cannot write the output: No space left on device" in err


@pytest.mark.parametrize(("args", "code"), [(["plan", "glm-5.2"], 0), (["plan", "--tp", "0"], 2)])
def test_a_closed_stdout_is_as_if_dev_null(args, code):
    """`dsakv plan glm-5.2 >&-` ended in a traceback (Python leaves sys.stdout None; the
    flush after the command raised), exit 1, after its error line where there was one."""
    proc = subprocess.run(
        [sys.executable, "-m", "dsakv.cli", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: os.close(1),  # noqa: PLW1509 (no threads in this child yet)
        timeout=60,
    )
    assert proc.returncode == code, proc.stderr
    assert proc.stderr.count("\n") == code // 2 and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["plan", "glm-5.2", "--tp", "1e9"], "--tp: must be an integer >= 1, got '1e9'"),
        (["plan", "glm-5.2", "--tp", "0"], "--tp: must be an integer >= 1, got '0'"),
        (
            ["plan", "glm-5.2", "--kv-budget-gib", "ten"],
            "--kv-budget-gib: must be a number in (0, 1e+12], got 'ten'",
        ),
        (
            ["plan", "glm-5.2", "--weights-gib", "x"],
            "--weights-gib: must be a number in [0, 1e+12], got 'x'",
        ),
        (
            ["plan", "glm-5.2", "--mem-fraction-static", "half"],
            "--mem-fraction-static: must be a number in (0, 1], got 'half'",
        ),
        (
            ["plan", "glm-5.2", "--draft-layers", "1.5"],
            "--draft-layers: must be an integer in 0..64, got '1.5'",
        ),
        (
            ["serve", "glm-tiny", "--port", "http"],
            "--port: must be an integer in 1..65535, got 'http'",
        ),
        (
            ["calibrate-pattern", "glm-tiny", "--max-seq-len", "1e9"],
            "--max-seq-len: must be an integer >= 1, got '1e9'",
        ),
    ],
)
def test_unparsable_numbers_say_what_is_wanted(args, message, capsys):
    """argparse named the type function for text it could not parse: "argument --tp: invalid
    _positive_int value: '1e9'"."""
    with pytest.raises(SystemExit) as exc:
        sys.exit(main(args))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: argument {message}"], err


def test_a_plan_the_checkpoint_cannot_run_is_refused(tmp_path, capsys):
    """plan read only the config, so it planned a pattern whose full layers the checkpoint
    has no indexer weights for, which the engine then refused: now plan refuses it too,
    naming the layers (its own pattern, and sharing more, still plan)."""
    from dsakv.models.tiny import write_tiny_model

    model = str(write_tiny_model(tmp_path / "m", preset="glm-tiny", seed=0, mtp="none"))
    assert _plan_json(capsys, model)["num_full_layers"] == 4  # (FFSSFSFS)
    assert _plan_json(capsys, model, "--index-topk-pattern", "FSSSFSSS")["num_full_layers"] == 2
    assert main(["plan", model, "--index-topk-pattern", "FFFSFSFF"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "layer(s) 2, 7 run their indexer in the layer plan FFFSFSFF" in err[0]
    assert "--index-topk-pattern" in err[0]


def test_a_checkpoint_plan_cannot_read_is_refused_as_the_engine_refuses_it(tmp_path, capsys):
    """plan took any error reading the checkpoint for a config-only folder and skipped its
    checks: a cut or corrupt shard, or a broken index, planned (exit 0) what the engine
    refuses. A folder with no safetensors at all still plans from its config."""
    from dsakv.models.tiny import write_tiny_model

    model = write_tiny_model(tmp_path / "m", preset="glm-tiny", seed=0, mtp="none")
    capsys.readouterr()  # (its progress bar)
    shard = (model / "model.safetensors").read_bytes()
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "config.json").write_bytes((model / "config.json").read_bytes())
    (cut / "model.safetensors").write_bytes(shard[:100])
    err = _plan_error(capsys, str(cut))
    assert err.startswith(f"error: cannot read checkpoint file {cut / 'model.safetensors'}")
    (cut / "model.safetensors").unlink()
    (cut / "model.safetensors.index.json").write_text('{"weight_map": ["a list"]}')
    assert "is not a safetensors index" in _plan_error(capsys, str(cut))
    (cut / "model.safetensors.index.json").unlink()
    assert _plan_json(capsys, str(cut))["num_full_layers"] == 4  # (config only)


def test_a_layer_number_past_ints_limit_is_one_error_line(tmp_path, capsys):
    """A tensor named `model.layers.<5,000 digits>...` was a traceback (int() refuses over
    4,300 digits), from plan as from the engine's loader."""
    from dsakv.models.tiny import write_tiny_model

    tiny = write_tiny_model(tmp_path / "tiny", preset="glm-tiny", seed=0, mtp="none")
    capsys.readouterr()  # (its progress bar)
    huge = "model.layers." + "9" * 5000 + ".self_attn.indexer.wk.weight"
    config = json.loads((tiny / "config.json").read_text())
    model = _checkpoint_index(tmp_path / "m", config, [huge])
    err = _plan_error(capsys, model)
    assert "layer(s) 0, 1, 4, 6 run their indexer" in err, err


def _plan_error(capsys, *args: str) -> str:
    """The one `error:` line (exit 2) `dsakv plan ARGS` answers with."""
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--kv-budget-gib", "1e-6"], "elided layout"),
        (["--kv-budget-gib", "0.003", "--no-elide-index-k"], "dense layout"),  # (elided: 64)
        (["--kv-budget-gib", "0.001416", "--pp-size", "2"], "pipeline stage 0"),  # (1: a page)
    ],
)
def test_a_budget_of_less_than_a_page_is_refused(capsys, args, said):
    """A budget that holds no page of the layout asked for planned 0 tokens (exit 0), where
    an engine with that budget refuses to start: now the plan refuses it as the engine does,
    naming the layout (and under --pp-size the stage whose pool holds none)."""
    err = _plan_error(capsys, "glm-5.2", *args)
    assert "the KV budget holds less than one page" in err and said in err, err


def _checkpoint_index(path, config: dict, names: list[str]) -> str:
    """A checkpoint folder as `checkpoint_files` reads it (config.json and a safetensors
    index of `names`): what the plan checks a layer plan against, without the tensors."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    index = {"weight_map": dict.fromkeys(names, "model.safetensors")}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return str(path)


def test_draft_layers_the_engine_cannot_build_are_refused(tmp_path, capsys):
    """The plan priced 2 draft layers, and 1 over a checkpoint without an MTP layer, where the
    engine builds exactly one MTP layer and refuses a checkpoint that has none."""
    from dsakv.config import preset

    assert "dsakv runs one MTP draft layer" in _plan_error(capsys, "glm-5.2", "--draft-layers", "2")
    assert _plan_json(capsys, "deepseek-v3.2", "--draft-layers", "1")["num_draft_layers"] == 1
    config = preset("glm-5.2")
    indexers = [f"model.layers.{i}.self_attn.indexer.wk.weight" for i in range(78)]
    bare = _checkpoint_index(tmp_path / "bare", {**config, "num_nextn_predict_layers": 0}, indexers)
    assert _plan_json(capsys, bare)["num_draft_layers"] == 0
    err = _plan_error(capsys, bare, "--draft-layers", "1")
    assert "has no MTP layer (model.layers.78.*" in err and "needs one" in err, err
    mtp_names = [f"model.layers.78.{n}.weight" for n in ("eh_proj", "self_attn.indexer.wk")]
    mtp = _checkpoint_index(tmp_path / "mtp", config, [*indexers, *mtp_names])
    assert _plan_json(capsys, mtp, "--draft-layers", "1")["bytes_per_token"] == 48408


@pytest.mark.parametrize("group", [0, -16, 1.5, True, "16", None])
def test_a_bad_nvfp4_group_size_is_one_error(tmp_path, capsys, group):
    """A modelopt NVFP4 config's group_size of 0 (or null, or False) was priced as 16 without
    a word, and any other bad one was dropped as "unknown weights" under an explicit budget."""
    from dsakv.config import preset

    q = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": group}
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**preset("glm-5.2"), "quantization_config": q}))
    for budget in (["--kv-budget-gib", "10"], ["--gpu-memory-gib", "288", "--tp", "8"]):
        err = _plan_error(capsys, str(tmp_path), *budget)
        assert "quantization_config.group_size must be an integer >= 1" in err, err
    del q["group_size"]  # (absent: modelopt's 16)
    config.write_text(json.dumps({**preset("glm-5.2"), "quantization_config": q}))
    assert _plan_json(capsys, str(tmp_path))["weight_bytes_per_rank"] is not None
