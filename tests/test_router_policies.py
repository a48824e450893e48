"""`dsakv router`'s load-balancing policies (SGLang router's: `--policy`, `--prefill-policy`,
`--decode-policy`, the cache_aware and balance thresholds): the approximate prefix tree,
each policy's pick, the routing text of each API's body, the flags; and on a real
deployment (two prefill servers and a decode server, glm-tiny on the CPU, in this process)
requests sharing a long prefix meeting one prefill server's prefix cache, where round
robin splits them."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from starlette.requests import Request

from dsakv.cli import build_parser
from dsakv.disagg.policy import (
    CacheAware,
    Policy,
    PolicyConfig,
    PowerOfTwo,
    PrefixTree,
    Random,
    RoundRobin,
    routing_text,
)
from dsakv.disagg.router import Router
from dsakv.errors import DsakvError

from .conftest import cli_error_line
from .serving import (
    TIMEOUT,
    free_port,
    routing,
    scrape_metrics,
    serving_two_prefills,
)

A, B, C = "http://a:1", "http://b:1", "http://c:1"


def _idle(url: str) -> int:
    return 0


def _sent(policy: Policy, urls: list[str], load: Callable[[str], int], text: str) -> str:
    """The policy's pick, the request sent there (`Policy.sent`), as the router sends it."""
    url = policy.pick(urls, load, text)
    policy.sent(url, text)
    return url


# --- the prefix tree ------------------------------------------------------------------------------


def test_the_tree_tells_each_servers_longest_match_and_size():
    """One walk gives every server's match (a node split where two texts part); each
    server's size counts the characters of its texts once."""
    tree = PrefixTree()
    tree.insert("hello world", A)
    tree.insert("hello there", B)
    tree.insert("hello world", A)  # (again: nothing new)
    assert tree.match("hello world, and more") == {A: 11, B: 6}
    assert tree.match("help") == {A: 3, B: 3}
    assert tree.match("hello thorn") == {A: 6, B: 8}
    assert tree.match("goodbye") == {} and tree.match("") == {}
    assert (tree.size(A), tree.size(B), tree.size(C)) == (11, 11, 0)
    tree.insert("hello", C)  # (ends inside a node: split there)
    assert tree.match("hello world") == {A: 11, B: 6, C: 5} and tree.size(C) == 5
    tree.insert("", C)
    assert tree.size(C) == 5


def test_the_tree_evicts_each_servers_least_recently_sent_leaves_to_its_bound():
    tree = PrefixTree()
    system = "You are terse. "  # (15 characters, shared)
    for q in ("one?", "two?", "six?"):
        tree.insert(system + q, A)
    tree.insert(system + "hey", B)
    tree.insert(system + "one?", A)  # (sent again: now the most recent)
    assert tree.size(A) == 15 + 3 * 4 and tree.size(B) == 15 + 3
    tree.evict(15 + 2 * 4)  # A loses its least recently sent leaf: "two?"
    assert tree.size(A) == 15 + 2 * 4 and tree.size(B) == 15 + 3
    assert tree.match(system + "two?") == {A: 15, B: 15}
    assert tree.match(system + "one?")[A] == 19 and tree.match(system + "six?")[A] == 19
    tree.evict(18)  # A: both its leaves go (B, within the bound, keeps its own)
    assert tree.size(A) == 15 and tree.match(system + "one?") == {A: 15, B: 15}
    assert tree.match(system + "hey") == {A: 15, B: 18}
    tree.evict(10)  # then the run they share: a parent once its children went
    assert tree.size(A) == tree.size(B) == 0 and tree.match(system + "hey") == {}
    assert tree.root.children == {}  # (no node left behind)


def test_a_removed_server_leaves_the_tree_and_only_it():
    tree = PrefixTree()
    tree.insert("shared start, then A", A)
    tree.insert("shared start, then B", B)
    tree.insert("A alone", A)
    tree.remove(A)
    assert tree.size(A) == 0 and tree.size(B) == 20
    assert tree.match("shared start, then A") == {B: 19}
    assert tree.match("A alone") == {} and "A" not in tree.root.children


