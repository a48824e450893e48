"""`KVEventsConfig`: vLLM's and SGLang's `--kv-events-config`, parsed and checked (no zmq
here: the publisher, `dsakv.engine.kv_events`, imports it only when events are on).

vLLM's keys and defaults. vLLM publishes only with `enable_kv_cache_events` true (its
`publisher` then defaults to "zmq"); SGLang's JSON has no such key and publishes whenever
`publisher` is "zmq": both spellings turn events on here (`parse`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from dsakv.errors import ConfigError, is_int, load_object

PUBLISHERS = ("null", "zmq")
# The integers' ranges (name, least, most): ZMQ takes its high-water mark as a C int, a
# deque or queue its length as a C ssize_t; past them the publisher could not start
_BOUNDS = (
    ("buffer_steps", 0, sys.maxsize),
    ("hwm", 0, 2**31 - 1),
    ("max_queue_size", 1, sys.maxsize),
)


@dataclass(frozen=True)
class KVEventsConfig:
    """Where and how KV cache events are published (vLLM's `KVEventsConfig`)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # None: "zmq" when enabled, else "null" (vLLM's)
    endpoint: str = "tcp://*:5557"  # PUB: bound or connected to (`kv_events._binds`)
    replay_endpoint: str | None = None  # ROUTER, always bound: missed batches on request
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark (0: none)
    max_queue_size: int = 100_000  # batches waiting for the publisher thread, at most
    topic: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ConfigError(
                f"enable_kv_cache_events must be true or false, got {self.enable_kv_cache_events!r}"
            )
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in PUBLISHERS:
            raise ConfigError(f"publisher must be null or zmq, got {self.publisher!r}")
        for name, least, most in _BOUNDS:
            value = getattr(self, name)
            if not is_int(value) or not least <= value <= most:
                raise ConfigError(
                    f"{name} must be an integer >= {least} and <= {most}, got {value!r}"
                )
        if not isinstance(self.topic, str):
            raise ConfigError(f"topic must be a string, got {self.topic!r}")
        _check_endpoint("endpoint", self.endpoint)
        if self.replay_endpoint is not None:
            _check_endpoint("replay_endpoint", self.replay_endpoint)

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def parse(cls, source: str | Mapping[str, Any] | KVEventsConfig) -> KVEventsConfig:
        """JSON text, a dict or a config; ConfigError (one line) for anything else, an
        unknown key or a bad value."""
        if isinstance(source, KVEventsConfig):
            return source
        raw = dict(load_object(source, [f.name for f in fields(cls)]))
        if "enable_kv_cache_events" not in raw and raw.get("publisher") == "zmq":
            raw["enable_kv_cache_events"] = True  # (SGLang's spelling)
        return cls(**raw)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    def endpoints(self, rank: int) -> tuple[str, str | None]:
        """The PUB and replay endpoints of data-parallel rank `rank`: vLLM's, a TCP port
        plus the rank (an ipc or inproc name gets `_dp<rank>`)."""
        return _offset(self.endpoint, rank), _offset(self.replay_endpoint, rank)

    def shifted(self, n: int) -> KVEventsConfig:
        """These endpoints `n` ports on: the second server of a pair (serve-pd's decode
        server, after the prefill server's `n` ranks)."""
        endpoint, replay_endpoint = self.endpoints(n)
        return replace(self, endpoint=endpoint, replay_endpoint=replay_endpoint)

    def check_ranks(self, ranks: int) -> None:
        """Every endpoint ranks 0..`ranks`-1 bind, refused where two are one (a replay port
        one above the PUB port is rank 1's PUB port, say)."""
        used = [e for r in range(ranks) for e in self.endpoints(r) if e]
        clash = sorted({e for e in used if used.count(e) > 1})
        if clash:
            raise ConfigError(
                f"{', '.join(clash)} would be bound twice (each of {ranks} rank(s) "
                "publishes on the endpoint's port plus its rank, as vLLM's): space endpoint "
                "and replay_endpoint further apart"
            )


def _check_endpoint(name: str, value: Any) -> None:
    if not isinstance(value, str) or not value.startswith(("tcp://", "ipc://", "inproc://")):
        raise ConfigError(f"{name} must be a tcp://, ipc:// or inproc:// address, got {value!r}")
    if value.startswith("tcp://"):
        _, _, port = value.rpartition(":")
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"{name} must end in a port 1..65535 (tcp://*:5557), got {value!r}")


def _offset(endpoint: str | None, rank: int) -> str | None:
    if endpoint is None or rank == 0:
        return endpoint
    if not endpoint.startswith("tcp://"):
        return f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    if int(port) + rank > 65535:
        raise ConfigError(f"{endpoint} plus rank {rank} is past port 65535")
    return f"{base}:{int(port) + rank}"
