"""dsakv next to llama.cpp on the same tiny model: greedy parity, then decode and prefill tok/s.

    .venv/bin/python scripts/peer_llamacpp.py --llama-cpp /path/to/llama.cpp [--build build]
        [--outtype f32 bf16] [--rounds 4] [--threads 2] [--work-dir DIR]

For each outtype: (a) `dsakv init-tiny --preset glm-bench --mtp none` writes the model
(fp32; for bf16 the same weights rounded once to a bf16 checkpoint, which both sides load);
(b) that llama.cpp checkout's convert_hf_to_gguf.py writes the GGUF (its pre-tokenizer check
does not know glm-bench's 264-token byte-level tokenizer and GLM's special tokens are not in
it, so the converter runs with a plain GPT-2 BPE vocab: the prompts are token ids, nothing
is tokenized); (c) llama-server (`/completion`, token-id prompt, top-k 1, ignore_eos, fp32
KV cache, no flash attention) and dsakv (fp32 caches) generate greedily from the same
prompts: token ids compared, and the top-5 logprobs of each step; (d) timing
in alternating rounds: decode at 1 and 32 requests (llama-batched-bench: PP-token prompts,
TG generated tokens each, S_TG = requests x TG / decode time, prefill excluded; dsakv the
same definition, `dsakv.bench.determinism.measure_rate`) and prefill of one prompt
(llama-bench -n 0; dsakv: prompt tokens / time to the first token). Medians (min-max).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

BINARIES = ("llama-server", "llama-batched-bench", "llama-bench")
PARITY_PROMPT_LENS = (8, 100, 300, 600)  # the last two pass index_topk (256): sparse selection
TOP = 5  # top logprobs compared per generated token

# Runs convert_hf_to_gguf.py (argv[1]) with two fallbacks for dsakv's tiny tokenizer.
CONVERT_SHIM = r"""
import runpy, sys
from pathlib import Path
convert = Path(sys.argv[1]); sys.argv = sys.argv[1:]
sys.path[:0] = [str(convert.parent), str(convert.parent / "gguf-py")]
import gguf
from conversion import base, glm
_pre = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return _pre(self, tokenizer)
    except NotImplementedError:  # unknown pre-tokenizer hash: llama.cpp's default regex
        return "default"
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
_glm_vocab = glm.GlmMoeDsaModel.set_vocab
def set_vocab(self):
    from transformers import AutoTokenizer
    if "[gMASK]" in AutoTokenizer.from_pretrained(self.dir_model).get_added_vocab():
        return _glm_vocab(self)
    # A GPT-2 BPE vocab whose 256 byte tokens are user-defined: their pieces are then their
    # byte-level characters (valid UTF-8; llama-server holds back a token ending in a partial
    # UTF-8 character, its logprobs too). No merges in a byte vocab: one placeholder, as
    # llama.cpp refuses a BPE vocab without any.
    tokens, toktypes, tokpre = self.get_vocab_base()
    user = gguf.TokenType.USER_DEFINED
    toktypes = [user if t == gguf.TokenType.NORMAL else t for t in toktypes]
    self.gguf_writer.add_tokenizer_model("gpt2")
    self.gguf_writer.add_tokenizer_pre(tokpre)
    self.gguf_writer.add_token_list(tokens)
    self.gguf_writer.add_token_types(toktypes)
    self.gguf_writer.add_token_merges(["\u0100 \u0100"])
    gguf.SpecialVocab(self.dir_model).add_to_gguf(self.gguf_writer)
glm.GlmMoeDsaModel.set_vocab = set_vocab
runpy.run_path(str(convert), run_name="__main__")
"""


class PeerError(Exception):
    pass


def find_tools(llama_cpp: Path, build: str) -> dict[str, Path]:
    """The converter and the binaries this harness runs, or a one-line PeerError."""
    if not llama_cpp.is_dir():
        raise PeerError(f"no llama.cpp checkout at {llama_cpp}")
    convert = llama_cpp / "convert_hf_to_gguf.py"
    if not convert.is_file():
        raise PeerError(f"{convert} not found (is {llama_cpp} a llama.cpp source tree?)")
    build_dir = Path(build) if Path(build).is_absolute() else llama_cpp / build
    if not build_dir.is_dir():
        raise PeerError(f"no build dir {build_dir} (build llama.cpp first, or pass --build)")
    tools = {"convert": convert}
    for name in BINARIES:
        path = build_dir / "bin" / name
        if not path.is_file():
            raise PeerError(f"{path} missing (cmake --build {build_dir} --target {name})")
        tools[name] = path
    return tools


def run(argv: list, what: str) -> subprocess.CompletedProcess:
    p = subprocess.run([str(a) for a in argv], capture_output=True, text=True)
    if p.returncode:
        tail = " | ".join((p.stdout + p.stderr).strip().splitlines()[-3:])
        raise PeerError(f"{what} failed ({p.returncode}): {tail}")
    return p


# --- the model on both sides ------------------------------------------------------------------


def write_model(work: Path, outtype: str) -> Path:
    """glm-bench without MTP from dsakv's init-tiny; for bf16, a copy rounded to bf16."""
    fp32 = work / "glm-bench-nomtp"
    if not (fp32 / "config.json").is_file():
        shutil.rmtree(fp32, ignore_errors=True)  # a run cut short (init-tiny wants it empty)
        argv = [sys.executable, "-m", "dsakv.cli", "init-tiny", "--preset", "glm-bench"]
        run([*argv, "--mtp", "none", fp32], "dsakv init-tiny")
    if outtype == "f32":
        return fp32
    out = work / "glm-bench-nomtp-bf16"
    if not (out / "config.json").is_file():
        import torch
        from safetensors.torch import load_file, save_file

        shutil.copytree(fp32, out, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
        for f in fp32.glob("*.safetensors"):
            t = load_file(f)
            save_file({k: v.to(torch.bfloat16) for k, v in t.items()}, out / f.name)
        config = json.loads((fp32 / "config.json").read_text())  # last: marks the copy done
        (out / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}, indent=2))
    return out


