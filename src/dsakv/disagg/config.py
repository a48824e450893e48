"""`DisaggConfig`: a server's role in prefill/decode disaggregation (SGLang's flag names)."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dsakv.errors import DsakvError

if TYPE_CHECKING:
    from dsakv.engine import EngineConfig

MODES = ("prefill", "decode")
DEFAULT_BOOTSTRAP_PORT = 8998
# What the router tells both servers about a request: its room, and where the prefill
# server's bootstrap listens (the decode server connects there).
ROOM_HEADER = "x-dsakv-bootstrap-room"
HOST_HEADER = "x-dsakv-bootstrap-host"
PORT_HEADER = "x-dsakv-bootstrap-port"
# vLLM's P/D hand-off: the request field (and the `param` its errors name)
KV_PARAM = "kv_transfer_params"


@dataclass(frozen=True)
class DisaggConfig:
    """`mode`: prefill or decode. A prefill server listens for decode servers' handshakes
    on `bootstrap_port`. `timeout_s`: how long either side waits for the other (a decode
    server frees its reserved pages after that long without a word from the prefill
    server). `transfer_host`: the address Mooncake listens on (None: the server's host,
    or this machine's address when that is a wildcard)."""

    mode: str
    bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT
    timeout_s: float = 60.0
    transfer_host: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise DsakvError(f"disaggregation mode must be prefill or decode, got {self.mode!r}")
        if not 0 < self.bootstrap_port < 65536:
            raise DsakvError(f"bootstrap port must be in 1..65535, got {self.bootstrap_port}")
        if not self.timeout_s > 0:
            raise DsakvError(f"disaggregation timeout must be > 0, got {self.timeout_s}")

    def check_engine(self, config: EngineConfig) -> None:
        """What a prefill or decode server cannot serve yet, before anything loads."""
        pc = config.parallel
        if pc.pp > 1:  # (a pool per stage)
            raise DsakvError(
                "--disaggregation-mode does not run with --pp-size > 1 yet (it runs with "
                "--tp, --ep and --dp-attention)"
            )
        if pc.dp_attention and pc.nnodes > 1:  # (each rank's transfer engine: rank 0's host)
            raise DsakvError(
                "--disaggregation-mode with --dp-attention runs on one machine yet (--nnodes "
                f"{pc.nnodes}): every rank's pool is registered at rank 0's address"
            )
        if config.enable_hisparse and self.mode == "prefill":
            raise DsakvError(
                "--enable-hisparse is for the decode server: a prefill server keeps its "
                "prompts on the device and writes their latent into the decode server's "
                "host memory"
            )

    def host_for(self, server_host: str) -> str:
        """The address peers reach this server's Mooncake engine at."""
        if self.transfer_host:
            return self.transfer_host
        if server_host in ("", "0.0.0.0", "::"):
            return socket.gethostbyname(socket.gethostname())
        return "127.0.0.1" if server_host == "localhost" else server_host
