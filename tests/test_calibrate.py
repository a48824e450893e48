"""`dsakv calibrate-pattern`: the greedy IndexCache search finds provably redundant indexers,
prices patterns as `dsakv plan` does, and writes a config both loaders read the same way."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

import dsakv.calibrate
from dsakv.calibrate import Pricing, calibrate_pattern, check_plot_path, write_config
from dsakv.calibrate.data import calibration_sequences, read_jsonl
from dsakv.cli import main
from dsakv.config import LayerPlan, ModelConfig
from dsakv.errors import DsakvError
from dsakv.memory import CacheLayout, DSAKVPool
from dsakv.models import ForwardBatch, load_model, write_tiny_model
from dsakv.models.tiny import TINY_PRESETS

# Layers whose attention output projection is zeroed: their selection cannot change anything.
DEAD = (3, 5)
SEQ_LEN, NUM_SEQS = 48, 4  # glm-tiny's index_topk is 16, so selection matters past 16


def _search(model_dir, data, **kw):
    return calibrate_pattern(model_dir, data=data, max_seq_len=64, device="cpu", **kw)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """glm-tiny with every layer full (indexer weights on all 8), o_proj of DEAD zeroed."""
    path = tmp_path_factory.mktemp("calib") / "model"
    preset = {**TINY_PRESETS["glm-tiny"], "indexer_types": ["full"] * 8}
    write_tiny_model(path, preset, seed=3, mtp="none")
    file = path / "model.safetensors"
    tensors = load_file(file)
    for layer in DEAD:
        name = f"model.layers.{layer}.self_attn.o_proj.weight"
        tensors[name] = torch.zeros_like(tensors[name])
    save_file(tensors, file, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def sequences():
    """Four sequences; the last is printable ASCII, given as text (byte tokenizer: id = byte)."""
    g = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, 256, (SEQ_LEN - 5 * i,), generator=g).tolist() for i in range(3)]
    return seqs + [torch.randint(32, 127, (SEQ_LEN - 15,), generator=g).tolist()]


@pytest.fixture(scope="module")
def data_file(tmp_path_factory, sequences):
    path = tmp_path_factory.mktemp("data") / "calib.jsonl"
    lines = [json.dumps({"token_ids": s}) for s in sequences[:3]]
    lines.append(json.dumps({"text": bytes(sequences[3]).decode("ascii")}))
    path.write_text("\n".join(lines) + "\n\n")
    return path


@pytest.fixture(scope="module")
def full_search(model_dir, data_file):
    """The whole greedy path, down to layer 0 alone."""
    return _search(model_dir, data_file, num_full_layers=1)


def test_finds_exactly_the_redundant_layers(model_dir, data_file, full_search):
    r = _search(model_dir, data_file, num_full_layers=6)
    assert r.reference.pattern == "F" * 8 and r.no_indexer_layers == ()
    assert r.plan.shared_layers == DEAD and r.final.kl == 0.0
    first = r.history[1].candidates
    assert set(first) == set(range(1, 8))  # layer 0 is never a candidate
    assert all(first[i] == 0.0 for i in DEAD)
    assert all(first[i] > 0.0 for i in set(first) - set(DEAD))
    # A zero-cost share keeps every selection that is actually used.
    assert all(o == 1.0 for i, o in enumerate(r.final.overlap) if i not in DEAD)
    assert r.num_sequences == NUM_SEQS and r.num_tokens == 4 * SEQ_LEN - 30
    # The same path is the prefix of the search to a smaller budget.
    assert [s.pattern for s in full_search.history[:3]] == [s.pattern for s in r.history]


def test_divergence_grows_as_the_budget_shrinks(full_search):
    steps = full_search.history
    assert [s.num_full_layers for s in steps] == list(range(8, 0, -1))
    assert full_search.plan.pattern == "F" + "S" * 7
    kls = [s.kl for s in steps]
    assert all(b >= a for a, b in zip(kls, kls[1:])) and kls[-1] > 0
    # Each step tries every full layer but 0 and keeps the one with the least KL.
    for prev, s in zip(steps, steps[1:]):
        assert set(s.candidates) == {i for i, c in enumerate(prev.pattern) if c == "F" and i}
        assert s.kl == min(s.candidates.values()) and s.candidates[s.shared_layer] == s.kl
        assert (
            s.pattern == prev.pattern[: s.shared_layer] + "S" + prev.pattern[s.shared_layer + 1 :]
        )
    bpt = [s.bytes_per_token for s in steps]
    assert all(b < a for a, b in zip(bpt, bpt[1:]))
    assert min(steps[-1].overlap) < 1.0


def test_same_seed_same_result(model_dir, data_file, full_search):
    again = _search(model_dir, data_file, num_full_layers=1)
    assert [s.to_json() for s in again.history] == [s.to_json() for s in full_search.history]
    # Other seeds only reorder exact ties (which free layer goes first); the plan is the same.
    firsts = {full_search.history[1].shared_layer}
    for seed in (1, 2):
        r = _search(model_dir, data_file, num_full_layers=6, seed=seed)
        assert r.plan.shared_layers == DEAD
        firsts.add(r.history[1].shared_layer)
    assert firsts == set(DEAD)


def _kl(ref_model, model, config, seqs) -> float:
    """Mean KL(ref || model) of next-token distributions, each sequence teacher-forced
    through the plain model forward (not the search's restartable runs)."""
    total, count = 0.0, 0
    for seq in seqs:
        lps = []
        for m in (ref_model, model):
            layout = CacheLayout.from_plan(config, m.plan, "fp32", "fp32", 16)
            pool = DSAKVPool(layout, -(-len(seq) // 16))
            batch = ForwardBatch.from_requests([seq], [torch.arange(len(seq))])
            lps.append(m.compute_logits(m(batch, pool)).log_softmax(-1))
        ref, got = lps
        total += float((ref.exp() * (ref - got)).sum(-1).double().sum())
        count += len(seq)
    return total / count


def test_written_config_loads_with_the_plan(model_dir, data_file, sequences, tmp_path, capsys):
    out, png = tmp_path / "calibrated", tmp_path / "curve.png"
    args = [str(model_dir), "--data", str(data_file), "--max-seq-len", "64", "--json"]
    args += ["--num-full-layers", "4"]
    assert main(["calibrate-pattern", *args, "--write-config", str(out), "--plot", str(png)]) == 0
    r = json.loads(capsys.readouterr().out)
    for key in ("index_topk_pattern", "indexer_types", "kl", "bytes_per_token"):
        assert key in r
    assert len(r["history"]) == 5 and r["history"][-1]["kl"] == r["kl"]
    assert r["indexer_types"] == ["full" if c == "F" else "shared" for c in r["index_topk_pattern"]]
    assert r["index_topk_pattern"].count("F") == 4 and r["kl"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # dsakv reads exactly that plan, and `dsakv plan` prices it the same.
    plan = LayerPlan.from_config(ModelConfig.from_hf(out))
    assert list(plan.indexer_types) == r["indexer_types"]
    assert main(["plan", str(out), "--json"]) == 0
    priced = json.loads(capsys.readouterr().out)
    assert priced["bytes_per_token"] == r["bytes_per_token"]
    assert priced["max_total_num_tokens"] == r["max_total_num_tokens"]

    # transformers honours indexer_types: shared layers build no indexer.
    from transformers import AutoConfig, AutoModelForCausalLM

    assert AutoConfig.from_pretrained(out).indexer_types == r["indexer_types"]
    hf = AutoModelForCausalLM.from_pretrained(out)
    built = ["shared" if x.self_attn.indexer is None else "full" for x in hf.model.layers]
    assert built == r["indexer_types"]

    # A teacher-forced run of the written model reproduces the KL the search reported.
    ref_model, config, ref_plan = load_model(model_dir)
    model, _, loaded = load_model(out)
    assert ref_plan.pattern == "F" * 8 and loaded.pattern == r["index_topk_pattern"]
    assert abs(_kl(ref_model, model, config, sequences) - r["kl"]) < 1e-5


def test_layers_without_indexer_weights_stay_shared(tmp_path, data_file):
    path = write_tiny_model(tmp_path / "m", "glm-tiny", seed=1, mtp="none")  # FFSSFSFS
    r = _search(path, data_file, num_full_layers=2)
    assert r.reference.pattern == "FFSSFSFS" and r.no_indexer_layers == (2, 3, 5, 7)
    assert [s.num_full_layers for s in r.history] == [4, 3, 2]
    assert all(s.pattern[i] == "S" for s in r.history for i in (2, 3, 5, 7))
    assert set(r.history[1].candidates) == {1, 4, 6}


def test_default_data_and_bytes_budget(model_dir, capsys):
    full = CacheLayout.for_model(model_dir, no_index_share=True).bytes_per_token
    per_layer = CacheLayout.for_model(model_dir).index_k_bytes_per_layer
    budget = full - 2 * per_layer - 1  # needs three layers shared
    args = ["calibrate-pattern", str(model_dir), "--target-bytes-per-token", str(budget)]
    assert main([*args, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["num_full_layers"] == 5 and r["bytes_per_token"] <= budget
    assert r["num_tokens"] == 4 * 32  # four built-in texts cut at 2 x index_topk
    assert main(args) == 0  # the text report
    text = capsys.readouterr().out
    assert f"index_topk_pattern: {r['index_topk_pattern']}" in text


@pytest.mark.parametrize(
    "extra, content, message",
    [
        (["--num-full-layers", "0"], None, "--num-full-layers"),
        (["--num-full-layers", "9"], None, "num_full_layers must be in 1..8"),
        (["--target-bytes-per-token", "100"], None, "below what 1 full layer costs"),
        (["--num-full-layers", "2", "--target-bytes-per-token", "9999"], None, "not allowed"),
        (["--data", "missing.jsonl"], None, "no such file"),
        ([], "\n\n", "holds no sequences"),
        ([], '{"token_ids": [1, 2]}\n{"text": "ab"\n', ":2: not valid JSON"),
        # json.loads' limits raise ValueError / RecursionError, not JSONDecodeError (tracebacks)
        ([], '{"token_ids": [' + "1" * 5000 + "]}\n", ":1: not valid JSON: Exceeds the limit"),
        ([], "[" * 100000 + "]" * 100000 + "\n", ":1: not valid JSON: nested too deeply"),
        ([], '{"tokens": [1]}\n', 'expected an object with "text" or "token_ids"'),
        ([], '{"token_ids": [1, 999]}\n', "outside the vocabulary"),
        ([], '{"token_ids": []}\n', "empty sequence"),
        ([], '{"token_ids": [1, 2, 3]}\n', "at most index_topk"),
        # a lone surrogate is valid JSON but no text: the tokenizer raised a TypeError
        ([], '{"text": "ab\\ud800' + "a" * 50 + '"}\n', ':1: "text" holds U+D800 at character 2'),
        ([], bytes(range(128, 256)) * 8, "is not UTF-8 text"),
        (["--kv-budget-gib", "1e300"], None, "--kv-budget-gib"),
        (["--draft-layers", "100000000000"], None, "--draft-layers"),
    ],
)
def test_bad_input_is_one_error_line(model_dir, tmp_path, capsys, extra, content, message):
    args = ["calibrate-pattern", str(model_dir), *extra]
    if isinstance(content, bytes):
        (tmp_path / "d.jsonl").write_bytes(content)
        args += ["--data", str(tmp_path / "d.jsonl")]
    elif content is not None:
        (tmp_path / "d.jsonl").write_text(content)
        args += ["--data", str(tmp_path / "d.jsonl")]
    else:
        args = [a.replace("missing.jsonl", str(tmp_path / "missing.jsonl")) for a in args]
    with pytest.raises(SystemExit) as e:
        raise SystemExit(main(args))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0], err


def test_data_may_be_a_pipe_but_not_a_directory(data_file, tmp_path):
    """`--data <(...)` and /dev/stdin are pipes, not regular files: they were refused as "no
    such file", and so was a directory."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_bytes(data_file.read_bytes()))
    writer.start()
    try:
        assert read_jsonl(fifo) == read_jsonl(data_file)
    finally:  # a writer still waiting for a reader (none came) is let go
        os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
        writer.join()
    with pytest.raises(DsakvError, match="is a directory"):
        read_jsonl(tmp_path)


def test_text_the_tokenizer_refuses_is_one_error(model_dir, monkeypatch):
    """Text that reaches the tokenizer and is refused there (a lone surrogate, which
    read_jsonl now stops first) is a DsakvError, not a TypeError traceback."""
    monkeypatch.setattr(dsakv.calibrate.data, "read_jsonl", lambda path: ["\ud800" + "a" * 50])
    config = ModelConfig.from_hf(model_dir)
    with pytest.raises(DsakvError, match="sequence 1: the tokenizer cannot encode the text"):
        calibration_sequences(model_dir, config, "any.jsonl")


def test_write_config_refuses_a_used_directory(model_dir, tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["calibrate-pattern", str(model_dir), "--write-config", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not empty" in err[0]


def test_write_config_never_writes_through_a_linked_config(model_dir, tmp_path, capsys):
    """A Hugging Face snapshot holds only links, config.json's too: writing into it would
    rewrite the linked blob, another model's config."""
    blob, snap = tmp_path / "blob.json", tmp_path / "snap"
    blob.write_text('{"model_type": "deepseek_v32"}')
    snap.mkdir()
    (snap / "config.json").symlink_to(blob)
    assert main(["calibrate-pattern", str(model_dir), "--write-config", str(snap)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "linked config.json" in err[0], err
    assert blob.read_text() == '{"model_type": "deepseek_v32"}'


def _no_search(*args, **kwargs):
    raise AssertionError("the search ran before the bad flag was refused")


@pytest.fixture
def no_search(monkeypatch):
    """A refusal these tests expect must come before the (long) search."""
    monkeypatch.setattr(dsakv.calibrate, "calibrate_pattern", _no_search)


def _one_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:"), err
    return err[0]


def test_write_config_under_a_file_is_refused_up_front(model_dir, tmp_path, capsys, no_search):
    (tmp_path / "afile").write_text("mine")
    args = ["calibrate-pattern", str(model_dir), "--write-config", str(tmp_path / "afile" / "sub")]
    assert main(args) == 2
    assert "afile is not a directory" in _one_error(capsys)
    assert (tmp_path / "afile").read_text() == "mine"


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="/proc: a folder that takes no files")
def test_outputs_nothing_can_be_created_in_are_refused_up_front(model_dir, capsys, no_search):
    """Permission bits say yes to root and to a read-only mount: the folder is now tried."""
    for flag, where, message in (
        ("--write-config", "/proc/dsakv_cal", "cannot create it under /proc"),
        ("--plot", "/proc/dsakv_kl.png", "cannot write /proc/dsakv_kl.png"),
    ):
        assert main(["calibrate-pattern", str(model_dir), flag, where]) == 2
        assert message in _one_error(capsys)


def test_write_config_inside_the_model_is_refused(model_dir, capsys, no_search):
    """Its links would include DIR itself (DIR/cal -> DIR), and the model would change."""
    assert (
        main(["calibrate-pattern", str(model_dir), "--write-config", str(model_dir / "cal")]) == 2
    )
    assert "inside the model directory" in _one_error(capsys)
    assert not (model_dir / "cal").exists()


def test_write_config_never_links_dir_into_itself(model_dir, tmp_path):
    """A model entry that leads to DIR or above it is not linked: DIR/x -> DIR is a loop."""
    model, out = tmp_path / "model", tmp_path / "out"
    model.mkdir()
    for entry in model_dir.iterdir():
        (model / entry.name).symlink_to(entry)
    (model / "results").symlink_to(out, target_is_directory=True)
    (model / "scratch").symlink_to(tmp_path, target_is_directory=True)
    write_config(model, out, LayerPlan.from_config(ModelConfig.from_hf(model_dir)))
    names = {p.name for p in out.iterdir()}
    assert "model.safetensors" in names and not names & {"results", "scratch"}


def _sharded_copy(dst, seed: int):
    """Another glm-tiny, its weights split in two shards with an index, as large models are."""
    write_tiny_model(dst, "glm-tiny", seed=seed, mtp="none")
    tensors = load_file(dst / "model.safetensors")
    names = sorted(tensors)
    shards = {f"model-0000{i + 1}-of-00002.safetensors": names[i::2] for i in range(2)}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, dst / file, metadata={"format": "pt"})
    (dst / "model.safetensors").unlink()
    weight_map = {n: f for f, part in shards.items() for n in part}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return dst


def test_write_config_over_another_models_output_links_only_this_model(model_dir, tmp_path):
    """An earlier output for a sharded model leaves its index: were it kept, loading DIR
    would read the other model's weights under this config."""
    other = _sharded_copy(tmp_path / "other", seed=9)
    out = tmp_path / "out"
    config = ModelConfig.from_hf(model_dir)
    write_config(other, out, LayerPlan.from_config(ModelConfig.from_hf(other)))
    assert (out / "model.safetensors.index.json").is_symlink()
    write_config(model_dir, out, LayerPlan.from_config(config))
    mine = {p.name for p in model_dir.iterdir() if not p.name.startswith(".")}
    assert {p.name for p in out.iterdir()} == mine
    for p in out.iterdir():
        assert p.name == "config.json" or p.resolve() == (model_dir / p.name).resolve()
    want = load_file(model_dir / "model.safetensors")
    model, _, _ = load_model(out)
    got = model.state_dict()
    name = "model.layers.1.self_attn.indexer.wk.weight"
    assert name in want and torch.equal(got[name], want[name])


def test_write_config_keeps_regular_files(model_dir, tmp_path):
    """Only links are ours to replace: a real weight file in DIR is refused, never deleted."""
    out = tmp_path / "out"
    write_config(model_dir, out, LayerPlan.from_config(ModelConfig.from_hf(model_dir)))
    (out / "model.safetensors").unlink()
    (out / "model.safetensors").write_bytes(b"mine")
    with pytest.raises(DsakvError, match="is not empty .holds model.safetensors"):
        write_config(model_dir, out, LayerPlan.from_config(ModelConfig.from_hf(model_dir)))
    assert (out / "model.safetensors").read_bytes() == b"mine"


@pytest.mark.parametrize(
    "pricing, message",
    [
        ({"kv_budget_gib": 1e300}, "kv_budget_gib must be in"),
        ({"kv_budget_gib": float("nan")}, "kv_budget_gib must be in"),
        ({"draft_layers": 100_000_000_000}, "draft_layers must be in 0..64"),
        ({"draft_layers": -1}, "draft_layers must be in 0..64"),
        ({"page_size": 0}, "page_size must be >= 1"),
    ],
)
def test_pricing_is_bounded_before_the_search(model_dir, pricing, message):
    """Out of bounds, pricing overflowed or ran out of memory only after the reference run."""
    with pytest.raises(DsakvError, match=message):
        calibrate_pattern(model_dir, device="cpu", pricing=Pricing(**pricing))


def test_plot_path_is_the_written_one(tmp_path):
    assert check_plot_path(tmp_path / "kl") == tmp_path / "kl.png"
    assert check_plot_path(tmp_path / "kl.svg") == tmp_path / "kl.svg"
    (tmp_path / "jdir").mkdir()
    (tmp_path / "dir.png").mkdir()
    for bad, message in [
        ("jdir", "is a directory"),
        ("dir.png", "is a directory"),
        ("dir", "is a directory"),  # would write dir.png
        ("out.xyz", "unsupported format .xyz"),
        ("nodir/kl.png", "no such directory"),
    ]:
        with pytest.raises(DsakvError, match=message):
            check_plot_path(tmp_path / bad)


def test_plot_without_extension_reports_the_png(
    model_dir, data_file, tmp_path, capsys, monkeypatch
):
    args = ["calibrate-pattern", str(model_dir), "--data", str(data_file), "--json"]
    args += ["--max-seq-len", "64", "--num-full-layers", "7", "--plot", str(tmp_path / "kl")]
    assert main(args) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["plot"] == str(tmp_path / "kl.png") and os.listdir(tmp_path) == ["kl.png"]
    assert (tmp_path / "kl.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setattr(dsakv.calibrate, "calibrate_pattern", _no_search)  # refused first
    assert main([*args[:-1], str(tmp_path / "out.xyz")]) == 2  # refused, not a traceback
    assert "unsupported format .xyz" in _one_error(capsys)
    (tmp_path / "jdir").mkdir()
    assert main([*args[:-1], str(tmp_path / "jdir")]) == 2  # not jdir.png, exit 0
    assert "is a directory" in _one_error(capsys) and not (tmp_path / "jdir.png").exists()
