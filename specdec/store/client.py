"""The Redis client of a coordinator, and what a client sees while Redis is away.

A Redis restart or failover drops every connection for a moment (a replica promoted, a pod
rescheduled, an AOF reloaded: Redis answers LOADING until it is done). Commands therefore retry a
lost or refused connection with exponential backoff for `retry_s` seconds, so that a short outage
only delays a stream. A command that times out is not retried: it may be running on the server,
and the session scripts' version fence would refuse its second run anyway.

Past the retry window the store raises StoreUnavailable, which the coordinator maps to UNAVAILABLE
(a status clients retry). Nothing a client received is lost: a block is streamed only once Redis
has recorded it, so a stream cut this way resumes from where it stopped once Redis is back
(with its data: the chart's Redis keeps an append-only file).
"""

from __future__ import annotations

import functools
from typing import Awaitable, Callable, ParamSpec, TypeVar

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from specdec.errors import SpecDecError

BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 0.5

P = ParamSpec("P")
R = TypeVar("R")


class StoreUnavailable(SpecDecError):
    """Redis did not answer within the command deadline and the retry window (maps to UNAVAILABLE)."""

    def __init__(self, cause: BaseException):
        super().__init__(
            f"the session store (Redis) did not answer ({type(cause).__name__}); every token already "
            "streamed is recorded there: retry the request, or continue a started stream with "
            "ResumeStream, once Redis is back"
        )


def retries_within(retry_s: float, base_s: float = BACKOFF_BASE_S, cap_s: float = BACKOFF_CAP_S) -> int:
    """How many retries of ExponentialBackoff(cap_s, base_s) fit in retry_s seconds of waiting
    (the first retry that would end past it is not made)."""
    waited, retries = 0.0, 0
    while True:
        wait = min(cap_s, base_s * 2 ** (retries + 1))  # redis-py's backoff after failure n is base * 2^n
        if waited + wait > retry_s + 1e-9:  # float sums: 0.1 + 0.2 + 0.4 + 0.5 fits in 1.2
            return retries
        waited += wait
        retries += 1


def connect(url: str, *, timeout_s: float, retry_s: float) -> redis.Redis:
    """An asyncio client with a deadline of timeout_s per command and retry_s of reconnecting."""
    return redis.Redis.from_url(
        url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
        # ConnectionError includes LOADING (BusyLoadingError) after a restart; TimeoutError is left out
        retry=Retry(ExponentialBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S), retries_within(retry_s),
                    supported_errors=(RedisConnectionError,)),
        retry_on_error=[RedisConnectionError],
    )


def translated(method: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    """A store method whose unanswered Redis calls raise StoreUnavailable (a domain error)."""

    @functools.wraps(method)
    async def call(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await method(*args, **kwargs)
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise StoreUnavailable(exc) from exc

    return call
