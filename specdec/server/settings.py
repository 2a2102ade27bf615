"""Settings shared by the three gRPC services and their clients, built once in each `main`.

Precedence is flag > environment variable > service default: `add_server_arguments` reads the
environment when it builds the parser, so `--help` shows the effective defaults. Bearer tokens are
never accepted as a flag value (they would show in `ps`): they come from a file or from
SPECDEC_AUTH_TOKENS, and they are left out of every repr.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
_OFF = ("", "none", "off", "disabled")


class ConfigError(ValueError):
    """Settings that cannot work together; the message says which flags to change."""


@dataclass(frozen=True)
class TracingSettings:
    """OpenTelemetry knobs. OTEL_TRACES_SAMPLER, when set, overrides `sampling_ratio`."""

    service_name: str = "specdec"
    sampling_ratio: float = 1.0  # ParentBased(TraceIdRatioBased(ratio)) for root spans
    cycle_span_every: int = 1  # record a specdec.cycle span for every Nth cycle (see spans.py)

    def __post_init__(self) -> None:
        if not 0.0 <= self.sampling_ratio <= 1.0:
            raise ConfigError(f"trace sampling ratio must be in [0, 1], got {self.sampling_ratio}")
        if self.cycle_span_every < 1:
            raise ConfigError(f"cycle span interval must be >= 1, got {self.cycle_span_every}")


@dataclass(frozen=True)
class ServerSettings:
    """Everything the server toolkit needs; one frozen object per service, passed down."""

    host: str = "127.0.0.1"
    port: int = 50051  # 0 picks a free port (tests)
    health_port: int | None = None  # separate plaintext grpc.health.v1 port when the main port uses TLS
    metrics_port: int | None = None  # Prometheus /metrics over HTTP; None disables it
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None  # given: mutual TLS, clients must present a cert signed by it
    plaintext: bool = False  # explicit opt-in (local launcher on localhost); never the default
    auth_tokens: frozenset[str] = field(default=frozenset(), repr=False)
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    grace_period_s: float = 15.0  # in-flight RPCs get this long after SIGTERM
    drain_period_s: float = 0.0  # NOT_SERVING is reported this long before the port stops taking calls
    tracing: TracingSettings = TracingSettings()

    def __post_init__(self) -> None:
        has_tls = self.tls_cert is not None or self.tls_key is not None
        if self.plaintext and (has_tls or self.tls_client_ca is not None):
            raise ConfigError("--plaintext and --tls-* exclude each other; choose one")
        if not self.plaintext and (self.tls_cert is None or self.tls_key is None):
            raise ConfigError(
                "TLS is required: pass --tls-cert and --tls-key (plus --tls-client-ca for mutual TLS), "
                "or --plaintext to serve without TLS (local development only)"
            )
        if self.plaintext and self.auth_tokens:
            raise ConfigError("bearer tokens over plaintext would travel in the clear; configure TLS")
        for name in ("port", "health_port", "metrics_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 65535:
                raise ConfigError(f"{name} must be in [0, 65535], got {value}")
        extra = [p for p in (self.health_port, self.metrics_port) if p]
        if self.port and self.port in extra or len(extra) != len(set(extra)):
            raise ConfigError("port, health port and metrics port must differ")
        if self.max_message_bytes <= 0:
            raise ConfigError(f"max message size must be > 0 bytes, got {self.max_message_bytes}")
        if self.grace_period_s < 0 or self.drain_period_s < 0:
            raise ConfigError("grace and drain periods must be >= 0 seconds")

    @property
    def mutual_tls(self) -> bool:
        return self.tls_client_ca is not None

    @property
    def serves_separate_health_port(self) -> bool:
        """Kubernetes' gRPC probes speak plaintext only, so a TLS port needs a plaintext twin for health."""
        return not self.plaintext and self.health_port is not None


CYCLE_CALLS = ("stream", "unary")


