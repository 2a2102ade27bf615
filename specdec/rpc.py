"""The one import point for the generated `specdec.v1` protocol modules.

    from specdec.rpc import target_pb2, target_pb2_grpc

Importing this module (re)generates the code first when the .proto files changed (see
specdec.protogen), so a fresh checkout needs no separate build step. Only server and client modules
(and the boundary converters in specdec.rpc_convert) import it; the core never sees protobuf.
"""

from __future__ import annotations

from specdec.protogen import ensure_generated

ensure_generated()

# Generated modules, imported only after ensure_generated() has made sure they exist and are current.
from specdec.v1 import common_pb2  # noqa: E402
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc  # noqa: E402
from specdec.v1 import draft_pb2, draft_pb2_grpc  # noqa: E402
from specdec.v1 import target_pb2, target_pb2_grpc  # noqa: E402

# Channel options for every channel to a service that may restart: reconnects back off from 0.25 s
# to at most 2 s instead of gRPC's default 1 s growing to 120 s. With the default, a replica that
# was down for a minute or two (a pod restart loading its model) was found up to a minute after it
# served again: a registrar registered it that late, and every call in between failed at once.
RECONNECT_BACKOFF = (("grpc.initial_reconnect_backoff_ms", 250), ("grpc.max_reconnect_backoff_ms", 2_000))

# Trailing metadata of a FAILED_PRECONDITION position or epoch mismatch (decimal ASCII values): the
# session's actual position and, from the draft service, its newest live proposal's epoch.
ACTUAL_POSITION_KEY = "specdec-actual-position"
LATEST_EPOCH_KEY = "specdec-latest-epoch"
# Every live proposal's epoch, comma-separated, oldest first (pipelining: the newest is not the only one).
LIVE_EPOCHS_KEY = "specdec-live-epochs"
# The per-cycle calls' full names: their spans' names, also for each message of their streams
# (VerifyStream, ProposeStream: specdec/server/cycle_streams.py).
VERIFY_METHOD = "/specdec.v1.TargetService/Verify"
PROPOSE_METHOD = "/specdec.v1.DraftService/Propose"

__all__ = [
    "ACTUAL_POSITION_KEY",
    "LATEST_EPOCH_KEY",
    "LIVE_EPOCHS_KEY",
    "PROPOSE_METHOD",
    "VERIFY_METHOD",
    "common_pb2",
    "coordinator_pb2",
    "coordinator_pb2_grpc",
    "draft_pb2",
    "draft_pb2_grpc",
    "target_pb2",
    "target_pb2_grpc",
]
