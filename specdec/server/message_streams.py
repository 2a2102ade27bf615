"""The server side of the per-cycle message streams (VerifyStream, ProposeStream; the client side is
cycle_streams.py): a session's stream stays open between its cycles, idle most of the time.

A graceful shutdown waits up to its grace period for calls in flight, and an idle stream counts as
one: every coordinator's open streams would hold each restart for the whole grace period, and keep
cycles coming to a replica that is going away. So when the service stops taking calls (end(), a
hook ServiceHost runs then), each idle stream ends at once with status OK, and a stream whose
message is being answered ends after its answer. Nothing is in flight on either, so its client just
opens a new stream for the session's next call, which the stopped server refuses (UNAVAILABLE), and
the coordinator recovers as after any call a stopping replica refused.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator

from specdec.observability.tracing import received_message_span


class MessageStreams:
    def __init__(self) -> None:
        self.tracer = None  # set when the service exports spans: a SERVER span per message (span())
        self.ended = False
        self._idle: set[asyncio.Task] = set()  # handlers waiting for their stream's next request
        self._ending: set[asyncio.Task] = set()  # of those, the ones end() cancelled

    async def requests(self, requests: AsyncIterable) -> AsyncIterator:
        """A stream handler's requests, until the stream or the service ends."""
        task = asyncio.current_task()
        iterator = aiter(requests)
        while not self.ended:
            self._idle.add(task)
            try:
                message = await anext(iterator)
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if task not in self._ending:  # the call itself was cancelled
                    raise
                task.uncancel()  # only to wake it: the stream ends as its client's stream would
                return
            finally:
                self._idle.discard(task)
                self._ending.discard(task)
            yield message

    def span(self, method: str, trace_context):
        """Around answering one message: the span the unary call `method` would have had, in the trace
        the message carries (a stream outlives its cycles' traces)."""
        return received_message_span(self.tracer, method, trace_context)

    def end(self) -> None:
        """No more requests: idle streams end now, busy ones after their answer."""
        self.ended = True
        for task in self._idle - self._ending:
            self._ending.add(task)
            task.cancel()
