"""Python client for the coordinator's public API, for backends: asyncio and blocking flavours.

    async with AsyncClient("localhost:50051", plaintext=True) as client:
        async for chunk in client.stream("Why is the sky blue?", max_new_tokens=64):
            print(chunk.text, end="")

    with Client("localhost:50051", plaintext=True) as client:
        print(client.generate("Why is the sky blue?").text)

A stream cut by UNAVAILABLE after its first chunk (a coordinator restarting, Redis away past the
coordinator's --redis-retry) is resumed by the client itself, from the last chunk's position, up to
`resume_attempts` times in a row with backoff (`resume_backoff_s` doubling): the caller sees one
uninterrupted stream. `resume(session_id, from_position)` does the same by hand; the next turn of a
conversation is `stream(prompt, session_id=...)`. A call that fails before its first chunk is not
retried: whether it reached the coordinator is unknown, and a turn must not be sent twice.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Iterator, Sequence

import grpc
import grpc.aio
from google.protobuf import json_format

from specdec.rpc import RECONNECT_BACKOFF, common_pb2, coordinator_pb2, coordinator_pb2_grpc

_POOLS = {None: 0, "baseline": 1, "speculative": 2}
_MODES = {"rejection": common_pb2.SAMPLING_MODE_REJECTION, "gumbel": common_pb2.SAMPLING_MODE_GUMBEL}


@dataclass
class Chunk:
    session_id: str
    token_ids: list[int]
    text: str
    position: int  # absolute position after these tokens: what to resume from
    finish_reason: str | None = None  # "eos" | "length" | "stop_sequence" | "cancelled" on the last
    usage: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)


@dataclass
class Completion:
    session_id: str
    text: str
    token_ids: list[int]
    position: int
    finish_reason: str | None
    usage: dict
    stats: dict


def build_request(
    prompt: str | None = None,
    *,
    messages: Sequence[dict] | None = None,
    session_id: str | None = None,
    resume_from: int | None = None,
    raw: bool = False,
    temperature: float = 0.0,
    top_p: float | None = None,
    top_k: int = 0,
    seed: int | None = None,
    sampling_mode: str = "rejection",
    max_new_tokens: int | None = None,
    stop: Sequence[str] = (),
    ignore_eos: bool = False,
    pool: str | None = None,
    speculate: bool | None = None,
    num_draft_tokens: int = 0,
    pipelined: bool | None = None,
) -> coordinator_pb2.CoordinatorServiceGenerateRequest:
    request = coordinator_pb2.CoordinatorServiceGenerateRequest(
        raw=raw, stop_sequences=list(stop), ignore_eos=ignore_eos, pool=_POOLS[pool],
        sampling=common_pb2.SamplingParams(temperature=temperature, top_k=top_k, mode=_MODES[sampling_mode]),
    )
    if resume_from is not None:
        request.resume.from_position = resume_from
    elif messages is not None:
        request.messages.messages.extend(coordinator_pb2.ChatMessage(**m) for m in messages)
    else:
        request.prompt = prompt or ""
    if top_p is not None:
        request.sampling.top_p = top_p
    if seed is not None:
        request.sampling.seed = seed
    if session_id is not None:
        request.session_id = session_id
    if max_new_tokens is not None:
        request.max_new_tokens = max_new_tokens
    if speculate is not None:
        request.speculation.enabled = speculate
    request.speculation.num_draft_tokens = num_draft_tokens
    if pipelined is not None:
        request.speculation.pipelined = pipelined
    return request


def to_chunk(response: coordinator_pb2.CoordinatorServiceGenerateResponse) -> Chunk:
    reason = None
    if response.finish_reason:
        reason = coordinator_pb2.FinishReason.Name(response.finish_reason).removeprefix("FINISH_REASON_").lower()
    return Chunk(
        response.session_id, list(response.token_ids), response.text, response.position, reason,
        message_dict(response.usage) if response.HasField("usage") else {},
        message_dict(response.stats) if response.HasField("stats") else {},
    )


def message_dict(message) -> dict:
    """Set fields as plain Python values (proto3 JSON would turn 64-bit counters into strings)."""
    out = {}
    for field_desc, value in message.ListFields():
        if field_desc.enum_type is not None:
            value = field_desc.enum_type.values_by_number[value].name
        elif field_desc.is_repeated:
            value = list(value)
        elif field_desc.message_type is not None:
            value = message_dict(value)
        out[field_desc.name] = value
    return out


def collect(chunks: Sequence[Chunk]) -> Completion:
    last = chunks[-1]
    return Completion(last.session_id, "".join(c.text for c in chunks),
                      [t for c in chunks for t in c.token_ids], last.position,
                      last.finish_reason, last.usage, last.stats)


def _credentials(tls_ca, tls_cert, tls_key, token) -> grpc.ChannelCredentials:
    read = lambda p: Path(p).read_bytes() if p else None  # noqa: E731
    creds = grpc.ssl_channel_credentials(read(tls_ca), read(tls_key), read(tls_cert))
    if token:
        creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
    return creds


class _Options:
    def __init__(self, address: str, *, plaintext: bool = False, tls_ca: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None, token: str | None = None,
                 timeout_s: float = 600.0, resume_attempts: int = 4, resume_backoff_s: float = 0.5):
        if plaintext and token:
            raise ValueError("a token over plaintext would travel in the clear; use TLS (tls_ca=...)")
        if resume_attempts < 0 or resume_backoff_s < 0:
            raise ValueError("resume_attempts and resume_backoff_s must be >= 0")
        self.address = address
        self.timeout_s = timeout_s
        self.resume_attempts = resume_attempts
        self.resume_backoff_s = resume_backoff_s
        self.credentials = None if plaintext else _credentials(tls_ca, tls_cert, tls_key, token)

    def _resume_wait(self, error: grpc.RpcError, last: Chunk | None, failures: int) -> float | None:
        """Seconds to wait before resuming after `failures` failures in a row; None: give up."""
        resumable = last is not None and last.finish_reason is None and error.code() == grpc.StatusCode.UNAVAILABLE
        if not resumable or failures > self.resume_attempts:
            return None
        return self.resume_backoff_s * 2 ** (failures - 1)


class AsyncClient(_Options):
    def __init__(self, address: str, **options):
        super().__init__(address, **options)
        make = grpc.aio.insecure_channel if self.credentials is None else grpc.aio.secure_channel
        args = (address,) if self.credentials is None else (address, self.credentials)
        self.channel = make(*args, options=RECONNECT_BACKOFF)  # resumes reach a restarted coordinator
        self.stub = coordinator_pb2_grpc.CoordinatorServiceStub(self.channel)

    async def stream(self, prompt: str | None = None, **kwargs) -> AsyncIterator[Chunk]:
        request, last, failures = build_request(prompt, **kwargs), None, 0
        while True:
            try:
                async for response in self.stub.Generate(request, timeout=self.timeout_s):
                    last, failures = to_chunk(response), 0
                    yield last
                return
            except grpc.aio.AioRpcError as error:
                failures += 1
                wait_s = self._resume_wait(error, last, failures)
                if wait_s is None:
                    raise
            await asyncio.sleep(wait_s)
            request = build_request(session_id=last.session_id, resume_from=last.position)

    async def generate(self, prompt: str | None = None, **kwargs) -> Completion:
        return collect([chunk async for chunk in self.stream(prompt, **kwargs)])

    def resume(self, session_id: str, from_position: int, **kwargs) -> AsyncIterator[Chunk]:
        return self.stream(session_id=session_id, resume_from=from_position, **kwargs)

    async def cancel(self, session_id: str) -> bool:
        request = coordinator_pb2.CoordinatorServiceCancelRequest(session_id=session_id)
        return (await self.stub.Cancel(request, timeout=30)).was_generating

    async def get_session(self, session_id: str) -> dict:
        request = coordinator_pb2.CoordinatorServiceGetSessionRequest(session_id=session_id)
        response = await self.stub.GetSession(request, timeout=30)
        return json_format.MessageToDict(response.session, preserving_proto_field_name=True)

    async def end_session(self, session_id: str) -> bool:
        request = coordinator_pb2.CoordinatorServiceEndSessionRequest(session_id=session_id)
        return (await self.stub.EndSession(request, timeout=30)).existed

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class Client(_Options):
    """The blocking flavour, for code without an event loop."""

    def __init__(self, address: str, **options):
        super().__init__(address, **options)
        self.channel = (grpc.insecure_channel(address, options=RECONNECT_BACKOFF) if self.credentials is None
                        else grpc.secure_channel(address, self.credentials, options=RECONNECT_BACKOFF))
        self.stub = coordinator_pb2_grpc.CoordinatorServiceStub(self.channel)

    def stream(self, prompt: str | None = None, **kwargs) -> Iterator[Chunk]:
        request, last, failures = build_request(prompt, **kwargs), None, 0
        while True:
            try:
                for response in self.stub.Generate(request, timeout=self.timeout_s):
                    last, failures = to_chunk(response), 0
                    yield last
                return
            except grpc.RpcError as error:
                failures += 1
                wait_s = self._resume_wait(error, last, failures)
                if wait_s is None:
                    raise
            time.sleep(wait_s)
            request = build_request(session_id=last.session_id, resume_from=last.position)

    def generate(self, prompt: str | None = None, **kwargs) -> Completion:
        return collect(list(self.stream(prompt, **kwargs)))

    def resume(self, session_id: str, from_position: int, **kwargs) -> Iterator[Chunk]:
        return self.stream(session_id=session_id, resume_from=from_position, **kwargs)

    def cancel(self, session_id: str) -> bool:
        request = coordinator_pb2.CoordinatorServiceCancelRequest(session_id=session_id)
        return self.stub.Cancel(request, timeout=30).was_generating

    def get_session(self, session_id: str) -> dict:
        request = coordinator_pb2.CoordinatorServiceGetSessionRequest(session_id=session_id)
        return json_format.MessageToDict(self.stub.GetSession(request, timeout=30).session,
                                         preserving_proto_field_name=True)

    def end_session(self, session_id: str) -> bool:
        request = coordinator_pb2.CoordinatorServiceEndSessionRequest(session_id=session_id)
        return self.stub.EndSession(request, timeout=30).existed

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