@dataclass(frozen=True)
class ClientSettings:
    """How a service (or a backend) reaches another service."""

    tls_ca: Path | None = None  # None with TLS: the system's root certificates
    tls_cert: Path | None = None  # client certificate, for mutual TLS
    tls_key: Path | None = None
    tls_server_name: str | None = None  # expected name in the server cert when it differs from the host
    plaintext: bool = False
    auth_token: str | None = field(default=None, repr=False)
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    timeout_s: float = 30.0  # deadline given to every call that sets none
    # A session's Verify / Propose calls as messages of one open stream ("stream") or as one call each
    # ("unary"). See specdec/server/cycle_streams.py.
    cycle_calls: str = "stream"

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("a client certificate needs both --*-tls-cert and --*-tls-key")
        if self.plaintext and (self.tls_ca or self.tls_cert):
            raise ConfigError("plaintext and client TLS settings exclude each other; choose one")
        if self.plaintext and self.auth_token:
            raise ConfigError("a bearer token over plaintext would travel in the clear; configure TLS")
        if self.timeout_s <= 0:
            raise ConfigError(f"default call timeout must be > 0 seconds, got {self.timeout_s}")
        if self.cycle_calls not in CYCLE_CALLS:
            raise ConfigError(f"cycle calls must be one of {', '.join(CYCLE_CALLS)}, got {self.cycle_calls!r}")


def load_auth_tokens(path: Path | None, env_value: str | None) -> frozenset[str]:
    """Tokens from a file (one per line, '#' comments) and/or a comma-separated env value."""
    tokens: set[str] = set()
    if path is not None:
        for line in Path(path).read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                tokens.add(line)
    if env_value:
        tokens.update(t.strip() for t in env_value.split(",") if t.strip())
    return frozenset(tokens)


def _optional_port(text: str) -> int | None:
    return None if text.strip().lower() in _OFF else int(text)


def _truthy(text: str | None) -> bool:
    return (text or "").strip().lower() in ("1", "true", "yes", "on")


def _path(text: str | None) -> Path | None:
    return Path(text) if text else None


def add_server_arguments(
    parser: argparse.ArgumentParser,
    *,
    port: int,
    health_port: int | None = None,
    metrics_port: int | None = None,
    environ: Mapping[str, str] = os.environ,
) -> None:
    """Add the common server flags; defaults come from SPECDEC_* variables, then the arguments."""
    env = environ.get
    g = parser.add_argument_group("server")
    g.add_argument("--host", default=env("SPECDEC_HOST", "127.0.0.1"), help="address to bind")
    g.add_argument("--port", type=int, default=int(env("SPECDEC_PORT", port)))
    g.add_argument(
        "--health-port",
        type=_optional_port,
        default=_optional_port(env("SPECDEC_HEALTH_PORT", str(health_port))),
        help="plaintext grpc.health.v1 port used when the main port has TLS ('none' to disable)",
    )
    g.add_argument(
        "--metrics-port",
        type=_optional_port,
        default=_optional_port(env("SPECDEC_METRICS_PORT", str(metrics_port))),
        help="Prometheus /metrics HTTP port ('none' to disable)",
    )
    g.add_argument("--tls-cert", type=Path, default=_path(env("SPECDEC_TLS_CERT")))
    g.add_argument("--tls-key", type=Path, default=_path(env("SPECDEC_TLS_KEY")))
    g.add_argument(
        "--tls-client-ca",
        type=Path,
        default=_path(env("SPECDEC_TLS_CLIENT_CA")),
        help="require client certificates signed by this CA (mutual TLS)",
    )
    g.add_argument(
        "--plaintext",
        action="store_true",
        default=_truthy(env("SPECDEC_PLAINTEXT")),
        help="serve without TLS (explicit opt-in, local development only)",
    )
    g.add_argument(
        "--auth-tokens-file",
        type=Path,
        default=_path(env("SPECDEC_AUTH_TOKENS_FILE")),
        help="accepted bearer tokens, one per line (also SPECDEC_AUTH_TOKENS, comma-separated)",
    )
    g.add_argument(
        "--max-message-bytes",
        type=int,
        default=int(env("SPECDEC_MAX_MESSAGE_BYTES", DEFAULT_MAX_MESSAGE_BYTES)),
    )
    g.add_argument(
        "--grace-period",
        type=float,
        default=float(env("SPECDEC_GRACE_PERIOD_S", 15.0)),
        help="seconds in-flight calls get after SIGTERM",
    )
    g.add_argument(
        "--drain-period",
        type=float,
        default=float(env("SPECDEC_DRAIN_PERIOD_S", 0.0)),
        help="seconds NOT_SERVING is reported before the port stops taking calls",
    )
    g.add_argument(
        "--trace-sampling-ratio", type=float, default=float(env("SPECDEC_TRACE_SAMPLING_RATIO", 1.0))
    )
    g.add_argument(
        "--trace-cycle-every",
        type=int,
        default=int(env("SPECDEC_TRACE_CYCLE_EVERY", 1)),
        help="record a specdec.cycle span for every Nth speculative cycle",
    )