class _Unwalkable(dict):
    """A node's children that can be looked up, added and removed, but not walked."""

    def values(self):
        raise AssertionError("walked a node's children")

    items = keys = __iter__ = values


def test_a_servers_eviction_looks_at_no_other_servers_branches():
    """Whether a node is still a server's leaf, its own leaf under it evicted, is a count
    the node keeps (its children holding each server), not a walk over its children: under
    a system prompt another server sent on with 2000 questions, each request past the
    bound of the server sharing it cost that walk."""
    tree = PrefixTree()
    system = "You are terse. " * 4
    for i in range(2000):
        tree.insert(system + chr(0x4E00 + i) * 4, B)
    for i in range(3):
        tree.insert(system + chr(0x3400 + i) * 4, A)
    shared = tree.root.children[system[0]]
    assert shared.text == system and len(shared.children) == 2003
    shared.children = _Unwalkable(shared.children)
    for i in range(3, 40):  # (each past A's bound: its least recently sent question goes)
        tree.insert(system + chr(0x3400 + i) * 4, A)
        tree.evict(len(system) + 3 * 4, A)
    assert tree.size(A) == len(system) + 3 * 4 and tree.size(B) == len(system) + 2000 * 4
    assert tree.match(system + chr(0x3400 + 39) * 4)[A] == len(system) + 4
    assert tree.match(system + chr(0x3400 + 36) * 4)[A] == len(system)
    tree.evict(len(system), A)  # (then its leaves all go: the shared run is its leaf again)
    tree.evict(0, A)
    assert tree.size(A) == 0 and tree.match(system) == {B: len(system)}


# --- each policy's pick ---------------------------------------------------------------------------


def test_cache_aware_follows_the_longest_prefix_over_the_threshold_else_the_smallest_tree():
    policy = CacheAware(PolicyConfig())
    system = "You are a helpful assistant. Answer in one word. " * 2  # (100 characters)
    first = _sent(policy, [A, B], _idle, system + "Q1")
    assert first == A  # (two empty trees: the first of the least loaded)
    assert _sent(policy, [A, B], _idle, system + "Q2") == A  # (98% matched)
    # a text matching no more than 30% goes to the smaller tree (B: empty), then stays
    assert _sent(policy, [A, B], _idle, system[:20] + "x" * 80) == B
    assert _sent(policy, [A, B], _idle, system[:20] + "x" * 79 + "y") == B
    # the threshold is the flag's: 0.9 sends a 50% match to the smaller tree
    strict = CacheAware(PolicyConfig(cache_threshold=0.9))
    _sent(strict, [A, B], _idle, system)
    assert _sent(strict, [A, B], _idle, system[:50] + "z" * 50) == B
    # a match is taken only among the servers given (those up): A's prefix, A down
    assert _sent(policy, [B], _idle, system + "Q3") == B


def test_cache_aware_takes_the_least_loaded_while_loads_are_imbalanced():
    """SGLang's rule: imbalanced when the most loaded has more than 64 requests over the
    least loaded and more than 1.5 times as many: then the shortest queue, whatever matches
    (the text still joins the tree of the server it went to)."""
    policy = CacheAware(PolicyConfig())
    text = "a long shared system prompt " * 4
    assert _sent(policy, [A, B], _idle, text) == A
    loads = {A: 70, B: 5}  # (65 more, and 14 times as many)
    assert _sent(policy, [A, B], loads.__getitem__, text + "?") == B
    assert policy.tree.match(text + "?") == {A: len(text), B: len(text) + 1}
    other = "no match " * 10
    _sent(policy, [A, B], {A: 0, B: 9}.__getitem__, other)  # (A's, the smaller tree)
    loads = {A: 70, B: 6}  # (64 more: not over the absolute threshold)
    assert _sent(policy, [A, B], loads.__getitem__, other + "!") == A  # (its match)
    loads = {A: 200, B: 140}  # (60 more, 1.43 times as many: balanced)
    assert _sent(policy, [A, B], loads.__getitem__, other + "!") == A
    assert _sent(policy, [A, B], {A: 200, B: 100}.__getitem__, other) == B  # (100, twice)
    relaxed = CacheAware(PolicyConfig(balance_abs_threshold=10, balance_rel_threshold=1.2))
    _sent(relaxed, [A, B], _idle, other)
    assert _sent(relaxed, [A, B], loads.__getitem__, other) == B


