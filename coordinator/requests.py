"""A Generate request as the coordinator sees it, and the checks that need no model or session.

The servicer builds a GenerateRequest from protobuf once; validate() rejects what is wrong in
itself with a message that says what is allowed. Checks that need the target's context length or
the session's record happen in sessions.py.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from specdec.errors import InvalidArgument
from specdec.sampling.params import SamplingParams

MAX_STOP_SEQUENCES = 16
MAX_STOP_SEQUENCE_CHARS = 256


class Pool(str, enum.Enum):
    """The serving pools (both serve the same target model)."""

    SPECULATIVE = "speculative"  # draft + target
    BASELINE = "baseline"  # plain decoding on the target


@dataclass(frozen=True)
class SpeculationOptions:
    enabled: bool | None = None  # None: the pool decides (a draft in the speculative pool)
    num_draft_tokens: int = 0  # 0: the server default
    pipelined: bool | None = None  # draft the next block during verification; None: the server default


@dataclass(frozen=True)
class Limits:
    """The server's bounds on a request (flags)."""

    default_max_new_tokens: int = 256
    max_new_tokens_limit: int = 4096
    max_draft_tokens: int = 16


@dataclass(frozen=True)
class GenerateRequest:
    """One Generate call. Exactly one of prompt, messages, resume_from is set."""

    prompt: str | None = None
    messages: tuple[dict, ...] | None = None  # {"role": ..., "content": ...}
    resume_from: int | None = None  # ResumeStream.from_position
    raw: bool = False
    sampling: SamplingParams = field(default_factory=SamplingParams)  # seed drawn when unset
    max_new_tokens: int | None = None
    stop_sequences: tuple[str, ...] = ()
    ignore_eos: bool = False
    session_id: str | None = None
    pool: Pool | None = None  # None: the coordinator decides
    speculation: SpeculationOptions = field(default_factory=SpeculationOptions)

    @property
    def operation(self) -> str:
        """GenAI operation name for the request span."""
        return "text_completion" if self.raw else "chat"


def validate(request: GenerateRequest, limits: Limits) -> int:
    """Raise InvalidArgument for a request that is wrong whatever the session; return the turn's
    max_new_tokens (the default when unset)."""
    _check_input(request)
    if request.session_id is not None and not request.session_id:
        raise InvalidArgument("session_id must not be empty when set; leave it unset to start a session")
    max_new_tokens = request.max_new_tokens
    if max_new_tokens is None:
        max_new_tokens = limits.default_max_new_tokens
    if not 1 <= max_new_tokens <= limits.max_new_tokens_limit:
        raise InvalidArgument(
            f"max_new_tokens must be in [1, {limits.max_new_tokens_limit}], got {max_new_tokens}"
        )
    request.sampling.validate()
    _check_stop_sequences(request.stop_sequences)
    k = request.speculation.num_draft_tokens
    if not 0 <= k <= limits.max_draft_tokens:
        raise InvalidArgument(
            f"speculation.num_draft_tokens must be in [0, {limits.max_draft_tokens}] (0 = the server's "
            f"default), got {k}"
        )
    return max_new_tokens


def _check_input(request: GenerateRequest) -> None:
    given = [x is not None for x in (request.prompt, request.messages, request.resume_from)]
    if sum(given) != 1:
        raise InvalidArgument("set exactly one of prompt, messages or resume")
    if request.prompt is not None and not request.prompt:
        raise InvalidArgument("prompt must not be empty")
    if request.messages is not None:
        if request.raw:
            raise InvalidArgument("raw applies to a prompt only; messages always use the chat template")
        if not request.messages:
            raise InvalidArgument("messages must hold at least one message")
        for message in request.messages:
            if not message.get("role"):
                raise InvalidArgument("every chat message needs a role (system, user, assistant, ...)")
    if request.resume_from is not None and request.session_id is None:
        raise InvalidArgument("resume needs the session_id of the stream to resume")


def _check_stop_sequences(stop_sequences: tuple[str, ...]) -> None:
    if len(stop_sequences) > MAX_STOP_SEQUENCES:
        raise InvalidArgument(
            f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {len(stop_sequences)}"
        )
    for stop in stop_sequences:
        if not stop or len(stop) > MAX_STOP_SEQUENCE_CHARS:
            raise InvalidArgument(
                f"each stop sequence must have 1 to {MAX_STOP_SEQUENCE_CHARS} characters, got {len(stop)}"
            )
