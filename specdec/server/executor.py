"""A dedicated thread for model work, so `async def` handlers never block the event loop."""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class ModelExecutor:
    """One worker thread for model work, so the event loop keeps answering health checks and
    streams while a forward pass runs. One thread also serialises GPU use, which the batching
    engines expect. The caller's contextvars (the current span) travel into the thread.
    Cancelling an awaiting caller drops work that has not started; started work runs to the end."""

    def __init__(self, name: str = "model"):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    def shutdown(self, wait: bool = True) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=True)

    async def aclose(self) -> None:
        """Shut down without blocking the loop while the last forward pass finishes."""
        await asyncio.to_thread(self.shutdown, True)