def test_cache_aware_trees_are_cut_as_a_request_takes_them_past_their_bound():
    """At once, by what the request added past it (no clock, no walk over the tree later):
    the bound holds after every request sent."""
    policy = CacheAware(PolicyConfig(max_tree_size=10))
    _sent(policy, [A], _idle, "x" * 8)
    _sent(policy, [A], _idle, "y" * 8)  # (16: the older text goes)
    assert policy.tree.size(A) == 8 and policy.tree.match("x" * 8) == {}
    assert policy.tree.match("y" * 8) == {A: 8}
    _sent(policy, [A], _idle, "y" * 4 + "z" * 2)  # (8 + 2: within the bound)
    assert policy.tree.size(A) == 10 and policy.tree.match("y" * 8) == {A: 8}


def test_the_tree_stays_whole_through_random_inserts_evictions_and_removals():
    """Each server's size is the characters of the nodes it holds, a node's servers hold
    its parent, no node is left that nobody holds, and each server's leaves wait on its
    heap: eviction finds them without walking the tree."""
    tree = PrefixTree()
    for i in range(3000):  # (the same texts again and again: their stale entries dropped)
        tree.insert("ab" * (i % 3), A)
    _check(tree)
    assert len(tree._leaves[A]) <= 2 * 2 + 1025
    rng = random.Random(0)
    for step in range(3000):
        tenant = rng.choice([A, B, C])
        text = "".join(rng.choice("ab") for _ in range(rng.randrange(12)))
        if step % 500 == 499:
            tree.remove(tenant)
        else:
            tree.insert(text, tenant)
            tree.evict(rng.choice([8, 20, 40]), tenant if step % 3 else None)
        _check(tree)


def _check(tree: PrefixTree) -> None:
    sizes: Counter[str] = Counter()
    nodes: Counter[str] = Counter()
    stack = list(tree.root.children.values())
    while stack:
        node = stack.pop()
        assert node.tenants and node.tenants.keys() <= node.parent.tenants.keys()
        assert node.parent.children[node.text[0]] is node
        nodes.update(node.tenants.keys())
        assert node.below == Counter(t for c in node.children.values() for t in c.tenants)
        for t in node.tenants:
            sizes[t] += len(node.text)
            if not any(t in c.tenants for c in node.children.values()):  # (its leaf)
                assert any(e[2] is node and e[0] == node.tenants[t] for e in tree._leaves[t])
        stack += node.children.values()
    assert {t: n for t, n in tree._sizes.items() if n} == sizes
    assert {t: n for t, n in tree._nodes.items() if n} == nodes
    assert all(len(tree._leaves[t]) <= 2 * nodes[t] + 1025 for t in tree._leaves)


def test_round_robin_random_and_power_of_two():
    rr = RoundRobin()
    assert [rr.pick([A, B, C], _idle, "") for _ in range(4)] == [A, B, C, A]
    assert [rr.pick([A, B], _idle, "") for _ in range(2)] == [A, B]  # (one went: no skip)
    rng = random.Random(0)
    assert set(Random(rng).pick([A, B, C], _idle, "") for _ in range(60)) == {A, B, C}
    loads = {A: 5, B: 0, C: 9}
    p2 = PowerOfTwo(rng)
    picks = Counter(p2.pick([A, B, C], loads.__getitem__, "") for _ in range(300))
    assert C not in picks and picks[B] > picks[A] > 0  # (the less loaded of each two drawn)
    assert {p2.pick([A, B], loads.__getitem__, "") for _ in range(20)} == {B}
    assert p2.pick([C], loads.__getitem__, "") == C


