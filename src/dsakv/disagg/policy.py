"""How `dsakv router` picks each request's prefill and decode server: SGLang router's
load-balancing policies, under its flag names and defaults (but for decode servers':
`DEFAULT_POLICIES`).

`round_robin` takes the servers in turn, `random` any, `power_of_two` the less loaded of
two random ones, and `cache_aware` the one whose approximate prefix tree (the text each
server was sent, in characters: `PrefixTree`) matches the longest prefix of the request's
(`routing_text`), so requests sharing a system prompt or a conversation's earlier turns
meet the prefill server whose prefix cache holds them. A server's load is its requests in
flight through the router (SGLang's `power_of_two` prefers what the workers' /get_load
told when it last polled them, every few seconds; the router counts each request from its
pick, as SGLang's router counts a worker's load). Light: no torch.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from dsakv.errors import DsakvError

# Without --policy: prefix affinity where the prompt is computed, turns where it is decoded
# (a decode server's prompt arrives whole from the prefill server: its cache saves nothing).
DEFAULT_POLICIES = {"prefill": "cache_aware", "decode": "round_robin"}


@dataclass(frozen=True)
class PolicyConfig:
    """`policy`: both kinds' (None: `DEFAULT_POLICIES`), unless `prefill_policy` or
    `decode_policy` names its kind's. `cache_aware`: a request goes to the server whose tree
    matches more than `cache_threshold` of its text, else to the one with the smallest tree;
    but while the loads are imbalanced (the most loaded server's exceeds the least loaded's
    by more than `balance_abs_threshold` and is more than `balance_rel_threshold` times it),
    to the least loaded. Each server's tree is cut to `max_tree_size` characters (least
    recently sent first) as a request takes it past them: what it added past the bound, not a
    walk over the tree that would hold up every request meanwhile (SGLang's background cut
    every --eviction-interval-secs: that flag is accepted, and does nothing here)."""

    policy: str | None = None
    prefill_policy: str | None = None
    decode_policy: str | None = None
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    max_tree_size: int = 2**26

    def __post_init__(self) -> None:
        for flag, name in [
            ("--policy", self.policy),
            ("--prefill-policy", self.prefill_policy),
            ("--decode-policy", self.decode_policy),
        ]:
            if name is not None and name not in POLICIES:
                raise DsakvError(f"{flag} must be one of {', '.join(POLICIES)}, got {name!r}")
        for flag, ok, want, value in [
            ("--cache-threshold", 0 <= self.cache_threshold <= 1, "in [0, 1]",
             self.cache_threshold),
            ("--balance-abs-threshold", self.balance_abs_threshold >= 0, "an integer >= 0",
             self.balance_abs_threshold),
            ("--balance-rel-threshold", 1 <= self.balance_rel_threshold < math.inf,
             "a number >= 1", self.balance_rel_threshold),
            ("--max-tree-size", self.max_tree_size >= 1, "an integer >= 1", self.max_tree_size),
        ]:  # fmt: skip
            if not ok:
                raise DsakvError(f"{flag} must be {want}, got {value!r}")

    def policy_of(self, kind: str) -> str:
        """The policy picking `kind` ("prefill" or "decode") servers."""
        own = self.prefill_policy if kind == "prefill" else self.decode_policy
        return own or self.policy or DEFAULT_POLICIES[kind]


class Policy:
    """Picks the server a request goes to, of those given (the router's that are up)."""

    name: ClassVar[str]
    needs_text: ClassVar[bool] = False  # (whether `pick` reads the request's text)

    @classmethod
    def of(cls, config: PolicyConfig) -> Policy:
        """The policy as `config` sets it (`make_policy`)."""
        return cls()

    def pick(self, urls: list[str], load: Callable[[str], int], text: str) -> str:
        raise NotImplementedError

    def sent(self, url: str, text: str) -> None:
        """A request with `text` went to `url`: told once it is there (its pick may have
        been passed over, the server down), so that a policy keeping track records where
        requests went, not where it meant them to go."""

    def forget(self, url: str) -> None:
        """A server removed: what it was sent is forgotten (re-added, it starts with none)."""


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._turns = 0  # (a count, taken modulo the servers there are now: none skipped)

    def pick(self, urls: list[str], load: Callable[[str], int], text: str) -> str:
        self._turns += 1
        return urls[(self._turns - 1) % len(urls)]


class Random(Policy):
    name = "random"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def pick(self, urls: list[str], load: Callable[[str], int], text: str) -> str:
        return self._rng.choice(urls)


class PowerOfTwo(Policy):
    """The less loaded of two servers drawn at random: near the least loaded, without all
    requests at once rushing to one."""

    name = "power_of_two"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def pick(self, urls: list[str], load: Callable[[str], int], text: str) -> str:
        if len(urls) == 1:
            return urls[0]
        a, b = self._rng.sample(urls, 2)
        return a if load(a) <= load(b) else b


class CacheAware(Policy):
    """SGLang's cache-aware policy (`PolicyConfig`): the tree of the server a request went
    to (`sent`) gets its text."""

    name = "cache_aware"
    needs_text = True

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        self.tree = PrefixTree()
        # Its picks, as SGLang's router counts them (/metrics): by a match over the threshold
        # (a cache hit), else by the smallest tree (a miss); while imbalanced, neither.
        self.hits = self.misses = self.rebalanced = 0

    @classmethod
    def of(cls, config: PolicyConfig) -> Policy:
        return cls(config)

    def pick(self, urls: list[str], load: Callable[[str], int], text: str) -> str:
        c = self.config
        loads = {u: load(u) for u in urls}
        most, least = max(loads.values()), min(loads.values())
        if most - least > c.balance_abs_threshold and most > least * c.balance_rel_threshold:
            self.rebalanced += 1
            return min(urls, key=loads.__getitem__)  # (shortest queue)
        matched = self.tree.match(text)
        url = max(urls, key=lambda u: (matched.get(u, 0), -loads[u]))
        if text and matched.get(url, 0) / len(text) > c.cache_threshold:
            self.hits += 1
            return url
        self.misses += 1
        return min(urls, key=lambda u: (self.tree.size(u), loads[u]))  # (most room)

    def sent(self, url: str, text: str) -> None:
        self.tree.insert(text, url)
        self.tree.evict(self.config.max_tree_size, url)

    def forget(self, url: str) -> None:
        self.tree.remove(url)


# Each policy by its name (SGLang's), in --policy's order.
_CLASSES: dict[str, type[Policy]] = {
    p.name: p for p in (Random, RoundRobin, CacheAware, PowerOfTwo)
}
POLICIES = tuple(_CLASSES)


def make_policy(name: str, config: PolicyConfig) -> Policy:
    return _CLASSES[name].of(config)


class _Node:
    __slots__ = ("text", "children", "tenants", "below", "parent")

    def __init__(self, text: str, parent: _Node | None) -> None:
        self.text = text
        self.children: dict[str, _Node] = {}  # by their text's first character
        self.tenants: dict[str, int] = {}  # server -> when last sent this text (a tick)
        self.below: dict[str, int] = {}  # server -> how many children it holds (none: absent)
        self.parent = parent


class PrefixTree:
    """SGLang router's approximate radix tree: one over every server's (its tenants') texts,
    each node holding a run of characters and which servers were sent it, when last. A
    node's servers hold its parent too (a text is marked from the root down; eviction takes
    leaves first), so one walk tells each server's longest match. Each server's leaves wait
    in a heap, the least recently sent first, and each node counts its children holding
    each server (whether it is that server's leaf: one look-up, however many children other
    servers gave it), so an eviction costs what it removes."""

    def __init__(self) -> None:
        self.root = _Node("", None)
        self._sizes: Counter[str] = Counter()  # characters each server holds
        self._ticks = itertools.count(1)
        self._nodes: Counter[str] = Counter()  # nodes each server holds
        # Per server, (tick, seq, node) for each of its leaves; entries gone stale (the node
        # sent again since, or no longer its leaf) are skipped, and dropped once they could
        # be half of a heap (`_push`).
        self._leaves: dict[str, list[tuple[int, int, _Node]]] = {}
        self._seq = itertools.count()  # (ties: no node compared)

    def size(self, tenant: str) -> int:
        return self._sizes[tenant]

    def insert(self, text: str, tenant: str) -> None:
        now = next(self._ticks)
        node, i = self.root, 0
        node.tenants[tenant] = now
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                child = node.children[text[i]] = _Node(text[i:], node)
            else:
                n = _shared(child.text, text, i)
                if n < len(child.text):
                    child = self._split(child, n)
            i += len(child.text)
            if tenant not in child.tenants:
                self._sizes[tenant] += len(child.text)
                self._nodes[tenant] += 1
                node.below[tenant] = node.below.get(tenant, 0) + 1
            child.tenants[tenant] = now
            node = child
        if node is not self.root:
            self._push(tenant, node)

    def match(self, text: str) -> dict[str, int]:
        """How many leading characters of `text` each server's texts share (none: absent)."""
        matched: dict[str, int] = {}
        node, i = self.root, 0
        while i < len(text) and (child := node.children.get(text[i])) is not None:
            n = _shared(child.text, text, i)
            i += n
            matched.update(dict.fromkeys(child.tenants, i))
            if n < len(child.text):
                break
            node = child
        return matched

    def evict(self, max_size: int, tenant: str | None = None) -> None:
        """Each server (or `tenant`) holding more than `max_size` characters loses its least
        recently sent leaves until it holds no more."""
        for t in [tenant] if tenant is not None else list(self._sizes):
            heap = self._leaves.get(t, [])
            while self._sizes[t] > max_size and heap:
                entry = heapq.heappop(heap)
                if not _stands(entry, t):
                    continue  # (a later entry stands for its node, if a leaf still)
                node = entry[2]
                del node.tenants[t]
                self._sizes[t] -= len(node.text)
                self._nodes[t] -= 1
                parent = node.parent
                assert parent is not None
                parent.below[t] -= 1
                if not parent.below[t]:
                    del parent.below[t]
                if not node.tenants:  # (nor its children: theirs are its)
                    del parent.children[node.text[0]]
                if parent is not self.root and _leaf_of(parent, t):
                    self._push(t, parent)

    def remove(self, tenant: str) -> None:
        """A server's texts gone: nodes only it held go with them."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            node.tenants.pop(tenant, None)
            node.below.pop(tenant, None)  # (none of its children holds it now)
            for key, child in list(node.children.items()):
                if tenant in child.tenants:
                    if len(child.tenants) == 1:
                        del node.children[key]  # (its subtree is the server's alone)
                    else:
                        stack.append(child)
        self._sizes.pop(tenant, None)
        self._nodes.pop(tenant, None)
        self._leaves.pop(tenant, None)

    def _push(self, tenant: str, node: _Node) -> None:
        """`node`, sent to `tenant` last at its tick, on the heap of its leaves. A heap with
        more than twice as many entries as the server has nodes loses its stale ones: a
        cost of its length once it grew by half that in entries (the same texts sent
        again), none while the tree grows."""
        heap = self._leaves.setdefault(tenant, [])
        heapq.heappush(heap, (node.tenants[tenant], next(self._seq), node))
        if len(heap) > 2 * self._nodes[tenant] + 1024:
            heap[:] = [e for e in heap if _stands(e, tenant)]
            heapq.heapify(heap)

    def _split(self, child: _Node, n: int) -> _Node:
        """`child` cut after its first `n` characters: the new node holding them."""
        parent = child.parent
        assert parent is not None
        head = _Node(child.text[:n], parent)
        head.tenants = dict(child.tenants)
        head.below = dict.fromkeys(child.tenants, 1)  # (its one child holds them all)
        self._nodes.update(head.tenants.keys())
        child.text, child.parent = child.text[n:], head
        head.children[child.text[0]] = child
        parent.children[head.text[0]] = head
        return head


def _stands(entry: tuple[int, int, _Node], tenant: str) -> bool:
    """Whether a heap entry is its node's: `tenant`'s leaf, not sent again since."""
    tick, _, node = entry
    return node.tenants.get(tenant) == tick and _leaf_of(node, tenant)


def _leaf_of(node: _Node, tenant: str) -> bool:
    """Whether `node` is one of `tenant`'s leaves: it holds it, and none of its children."""
    return tenant in node.tenants and tenant not in node.below


def _shared(run: str, text: str, at: int) -> int:
    """How many characters `run` and `text[at:]` share at their start (compared in C, by
    halves, not one by one in Python)."""
    other = text[at : at + len(run)]
    lo, hi = 0, len(other)
    if run[:hi] == other:
        return hi
    while hi - lo > 1:  # run[:lo] == other[:lo], run[:hi] != other[:hi]
        mid = (lo + hi) // 2
        if run[lo:mid] == other[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def routing_text(body: dict[str, Any]) -> str:
    """A request's prompt as text, as SGLang's router keys its trees: a completion's
    `prompt` (several joined by spaces, token ids as numbers), SGLang's /generate `text` or
    `input_ids`, the text of chat's and Anthropic's `messages` (Anthropic's `system`
    first), a Responses API request's `instructions` and `input`, /v1/score's `query`. Only
    an approximation of the servers' prompts (no chat template), but two requests sharing a
    prefix here share one there."""
    out: list[str] = []
    for key in _TEXT_KEYS:
        _texts(body.get(key), out, _DEPTH)
    return " ".join(out)


def _texts(value: Any, out: list[str], depth: int) -> None:
    """The texts in `value` appended to `out`: strings, token ids, and the `content` and
    `text` of messages, input items and content parts (an image's URL is not text)."""
    if isinstance(value, str):
        out.append(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        out.append(str(value))
    elif depth and isinstance(value, list):
        for v in value:
            _texts(v, out, depth - 1)
    elif depth and isinstance(value, dict):
        _texts(value.get("content"), out, depth - 1)
        _texts(value.get("text"), out, depth - 1)


# The body fields holding a prompt's text, in the order a prompt has them.
_TEXT_KEYS = ("instructions", "system", "prompt", "text", "input_ids", "query", "messages", "input")
# How deep a body's texts are looked for: messages' content parts' text, lists of prompts'
# token ids; a body nested deeper (an attack) is not walked down to the interpreter's limit.
_DEPTH = 5
