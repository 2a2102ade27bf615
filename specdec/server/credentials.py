"""TLS material for servers and channels, channel construction and call deadlines.

Plaintext is possible only when the settings say so explicitly (ServerSettings / ClientSettings
refuse to be built otherwise), so a forgotten flag fails at start rather than serving in the clear.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import grpc
import grpc.aio

from specdec.rpc import RECONNECT_BACKOFF
from specdec.server.settings import ClientSettings, ServerSettings

# Client pings keep idle HTTP/2 connections to replicas alive through NATs and load balancers and
# detect a dead peer in keepalive_time + keepalive_timeout instead of the kernel's TCP timeout.
_CLIENT_KEEPALIVE = (
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
)
# The server must tolerate those pings, or it answers them with GOAWAY "too_many_pings".
_SERVER_KEEPALIVE = (
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
)


def _read(path: Path | None) -> bytes | None:
    return Path(path).read_bytes() if path is not None else None


def message_size_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def server_options(settings: ServerSettings) -> list[tuple[str, int]]:
    return [*message_size_options(settings.max_message_bytes), *_SERVER_KEEPALIVE]


def server_credentials(settings: ServerSettings) -> grpc.ServerCredentials | None:
    """TLS (or mutual TLS when a client CA is set) credentials; None only for explicit plaintext."""
    if settings.plaintext:
        return None
    key_pair = (_read(settings.tls_key), _read(settings.tls_cert))
    client_ca = _read(settings.tls_client_ca)
    return grpc.ssl_server_credentials(
        [key_pair], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def channel_credentials(client: ClientSettings) -> grpc.ChannelCredentials | None:
    """TLS channel credentials (client cert for mutual TLS, bearer token as call credentials)."""
    if client.plaintext:
        return None
    creds = grpc.ssl_channel_credentials(
        root_certificates=_read(client.tls_ca),
        private_key=_read(client.tls_key),
        certificate_chain=_read(client.tls_cert),
    )
    if client.auth_token:
        creds = grpc.composite_channel_credentials(
            creds, grpc.access_token_call_credentials(client.auth_token)
        )
    return creds


class DefaultTimeoutInterceptor(grpc.aio.UnaryUnaryClientInterceptor):
    """Gives every unary call without a deadline `timeout_s`, so no internal call can hang forever.

    Unary-unary only, and on purpose: grpc.aio files an interceptor under the first call kind it
    subclasses, so a second base class would never run anyway, and the one streamed call (the public
    Generate) must not get a 30 s default: a long generation outlives it. Its callers set their own
    deadline (specdec.client: timeout_s, 600 s by default)."""

    def __init__(self, timeout_s: float):
        self._timeout_s = timeout_s

    def _with_deadline(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        if details.timeout is not None:
            return details
        return grpc.aio.ClientCallDetails(
            details.method, self._timeout_s, details.metadata, details.credentials, details.wait_for_ready
        )

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._with_deadline(client_call_details), request)


def call_timeout(default_s: float, context: grpc.aio.ServicerContext | None = None) -> float:
    """Deadline for a call made while serving `context`: never past the caller's own deadline."""
    remaining = context.time_remaining() if context is not None else None
    return default_s if remaining is None else max(0.0, min(default_s, remaining))


def create_channel(
    target: str,
    client: ClientSettings,
    *,
    interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
    tracer_provider=None,
    trace: bool = True,
) -> grpc.aio.Channel:
    """An asyncio channel with TLS per `client`, keepalive, message limits, default deadline and
    (unless trace=False) W3C trace-context propagation on every call, with an OpenTelemetry client
    span when `tracer_provider` exports spans."""
    chain: list[grpc.aio.ClientInterceptor] = [DefaultTimeoutInterceptor(client.timeout_s)]
    if trace:
        from specdec.observability.tracing import client_interceptors

        chain.extend(client_interceptors(tracer_provider))
    chain.extend(interceptors)
    options = [*message_size_options(client.max_message_bytes), *_CLIENT_KEEPALIVE, *RECONNECT_BACKOFF]
    if client.tls_server_name:
        options.append(("grpc.ssl_target_name_override", client.tls_server_name))
    creds = channel_credentials(client)
    if creds is None:
        return grpc.aio.insecure_channel(target, options=options, interceptors=chain)
    return grpc.aio.secure_channel(target, creds, options=options, interceptors=chain)