def test_the_router_passes_over_servers_down_and_forgets_those_removed():
    """Whatever the policy, a server that failed in the last 10 s is tried last, and the
    pick is among the others; a removed server's texts leave the cache_aware tree."""
    for name in ("random", "round_robin", "cache_aware", "power_of_two"):
        router = Router([A, B, C], ["http://d:1"], PolicyConfig(policy=name))
        router._down[A] = time.monotonic()
        for _ in range(6):
            ranked = router._ranked("prefill", "some prompt")
            assert sorted(ranked) == [A, B, C] and ranked[-1] == A, (name, ranked)
        router._down = {u: time.monotonic() for u in (A, B, C)}  # (all down: each still tried)
        assert sorted(router._ranked("prefill", "some prompt")) == [A, B, C]
    router = Router([A, B], ["http://d:1"])
    router._bootstrap = {A: ("a", 1), B: ("b", 1)}
    assert asyncio.run(router._pick_prefill("the prompt", "/v1/completions"))[0] == A
    router._finished("prefill", A)
    tree = router._policies["prefill"].tree
    assert tree.match("the prompt") == {A: 10}
    router.remove_worker(A)
    assert tree.match("the prompt") == {} and router._ranked("prefill", "the prompt") == [B]
    assert [router._ranked("decode", "")[0] for _ in range(2)] == ["http://d:1"] * 2


def test_a_burst_sees_each_pick_as_load_before_its_request_is_sent():
    """SGLang counts a worker's request from its pick: of a burst of requests sharing a
    prompt, none sent yet, those past the imbalance go to the idle prefill server (counted
    once sent, all of the burst went to the first: each saw no load). Each count ends with
    its request."""
    router = Router([A, B], [C], PolicyConfig(balance_abs_threshold=4))
    router._bootstrap = {A: ("a", 1), B: ("b", 1)}
    asked: list[str] = []

    async def answer(request: httpx.Request) -> httpx.Response:
        if request.url.host in ("a", "b"):  # (prefill servers: held until the burst is in)
            asked.append(request.url.host)
            await release.wait()
        return httpx.Response(200, json={})

    async def burst() -> None:
        nonlocal release
        release = asyncio.Event()
        router._client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        body = {"model": "m", "prompt": SYSTEM, "max_tokens": 1}
        answers = await asyncio.gather(
            *[router.generate("/v1/completions", _request(body)) for _ in range(12)]
        )
        assert [r.status_code for r in answers] == [200] * 12
        while len(asked) < 12:
            await asyncio.sleep(0.01)
        release.set()
        await asyncio.gather(*router._tasks)
        await router._client.aclose()

    release: asyncio.Event
    asyncio.run(burst())
    assert asked[:6] == ["a"] * 5 + ["b"], asked  # (5 over 0: more than 4 more, and 1.5 times)
    assert Counter(asked) == {"a": 6, "b": 6}, asked  # (then the less loaded of two matches)
    assert not router._busy