def server_settings_from_args(
    args: argparse.Namespace, *, service: str, environ: Mapping[str, str] = os.environ
) -> ServerSettings:
    """Build the settings from `add_server_arguments` flags; raises ConfigError on bad combinations."""
    tracing = TracingSettings(
        service_name=environ.get("OTEL_SERVICE_NAME") or f"specdec-{service}",
        sampling_ratio=args.trace_sampling_ratio,
        cycle_span_every=args.trace_cycle_every,
    )
    return ServerSettings(
        host=args.host,
        port=args.port,
        health_port=args.health_port,
        metrics_port=args.metrics_port,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        plaintext=args.plaintext,
        auth_tokens=load_auth_tokens(args.auth_tokens_file, environ.get("SPECDEC_AUTH_TOKENS")),
        max_message_bytes=args.max_message_bytes,
        grace_period_s=args.grace_period,
        drain_period_s=args.drain_period,
        tracing=tracing,
    )


def add_client_arguments(
    parser: argparse.ArgumentParser, prefix: str, *, environ: Mapping[str, str] = os.environ
) -> None:
    """Add --<prefix>-tls-ca, --<prefix>-tls-cert, ... for calls to one upstream (e.g. 'target')."""
    env_prefix = "SPECDEC_" + prefix.upper().replace("-", "_") + "_"
    env = lambda name, default=None: environ.get(env_prefix + name, default)  # noqa: E731
    g = parser.add_argument_group(f"{prefix} client")
    g.add_argument(
        f"--{prefix}-tls-ca",
        type=Path,
        default=_path(env("TLS_CA")),
        help="CA that signed the server certificate (default: system roots)",
    )
    g.add_argument(
        f"--{prefix}-tls-cert",
        type=Path,
        default=_path(env("TLS_CERT")),
        help="client certificate for mutual TLS",
    )
    g.add_argument(f"--{prefix}-tls-key", type=Path, default=_path(env("TLS_KEY")))
    g.add_argument(f"--{prefix}-tls-server-name", default=env("TLS_SERVER_NAME"))
    g.add_argument(f"--{prefix}-plaintext", action="store_true", default=_truthy(env("PLAINTEXT")))
    g.add_argument(
        f"--{prefix}-auth-token-file",
        type=Path,
        default=_path(env("AUTH_TOKEN_FILE")),
        help=f"bearer token to send (also {env_prefix}AUTH_TOKEN)",
    )
    g.add_argument(
        f"--{prefix}-timeout",
        type=float,
        default=float(env("TIMEOUT_S", 30.0)),
        help="deadline in seconds for calls that set none",
    )
    g.add_argument(
        f"--{prefix}-cycle-calls",
        choices=CYCLE_CALLS,
        default=env("CYCLE_CALLS", "stream"),
        help="a session's per-cycle calls as messages of one open stream (saves each call's setup) or one call each",
    )


def client_settings_from_args(
    args: argparse.Namespace,
    prefix: str,
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    environ: Mapping[str, str] = os.environ,
) -> ClientSettings:
    attr = prefix.replace("-", "_")
    get = lambda name: getattr(args, f"{attr}_{name}")  # noqa: E731
    token_file = get("auth_token_file")
    token = Path(token_file).read_text().strip() if token_file else None
    token = token or environ.get("SPECDEC_" + attr.upper() + "_AUTH_TOKEN") or None
    return ClientSettings(
        tls_ca=get("tls_ca"),
        tls_cert=get("tls_cert"),
        tls_key=get("tls_key"),
        tls_server_name=get("tls_server_name"),
        plaintext=get("plaintext"),
        auth_token=token,
        max_message_bytes=max_message_bytes,
        timeout_s=get("timeout"),
        cycle_calls=get("cycle_calls"),
    )
