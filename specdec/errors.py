"""Domain errors of the core. Servers map them once, in an interceptor, to gRPC status codes.

Every message says what was wrong and what is allowed, because it reaches the caller verbatim.
"""


class SpecDecError(Exception):
    """Base of every error the core raises on purpose."""


class InvalidArgument(SpecDecError):
    """A request field is out of range (maps to INVALID_ARGUMENT)."""


class SessionNotFound(SpecDecError):
    """No session with this id is cached here (maps to NOT_FOUND)."""

    def __init__(self, session_id: str):
        super().__init__(f"session {session_id!r} is unknown or has ended")
        self.session_id = session_id


class SessionExists(SpecDecError):
    """A session with this id is already cached here (maps to ALREADY_EXISTS)."""

    def __init__(self, session_id: str):
        super().__init__(f"session {session_id!r} already exists; end it first or use another id")
        self.session_id = session_id


class PositionMismatch(SpecDecError):
    """A mutating call named a position the session is not at (maps to FAILED_PRECONDITION).

    Carrying the actual position lets a caller that lost a message resynchronise instead of guessing.
    """

    def __init__(self, session_id: str, expected: int, actual: int, detail: str = ""):
        super().__init__(
            f"session {session_id!r} is at position {actual}, the request expected {expected}"
            + (f" ({detail})" if detail else "")
        )
        self.session_id = session_id
        self.expected = expected
        self.actual = actual


class CacheFull(SpecDecError):
    """No KV cache slot or room is left and nothing can be evicted (maps to RESOURCE_EXHAUSTED)."""


class IncompatibleModels(SpecDecError):
    """Draft and target disagree on tokenizer or vocabulary (maps to FAILED_PRECONDITION)."""


class ContextOverflow(InvalidArgument):
    """A sequence would exceed the model's context length (maps to INVALID_ARGUMENT)."""


class EpochMismatch(SpecDecError):
    """A Propose named a parent epoch that is not a live proposal of the session (maps to
    FAILED_PRECONDITION): a stale or reordered accept/rollback message, or one building on a
    speculative proposal that a later message discarded."""

    def __init__(self, session_id: str, expected: int, actual: int, live: list[int] | None = None):
        live_text = f" (live: {live})" if live is not None and live != [actual] else ""
        super().__init__(
            f"session {session_id!r}: the latest proposal is epoch {actual}{live_text}, the request "
            f"builds on epoch {expected}, which is not live"
        )
        self.session_id = session_id
        self.expected = expected
        self.actual = actual

    def trailing_metadata(self) -> list[tuple[str, str]]:
        # The latest epoch lets a pipelining coordinator resynchronise without another call.
        return [("specdec-latest-epoch", str(self.actual))]


class ServiceUnavailable(SpecDecError):
    """A draft or target service did not answer: unreachable, shutting down or past the call's
    deadline (gRPC UNAVAILABLE / DEADLINE_EXCEEDED, raised by the clients). The session may be
    intact there; the caller retries, fails over to another replica or decodes without the draft."""