def test_each_tree_names_the_server_a_request_went_to_not_the_one_passed_over():
    """A pick passed over (a prefill server that cannot tell its bootstrap port, a decode
    server refusing the connection) never got the prompt: the trees name the servers that
    did. (The pick recorded itself: the tree named a server whose cache never saw the
    prompt, and drew the requests sharing it there.)"""
    D1, D2 = "http://d1:1", "http://d2:1"
    router = Router([A, B], [D1, D2], PolicyConfig(policy="cache_aware"))
    got: list[str] = []

    async def answer(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if request.url.path == "/disagg/info":
            if host == "a":
                raise httpx.ConnectError("down")
            return httpx.Response(200, json={"mode": "prefill", "bootstrap_port": 9})
        if host == "d1":
            raise httpx.ConnectError("refused")
        got.append(host)
        return httpx.Response(200, json={})

    async def send() -> None:
        router._client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        body = {"model": "m", "prompt": SYSTEM, "max_tokens": 1}
        assert (await router.generate("/v1/completions", _request(body))).status_code == 200
        await asyncio.gather(*router._tasks)
        await router._client.aclose()

    asyncio.run(send())
    assert sorted(got) == ["b", "d2"]  # (A and D1 picked first: each tree was empty)
    assert router._policies["prefill"].tree.match(SYSTEM) == {B: len(SYSTEM)}
    assert router._policies["decode"].tree.match(SYSTEM) == {D2: len(SYSTEM)}
    assert not router._busy


def test_a_request_cancelled_as_its_answer_comes_leaves_no_load_behind():
    """A routed request cancelled (a batch's stop) in the loop turn its decode server's
    answer came: that answer, nobody's, is closed and no longer counted (it stayed open,
    and the decode server's count of requests in flight, what the policies weigh, one too
    many for good)."""
    router = Router([A], [C])
    router._bootstrap = {A: ("a", 1)}
    closed: list[str] = []

    class Body(httpx.AsyncByteStream):
        async def __aiter__(self) -> AsyncIterator[bytes]:
            yield b"{}"

        async def aclose(self) -> None:
            closed.append("decode")

    async def answer(request: httpx.Request) -> httpx.Response:
        if request.url.host == "c":
            return httpx.Response(200, stream=Body())
        return httpx.Response(200, json={})

    sending = router._send_decode

    async def answered(*args: Any) -> tuple[str, httpx.Response]:
        got = await sending(*args)  # (only the timing: the cancel lands as the answer does)
        asyncio.get_running_loop().call_soon(routed.cancel)
        return got

    async def route() -> None:
        nonlocal routed
        router._client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        body = {"model": "m", "prompt": "x", "max_tokens": 1}
        routed = asyncio.ensure_future(router.generate("/v1/completions", _request(body)))
        with pytest.raises(asyncio.CancelledError):
            await routed
        await asyncio.gather(*router._tasks, return_exceptions=True)
        await router._client.aclose()

    routed: asyncio.Future
    router._send_decode = answered
    asyncio.run(route())
    assert closed == ["decode"] and not router._busy


def _request(body: dict) -> Request:
    """A client's POST of `body` to the router, the client staying."""
    raw = json.dumps(body).encode()
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if sent:
            await asyncio.Event().wait()
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    return Request({"type": "http", "method": "POST", "headers": [], "query_string": b""}, receive)


def test_policies_per_kind_and_their_defaults():
    """Without --policy: cache_aware for prefill servers, round robin for decode servers;
    --policy sets both, --prefill-policy / --decode-policy their own."""
    assert [PolicyConfig().policy_of(k) for k in ("prefill", "decode")] == [
        "cache_aware",
        "round_robin",
    ]
    c = PolicyConfig(policy="power_of_two", decode_policy="random")
    assert (c.policy_of("prefill"), c.policy_of("decode")) == ("power_of_two", "random")
    router = Router([A], [B], PolicyConfig(policy="cache_aware"))
    assert [p.name for p in router._policies.values()] == ["cache_aware", "cache_aware"]
    with pytest.raises(DsakvError, match="--decode-policy must be one of"):
        PolicyConfig(decode_policy="least_load")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--policy", "least_load"], "argument --policy: invalid choice"),
        (["--prefill-policy", "x"], "argument --prefill-policy: invalid choice"),
        (["--cache-threshold", "1.5"], "--cache-threshold must be in [0, 1]"),
        (["--cache-threshold", "nan"], "--cache-threshold must be in [0, 1]"),
        (["--balance-abs-threshold", "-1"], "--balance-abs-threshold must be an integer >= 0"),
        (["--balance-abs-threshold", "1.5"], "argument --balance-abs-threshold: invalid int"),
        (["--balance-rel-threshold", "0.5"], "--balance-rel-threshold must be a number >= 1"),
        (["--eviction-interval", "-1"], "--eviction-interval-secs must be an integer >= 0"),
        (["--max-tree-size", "0"], "--max-tree-size must be an integer >= 1"),
    ],
)
def test_bad_policy_flags_are_one_error_line(args, message, capsys):
    """Exit 2 before the router listens, as for its other flags."""
    line = cli_error_line(["router", "--port", str(free_port()), *args], capsys)
    assert line.startswith(f"error: {message}"), line


