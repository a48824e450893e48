"""`HTTPConfig`: what vLLM's HTTP server does around its routes, for `dsakv serve`'s server
and the router (serve-pd's front door): CORS, TLS and the path prefix a proxy serves it
under. Light (no torch), as the router that imports it."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from dsakv.errors import DsakvError


@dataclass(frozen=True)
class HTTPConfig:
    """vLLM's `--allowed-origins` / `--allowed-methods` / `--allowed-headers` /
    `--allow-credentials` (Starlette's CORS middleware; every origin by default, as vLLM's
    and SGLang's servers allow, so that a page in a browser can call the API), its
    `--ssl-*` flags (uvicorn's TLS) and `--root-path` (FastAPI's root path: behind a proxy
    serving the API under that prefix, a request reaches its route with the prefix or
    without it)."""

    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = int(ssl.CERT_NONE)
    root_path: str = ""

    def __post_init__(self) -> None:
        if self.ssl_certfile is None:
            given = [
                flag
                for flag, v in (
                    ("--ssl-keyfile", self.ssl_keyfile),
                    ("--ssl-ca-certs", self.ssl_ca_certs),
                    ("--ssl-cert-reqs", self.ssl_cert_reqs or None),
                )
                if v is not None
            ]
            if given:
                raise DsakvError(f"{given[0]} needs --ssl-certfile (the server's certificate)")
        if self.ssl_cert_reqs not in (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED):
            raise DsakvError(f"--ssl-cert-reqs must be 0, 1 or 2, got {self.ssl_cert_reqs!r}")
        if self.ssl_cert_reqs and self.ssl_ca_certs is None:
            raise DsakvError(
                f"--ssl-cert-reqs {self.ssl_cert_reqs} checks clients' certificates against "
                "--ssl-ca-certs: give it"
            )
        if self.root_path == "/":  # (no prefix, as FastAPI reads it)
            object.__setattr__(self, "root_path", "")
        if self.root_path and not (self.root_path.startswith("/") and self.root_path[-1] != "/"):
            raise DsakvError(
                f"--root-path must start with / and not end with one, got {self.root_path!r}"
            )

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile else "http"

    def check_files(self) -> None:
        """Load the certificate, key and CAs now: a bad file is one error before anything
        listens or loads, not uvicorn's traceback once the engine is up."""
        if self.ssl_certfile is None:
            return
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        given = f"--ssl-certfile {self.ssl_certfile}"
        if self.ssl_keyfile is not None:
            given += f" with --ssl-keyfile {self.ssl_keyfile}"
        try:
            context.load_cert_chain(self.ssl_certfile, self.ssl_keyfile)
        except OSError as e:
            raise DsakvError(f"{given}: not a PEM certificate and its key ({_why(e)})") from None
        try:
            if self.ssl_ca_certs is not None:
                context.load_verify_locations(self.ssl_ca_certs)
        except OSError as e:
            raise DsakvError(
                f"--ssl-ca-certs {self.ssl_ca_certs}: not PEM certificates ({_why(e)})"
            ) from None

    def install(self, app: FastAPI) -> None:
        """The root path and CORS on `app`, the middleware outside those added before it
        (a preflight needs no API key; a 401 carries the CORS headers a browser needs to
        read it)."""
        app.root_path = self.root_path
        if not self.allowed_origins:  # (no origin: no CORS headers at all)
            return
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(self.allowed_origins),
            allow_credentials=self.allow_credentials,
            allow_methods=list(self.allowed_methods),
            allow_headers=list(self.allowed_headers),
        )

    def uvicorn_kwargs(self) -> dict[str, Any]:
        """uvicorn's TLS settings."""
        if self.ssl_certfile is None:
            return {}
        return {
            "ssl_keyfile": self.ssl_keyfile,
            "ssl_certfile": self.ssl_certfile,
            "ssl_ca_certs": self.ssl_ca_certs,
            "ssl_cert_reqs": self.ssl_cert_reqs,
        }


def _why(e: OSError) -> str:
    """A failed load's reason: the file's (missing, unreadable) or OpenSSL's."""
    if isinstance(e, ssl.SSLError):
        return e.reason or "OpenSSL cannot read it"
    return e.strerror or str(e)


def route_path(scope: dict[str, Any]) -> str:
    """The path a request's route is matched on: under a root path (`--root-path`), with
    that prefix taken off, as Starlette's routing does (a proxy may strip it or not)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and (path == root or path.startswith(root + "/")):
        return path[len(root) :] or "/"
    return path
