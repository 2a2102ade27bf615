"""grpc.aio server interceptors: domain errors -> status codes, and bearer-token auth.

Both wrap the handler's behaviour in a function of the same shape (coroutine for unary responses,
async generator for streamed ones) because grpc.aio decides how to drive a handler from its type.
"""

from __future__ import annotations

import hashlib
import hmac
import inspect
import logging
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType

import grpc
import grpc.aio
from grpc_health.v1 import health as _health
from grpc_reflection.v1alpha import reflection as _reflection
from opentelemetry import trace

from specdec import errors
from specdec.rpc import ACTUAL_POSITION_KEY

logger = logging.getLogger(__name__)

# Probes and tooling must work without a token: health carries no data, reflection only schemas.
EXEMPT_SERVICES = frozenset({_health.SERVICE_NAME, _reflection.SERVICE_NAME})

_KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
# Looked up along the exception's MRO, so ContextOverflow inherits InvalidArgument's code.
STATUS_BY_ERROR: Mapping[type[BaseException], grpc.StatusCode] = MappingProxyType(
    {
        errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
        errors.SessionNotFound: grpc.StatusCode.NOT_FOUND,
        errors.SessionExists: grpc.StatusCode.ALREADY_EXISTS,
        errors.PositionMismatch: grpc.StatusCode.FAILED_PRECONDITION,
        errors.CacheFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
        errors.IncompatibleModels: grpc.StatusCode.FAILED_PRECONDITION,
        errors.EpochMismatch: grpc.StatusCode.FAILED_PRECONDITION,
    }
)

Wrap = Callable[[Callable, bool], Callable]


def service_of(method: str | bytes) -> str:
    """'/pkg.Service/Method' -> 'pkg.Service'."""
    if isinstance(method, bytes):
        method = method.decode()
    return method.lstrip("/").split("/", 1)[0]


def replace_behavior(handler: grpc.RpcMethodHandler, wrap: Wrap) -> grpc.RpcMethodHandler:
    """The same handler with its behaviour passed through wrap(behavior, response_streaming)."""
    for kind in _KINDS:
        behavior = getattr(handler, kind)
        if behavior is not None:
            return handler._replace(**{kind: wrap(behavior, handler.response_streaming)})
    return handler


def grpc_status(
    exc: BaseException, codes: Mapping[type[BaseException], grpc.StatusCode] = STATUS_BY_ERROR
) -> tuple[grpc.StatusCode, tuple[tuple[str, str], ...]] | None:
    """(code, trailing metadata) for a mapped error; None for anything else.

    An error can add trailing metadata by defining `trailing_metadata() -> [(key, value), ...]`
    (e.g. a draft service's epoch mismatch); PositionMismatch always carries the actual position.
    """
    for cls in type(exc).__mro__:
        code = codes.get(cls)
        if code is not None:
            extra = getattr(exc, "trailing_metadata", None)
            trailing = tuple(extra()) if callable(extra) else ()
            if isinstance(exc, errors.PositionMismatch):
                trailing += ((ACTUAL_POSITION_KEY, str(exc.actual)),)
            return code, trailing
    return None


async def _abort_for(exc: Exception, context: grpc.aio.ServicerContext, method: str, codes) -> None:
    if isinstance(exc, grpc.aio.AbortError):  # the handler aborted on purpose
        raise exc
    mapped = grpc_status(exc, codes)
    if mapped is not None:
        code, trailing = mapped
        await context.abort(code, str(exc), trailing)
    trace_id = trace.get_current_span().get_span_context().trace_id
    reference = f" (trace_id={trace_id:032x})" if trace_id else ""
    logger.exception("unhandled error in %s%s", method, reference)
    await context.abort(
        grpc.StatusCode.INTERNAL, f"internal error in {method}{reference}; details are in the server log"
    )


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Maps specdec.errors to status codes with the message verbatim; anything else is INTERNAL
    with a generic message (the exception is logged, never sent: it may hold internals).
    `extra_codes` adds a service's own exception types to the defaults (the most specific class
    along the exception's MRO wins)."""

    def __init__(self, extra_codes: Mapping[type[BaseException], grpc.StatusCode] | None = None):
        self._codes = {**STATUS_BY_ERROR, **(extra_codes or {})}

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        return replace_behavior(handler, lambda behavior, _: _guarded(behavior, method, self._codes))


def _guarded(behavior: Callable, method: str, codes) -> Callable:
    if inspect.isasyncgenfunction(behavior):

        async def guarded_stream(request, context):
            try:
                async for response in behavior(request, context):
                    yield response
            except Exception as exc:  # noqa: BLE001 - mapped or logged in _abort_for
                await _abort_for(exc, context, method, codes)

        return guarded_stream

    async def guarded(request, context):
        try:
            result = behavior(request, context)
            return await result if inspect.isawaitable(result) else result
        except Exception as exc:  # noqa: BLE001
            await _abort_for(exc, context, method, codes)

    return guarded


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Requires `authorization: Bearer <token>` with one of `tokens`; exempt services pass freely.

    Missing or malformed -> UNAUTHENTICATED; unknown token -> PERMISSION_DENIED. Tokens are compared
    as SHA-256 digests with hmac.compare_digest against every accepted token, so neither the length
    nor the position of a match leaks through timing.
    """

    def __init__(self, tokens: Iterable[str], exempt_services: Iterable[str] = EXEMPT_SERVICES):
        self._digests = [hashlib.sha256(t.encode()).digest() for t in tokens]
        if not self._digests:
            raise ValueError("BearerTokenInterceptor needs at least one accepted token")
        self._exempt = frozenset(exempt_services)

    def _refusal(self, metadata) -> tuple[grpc.StatusCode, str] | None:
        values = [v for k, v in metadata or () if k == "authorization"]
        scheme, _, token = (values[0] if values else "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return grpc.StatusCode.UNAUTHENTICATED, "missing 'authorization: Bearer <token>' metadata"
        digest = hashlib.sha256(token.strip().encode()).digest()
        matched = False
        for accepted in self._digests:
            matched |= hmac.compare_digest(digest, accepted)
        return None if matched else (grpc.StatusCode.PERMISSION_DENIED, "the bearer token is not accepted")

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if service_of(method) in self._exempt:
            return await continuation(handler_call_details)
        refusal = self._refusal(handler_call_details.invocation_metadata)
        handler = await continuation(handler_call_details)
        if refusal is None:
            return handler
        logger.info("refused %s: %s", method, refusal[0].name)
        if handler is None:  # unknown method: still refuse, without revealing that it is unknown
            return grpc.unary_unary_rpc_method_handler(_refuse(*refusal, streaming=False))
        return replace_behavior(handler, lambda _, streaming: _refuse(*refusal, streaming=streaming))


def _refuse(code: grpc.StatusCode, message: str, *, streaming: bool) -> Callable:
    if streaming:

        async def refuse_stream(request, context):
            await context.abort(code, message)
            yield  # unreachable; makes this an async generator like the handler it replaces

        return refuse_stream

    async def refuse(request, context):
        await context.abort(code, message)

    return refuse
