"""A session's per-cycle calls (Verify, Propose) as messages of one open bidirectional stream.

A unary call pays, every cycle, a new HTTP/2 stream, its metadata, its status and the completion
events of each; a message on an open stream pays one write and one read. On two CPU cores that is
about 0.9 ms instead of 1.6 ms of round trip around a 7 ms step (scripts/bench_grpc_floor.py), and a
speculative cycle makes two such calls.

The answers keep the unary call's meaning: the service answers each message with what the call would
return, and ends the stream with the call's status (and trailing metadata) where the call would have
failed, so errors come back as the same domain errors. What a stream changes, and how it is kept safe:
- No deadline per message on the wire: each answer must come within timeout_s, else the stream is
  cancelled and the call raises ServiceUnavailable, as a call past its deadline would.
- One call at a time per stream: a second call of the session while one is in flight (which the
  coordinator's loop does not make) goes as a unary call, so answers can never be paired wrongly.
- Anything that leaves a stream unsure (an error, a timeout, a cancelled caller) discards it; the
  session's next call opens a new one. A stream that ended while idle (a restarted service) had
  nothing in flight, so the next call simply opens a new one, as a unary call would dial again.
- A service older than the stream RPC (UNIMPLEMENTED) is called unary from then on.
- Streams of sessions idle for idle_s, and the least recently used past max_open, are closed, so
  sessions kept between turns hold no stream.
- A stream outlives its cycles' traces, so each message carries its own trace context, and gets its
  own CLIENT span when the caller's spans are exported; the service makes a SERVER span per message
  under it. Both are named as the unary call's, so a trace reads the same either way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import grpc.aio

from specdec import errors
from specdec.observability.tracing import sent_message_span

log = logging.getLogger(__name__)

Unwrap = Callable[[object], object]  # the stream's response message -> the unary call's response


@dataclass
class _Stream:
    call: grpc.aio.StreamStreamCall
    last_used: float
    busy: bool = False


class SessionStreams:
    """The open streams of one stream RPC (VerifyStream, ProposeStream) on one channel, by session.

    call() returns the unary response, or None when the caller should make the unary call itself
    (the session's stream is busy, it ended just before this request could be written, or the service
    has no stream RPC)."""

    def __init__(self, method: grpc.aio.StreamStreamMultiCallable, wrap: Callable[[object], object], unwrap: Unwrap,
                 *, service: str, timeout_s: float, metadata=(), idle_s: float = 30.0, max_open: int = 1024,
                 tracer=None, span_name: str = ""):
        self._method, self._wrap, self._unwrap = method, wrap, unwrap
        self.service, self.timeout_s, self.metadata = service, timeout_s, tuple(metadata)
        # A CLIENT span per message, named as the unary call's (span_name), when the caller's spans
        # are exported (tracer); each message carries its trace context either way.
        self.tracer, self.span_name = tracer, span_name
        self.idle_s, self.max_open = idle_s, max_open
        self._open: OrderedDict[str, _Stream] = OrderedDict()  # least recently used first
        self.unimplemented = False
        self.answered = 0  # calls answered on a stream (the rest went unary)

    def __len__(self) -> int:
        return len(self._open)

    async def call(self, session_id: str, request, on_error: Callable[[grpc.aio.AioRpcError], Exception]):
        if self.unimplemented:
            return None
        stream = self._open.get(session_id)
        if stream is not None and stream.busy:
            return None
        if stream is not None and stream.call.done():  # ended while idle: nothing was in flight
            self._discard(session_id)
            stream = None
        if stream is None:
            stream = self._start(session_id)
        self._open.move_to_end(session_id)
        stream.busy = True
        sent = self._wrap(request)
        try:
            with sent_message_span(self.tracer, self.span_name, sent.trace_context):
                message = await self._exchange(stream.call, sent)
        except _NotSent:  # the stream ended (status OK) just before the write: this call goes unary
            self._discard(session_id)
            return None
        except TimeoutError:
            self._discard(session_id)
            raise errors.ServiceUnavailable(f"{self.service} sent no answer for {self.timeout_s} s") from None
        except grpc.aio.AioRpcError as err:
            self._discard(session_id)
            if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.unimplemented = True
                log.warning("the %s has no stream RPC for its cycle calls (an older version): one call per cycle",
                            self.service)
                return None
            raise on_error(err) from err
        except BaseException:  # a cancelled caller, or anything unforeseen: the stream's state is unknown
            self._discard(session_id)
            raise
        if message is grpc.aio.EOF:  # the service closed the stream without an answer (shutting down)
            self._discard(session_id)
            raise errors.ServiceUnavailable(f"{self.service} closed the session's stream without an answer")
        stream.busy, stream.last_used = False, time.monotonic()
        self.answered += 1
        return self._unwrap(message)

    async def _exchange(self, call: grpc.aio.StreamStreamCall, message):
        try:
            await call.write(message)
        except asyncio.InvalidStateError:  # the call ended before this write (grpc.aio raises this, not its status)
            code = await call.code()
            if code == grpc.StatusCode.OK:
                raise _NotSent() from None
            raise grpc.aio.AioRpcError(code, await call.initial_metadata(), await call.trailing_metadata(),
                                       await call.details()) from None
        async with asyncio.timeout(self.timeout_s):
            return await call.read()

    def close(self, session_id: str) -> None:
        if session_id in self._open and not self._open[session_id].busy:
            self._discard(session_id)

    def close_all(self) -> None:
        for session_id in list(self._open):
            self._discard(session_id)

    def _start(self, session_id: str) -> _Stream:
        now = time.monotonic()
        for old_id, old in list(self._open.items()):  # oldest first
            if old.busy:
                continue
            if now - old.last_used < self.idle_s and len(self._open) < self.max_open:
                break
            self._discard(old_id)
        stream = self._open[session_id] = _Stream(self._method(metadata=self.metadata or None), now)
        return stream

    def _discard(self, session_id: str) -> None:
        stream = self._open.pop(session_id, None)
        if stream is not None:
            stream.call.cancel()  # a no-op once the stream ended


class _NotSent(Exception):
    """The session's stream had ended (status OK) before the request could be written."""