def convert(tools: dict[str, Path], model: Path, outtype: str, work: Path) -> Path:
    gguf = work / f"glm-bench-nomtp-{outtype}.gguf"
    if not gguf.is_file():
        argv = [sys.executable, "-c", CONVERT_SHIM, tools["convert"], model]
        run([*argv, "--outtype", outtype, "--outfile", gguf], "convert_hf_to_gguf.py")
    return gguf


# --- parity -----------------------------------------------------------------------------------


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(length)] for _ in range(n)]


@contextlib.contextmanager
def llama_server(tools, gguf: Path, ctx: int, threads: int):
    """A llama-server on a free loopback port (one slot); yields its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # fp32 KV cache, and no flash attention: on a CPU it rounds through f16 (logprobs 1e-2 off
    # transformers' on glm-bench, against 1e-5 without it)
    flags = f"--port {port} -c {ctx} -np 1 -t {threads} -ctk f32 -ctv f32 -fa off"
    argv = [tools["llama-server"], "-m", gguf, *flags.split()]
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        server = subprocess.Popen([str(a) for a in argv], stdout=log, stderr=subprocess.STDOUT)
        try:
            for _ in range(600):
                if server.poll() is not None:
                    log.seek(0)
                    tail = " | ".join(log.read().decode(errors="replace").splitlines()[-3:])
                    raise PeerError(f"llama-server exited ({server.returncode}): {tail}")
                try:
                    urllib.request.urlopen(f"{url}/health", timeout=2)
                    break
                except OSError:
                    time.sleep(0.5)
            else:
                raise PeerError("llama-server did not come up in 5 minutes")
            yield url
        finally:
            server.terminate()
            server.wait(30)


def llama_greedy(tools, gguf: Path, batch: list[list[int]], n: int, threads: int) -> list:
    """(greedy token ids, each step's top-TOP {id: logprob}) per prompt, from llama-server's
    /completion (token-id prompt, top-k 1, ignore_eos), one prompt at a time."""
    outs = []
    with llama_server(tools, gguf, max(map(len, batch)) + n + 16, threads) as url:
        for p in batch:
            body = {"prompt": p, "n_predict": n, "top_k": 1, "temperature": 0.0, "n_probs": TOP}
            body |= {"ignore_eos": True, "cache_prompt": False}
            headers = {"Content-Type": "application/json"}
            req = urllib.request.Request(f"{url}/completion", json.dumps(body).encode(), headers)
            got = json.load(urllib.request.urlopen(req, timeout=600))
            if "completion_probabilities" not in got:
                raise PeerError(f"llama-server /completion answered {json.dumps(got)[:300]}")
            steps = got["completion_probabilities"]
            tops = [{t["id"]: t["logprob"] for t in s["top_logprobs"]} for s in steps]
            outs.append(([s["id"] for s in steps], tops))
    return outs


def compare_tokens(a: list[int], b: list[int]) -> tuple[int, int, int | None]:
    """(equal positions, length, first differing index or None)."""
    n = max(len(a), len(b))
    first = next((i for i in range(n) if i >= len(a) or i >= len(b) or a[i] != b[i]), None)
    return sum(x == y for x, y in zip(a, b)), n, first


def logprob_gap(a: list[dict[int, float]], b: list[dict[int, float]]) -> float:
    """Largest |logprob difference| over the top-k ids both list, step by step. The tiny
    random model mostly repeats one token, so equal argmaxes alone say little."""
    return max((abs(x[t] - y[t]) for x, y in zip(a, b) for t in x.keys() & y.keys()), default=0)


# --- timing -----------------------------------------------------------------------------------


def parse_batched_bench(text: str) -> dict[int, dict[str, float]]:
    """llama-batched-bench's markdown rows: {B: {"pp", "tg", "s_pp", "s_tg"}}."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and all(re.fullmatch(r"[\d.]+", c) for c in cells):
            pp, tg, b = (int(c) for c in cells[:3])
            rows[b] = {"pp": pp, "tg": tg, "s_pp": float(cells[5]), "s_tg": float(cells[7])}
    return rows


def parse_llama_bench(text: str) -> dict[int, float]:
    """llama-bench -o json (its stdout): {n_prompt: avg tok/s} of the prompt-only tests."""
    data = json.loads(text)
    return {int(t["n_prompt"]): float(t["avg_ts"]) for t in data if t["n_gen"] == 0}


def llama_decode(tools, gguf, npp: int, ntg: int, npl: list[int], threads: int) -> dict:
    ctx = max(npl) * (npp + ntg)
    flags = f"-npp {npp} -ntg {ntg} -npl {','.join(map(str, npl))} -c {ctx} -fa on -t {threads}"
    argv = [tools["llama-batched-bench"], "-m", gguf, *flags.split()]
    p = run(argv, "llama-batched-bench")
    rows = parse_batched_bench(p.stdout + p.stderr)
    if set(rows) != set(npl):
        raise PeerError(f"llama-batched-bench gave rows for {sorted(rows)}, wanted {npl}")
    return {f"decode {b} req": rows[b]["s_tg"] for b in npl}


def llama_prefill(tools, gguf, lengths: list[int], threads: int) -> dict:
    flags = f"-p {','.join(map(str, lengths))} -n 0 -fa 1 -t {threads} -r 1 -o json"
    argv = [tools["llama-bench"], "-m", gguf, *flags.split()]
    rates = parse_llama_bench(run(argv, "llama-bench").stdout)
    return {f"prefill {n}": rates[n] for n in lengths}


def dsakv_rounds(engine, npp, ntg, npl, lengths, seed) -> dict:
    from dsakv.bench.determinism import measure_rate  # tok/s as batched-bench / llama-bench count

    out = {}
    for b in npl:
        out[f"decode {b} req"] = measure_rate(engine, prompts(b, npp, seed + b), ntg)[0]
    for n in lengths:
        out[f"prefill {n}"] = measure_rate(engine, prompts(1, n, seed + n), 0)[0]
    return out


def table(rates: dict[str, dict[str, list[float]]]) -> list[str]:
    def cell(xs):
        return f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})"

    lines = ["| workload | llama.cpp tok/s | dsakv tok/s | dsakv / llama.cpp |"]
    lines.append("| --- | ---: | ---: | ---: |")
    for w, r in rates.items():
        ratios = [d / c for c, d in zip(r["llama.cpp"], r["dsakv"])]
        ratio = f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
        lines.append(f"| {w} | {cell(r['llama.cpp'])} | {cell(r['dsakv'])} | {ratio} |")
    return lines