def test_routing_text_of_each_api():
    """SGLang's routing text: the prompt's texts joined by spaces (token ids as numbers),
    images left out."""
    assert routing_text({"prompt": "Once upon"}) == "Once upon"
    assert routing_text({"prompt": ["a", "b"]}) == "a b"
    assert routing_text({"prompt": [[1, 2], [3]]}) == "1 2 3"
    assert routing_text({"text": "hi", "sampling_params": {"text": "x"}}) == "hi"
    assert routing_text({"input_ids": [5, 6]}) == "5 6"
    chat = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [
                {"type": "text", "text": "What is"},
                {"type": "image_url", "image_url": {"url": "data:..."}},
                {"type": "text", "text": "this?"},
            ]},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
        ],
        "max_tokens": 3,
    }  # fmt: skip
    assert routing_text(chat) == "Be brief. What is this?"
    anthropic = {"system": [{"type": "text", "text": "Be kind."}], "messages": [
        {"role": "user", "content": "Hi"}]}  # fmt: skip
    assert routing_text(anthropic) == "Be kind. Hi"
    responses = {"instructions": "Rhyme.", "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Go"}]}
    ]}  # fmt: skip
    assert routing_text(responses) == "Rhyme. Go"
    assert routing_text({"input": "Just text", "model": "m"}) == "Just text"
    deep: list = ["x"]
    for _ in range(5000):  # (nested past the interpreter's limit: not walked down)
        deep = [deep]
    assert routing_text({"prompt": deep}) == ""


# --- a real deployment: two prefill servers -------------------------------------------------------

SYSTEM = "You are a careful assistant. Answer every question in a single short word. " * 3


@pytest.fixture(scope="module")
def pd(tmp_path_factory) -> Iterator[SimpleNamespace]:
    with serving_two_prefills(tmp_path_factory.mktemp("policies") / "m") as pd:
        yield pd


def _counts(pd: SimpleNamespace) -> list[tuple[float, float]]:
    """Each prefill server's prompt tokens and prefix-cache hits so far."""
    names = ("dsakv_prompt_tokens_total", "dsakv_prefix_hit_tokens_total")
    return [tuple(scrape_metrics(u)[n] for n in names) for u in pd.prefill]


def _ask(base: str, questions: range) -> None:
    for i in questions:
        body = {"model": "m", "prompt": f"{SYSTEM}Question {i}: a colour?", "max_tokens": 2}
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT)
        assert r.status_code == 200, r.text


def test_a_shared_prefix_meets_one_prefill_servers_cache_where_round_robin_splits_it(pd):
    """By default (cache_aware) four prompts sharing a long system prompt all go to one
    prefill server, three of them served from its prefix cache, the other server idle;
    under round robin (SGLang's `--prefill-policy round_robin`: dsakv's only one before)
    they alternate, each server computing the prefix itself once."""
    before = _counts(pd)
    with routing(pd.prefill, [pd.decode]) as base:
        _ask(base, range(4))
    after = _counts(pd)
    (p0, h0), (p1, h1) = [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before)]
    assert p1 == h1 == 0 and p0 > 0, (p0, h0, p1, h1)  # (the first of the two: A above)
    assert h0 > p0 / 2, (p0, h0)  # (three of the four prompts, most of each)
    before = after
    with routing(pd.prefill, [pd.decode], policy=PolicyConfig(policy="round_robin")) as base:
        _ask(base, range(4, 8))
    after = _counts(pd)
    (p0, h0), (p1, h1) = [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before)]
    assert p0 == p1 > 0, (p0, p1)  # (two prompts of one length each)
    assert h1 < p1 / 2, (p1, h1)  # (the second server computed the shared prefix once)


def test_sglangs_prefill_url_bootstrap_port_form_is_taken(capsys):
    """sglang-router's `--prefill URL [BOOTSTRAP_PORT|none]`: the URLs kept, in order (the
    router asks each server its port); a third value or a non-port is one error line."""
    argv = ["router", "--prefill", "http://p1:30001", "8998", "--prefill", "http://p2:30001",
            "--prefill", "http://p3:30001", "none", "--decode", "http://d:30002"]  # fmt: skip
    args = build_parser().parse_args(argv)
    assert args.prefill == ["http://p1:30001", "http://p2:30001", "http://p3:30001"]
    assert build_parser().parse_args(["router"]).prefill == []
    for bad in (["http://p:1", "x"], ["http://p:1", "8998", "9"], ["http://p:1", "70000"]):
        line = cli_error_line(["router", "--port", str(free_port()), "--prefill", *bad], capsys)
        assert line == f"error: argument --prefill: expected URL [BOOTSTRAP_PORT], got {bad}"