# --- main -------------------------------------------------------------------------------------


def check_parity(args, tools, model: Path, gguf: Path, outtype: str) -> bool:
    """Greedy tokens of llama.cpp and dsakv (fp32 caches) on the parity prompts: k of n equal."""
    from dsakv.engine import LLM, SamplingParams

    batch = [prompts(1, n, 100 + n)[0] for n in PARITY_PROMPT_LENS]
    ref = llama_greedy(tools, gguf, batch, args.parity_tokens, args.threads)
    dtype = "float32" if outtype == "f32" else "auto"
    kw = dict(kv_cache_dtype="fp32", index_k_dtype="fp32", device="cpu")
    params = SamplingParams(max_tokens=args.parity_tokens, temperature=0, ignore_eos=True)
    with LLM(str(model), dtype=dtype, **kw) as llm:
        outs = llm.generate(batch, dataclasses.replace(params, logprobs=TOP), use_tqdm=False)
    ok = True
    for p, (a, a_top), o in zip(batch, ref, outs):
        eq, n, first = compare_tokens(a, o.token_ids)
        ours = [{t: x.logprob for t, x in d.items()} for d in o.outputs[0].logprobs]
        gap = logprob_gap(a_top[:first], ours[:first])
        where = "" if first is None else f", FIRST DIFFERENCE AT TOKEN {first}"
        print(f"parity ({outtype}, {len(p)}-token prompt): {eq} of {n} tokens equal{where}; "
              f"top-{TOP} logprobs within {gap:.1e}", flush=True)  # fmt: skip
        ok &= first is None
    if not ok:
        print(f"PARITY MISMATCH ({outtype}): llama.cpp and dsakv disagree", file=sys.stderr)
    return ok


def time_both(args, tools, model: Path, gguf: Path, outtype: str) -> dict:
    """{workload: {"llama.cpp": [tok/s per round], "dsakv": [...]}}, the sides alternating."""
    from dsakv.engine import LLM

    dtype = "float32" if outtype == "f32" else "auto"
    caches = {"kv_cache_dtype": args.kv_cache_dtype, "index_k_dtype": args.index_k_dtype}
    kw = {k: v for k, v in caches.items() if v}
    llm = LLM(str(model), dtype=dtype, device="cpu", enable_prefix_cache=False, **kw)
    engine = llm.engine
    numel = collections.Counter()
    for t in engine.model.parameters():
        numel[str(t.dtype).removeprefix("torch.")] += t.numel()
    weights = " + ".join(f"{n / 1e6:.1f}M {d}" for d, n in numel.most_common())
    c = engine.config
    print(f"dsakv: dtype={dtype} (weights {weights}), caches {c.kv_cache_dtype} / "
          f"{c.index_k_dtype}, deterministic={engine.deterministic}, {args.threads} threads; "
          f"llama.cpp: {outtype} GGUF, -fa on, -t {args.threads}", flush=True)  # fmt: skip
    dsakv_rounds(engine, 16, 4, args.npl, [64], seed=-1)  # warm-up, untimed
    rates: dict[str, dict[str, list[float]]] = {}
    for r in range(args.rounds):
        for side in ("llama.cpp", "dsakv")[:: 1 if r % 2 == 0 else -1]:
            t0 = time.perf_counter()
            if side == "dsakv":
                got = dsakv_rounds(engine, args.npp, args.ntg, args.npl, args.prefill, seed=r)
            else:
                got = llama_decode(tools, gguf, args.npp, args.ntg, args.npl, args.threads)
                got |= llama_prefill(tools, gguf, args.prefill, args.threads)
            for w, v in got.items():
                rates.setdefault(w, {"llama.cpp": [], "dsakv": []})[side].append(v)
            line = ", ".join(f"{w} {v:.1f}" for w, v in got.items())
            took = time.perf_counter() - t0
            print(f"round {r + 1}/{args.rounds} {side}: {line} ({took:.0f} s)", flush=True)
    llm.close()
    return rates


def peer(args, tools, outtype: str, work: Path) -> bool:
    import torch

    model = write_model(work, outtype)
    gguf = convert(tools, model, outtype, work)
    torch.set_num_threads(args.threads)
    print(f"\n## {outtype}: {gguf}", flush=True)
    ok = check_parity(args, tools, model, gguf, outtype) if args.parity_tokens else True
    if args.rounds:
        rates = time_both(args, tools, model, gguf, outtype)
        print(f"\n{outtype} weights; decode: {args.npp}-token prompts, {args.ntg} generated "
              f"tokens each; medians (min-max) of {args.rounds} round(s)\n")  # fmt: skip
        print("\n".join(table(rates)), flush=True)
        if args.json:
            path = Path(args.json.replace("{outtype}", outtype))
            path.write_text(json.dumps({"outtype": outtype, "rates": rates}, indent=2))
    return ok


def parse_args(argv=None) -> argparse.Namespace:
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source tree")
    p.add_argument("--build", default="build", help="its build dir (relative to it or absolute)")
    p.add_argument("--outtype", nargs="+", choices=("f32", "bf16"), default=["f32", "bf16"])
    p.add_argument("--rounds", type=int, default=4, help="timing rounds (0: parity only)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--npp", type=int, default=128, help="decode: prompt tokens per request")
    p.add_argument("--ntg", type=int, default=128, help="decode: generated tokens per request")
    p.add_argument("--npl", type=ints, default=[1, 32], help="decode: requests, comma list")
    p.add_argument("--prefill", type=ints, default=[128, 1024], help="prefill lengths")
    p.add_argument("--parity-tokens", type=int, default=72, help="0: skip the parity check")
    p.add_argument("--kv-cache-dtype", help="dsakv's latent cache in the timing (default its own)")
    p.add_argument("--index-k-dtype", help="dsakv's index-K cache in the timing")
    p.add_argument("--work-dir", type=Path, help="models and GGUFs (reused when present)")
    p.add_argument("--json", help="write rates to this path ({outtype} is substituted)")
    args = p.parse_args(argv)
    if args.rounds < 0 or args.threads < 1 or args.parity_tokens < 0:
        p.error("--rounds and --parity-tokens must be >= 0, --threads >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        tools = find_tools(args.llama_cpp, args.build)
        work = args.work_dir or Path(tempfile.mkdtemp(prefix="dsakv-peer-"))
        work.mkdir(parents=True, exist_ok=True)
        ok = all([peer(args, tools, t, work) for t in args.outtype])
    except PeerError as e:
        sys.exit(f"peer_llamacpp: {e}")
    if not ok:
        sys.exit("peer_llamacpp: greedy parity FAILED (see the parity lines above)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
