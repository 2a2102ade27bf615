"""Session store: session state and replica discovery in Redis. The only package that imports redis.

- sessions.SessionStore: one hash and one append-only token list per session, written by versioned
  Lua scripts with a sliding TTL.
- replicas.ReplicaRegistry: draft and target replicas under leases; least-loaded choice; draining.
- redis_server.EmbeddedRedis: a real redis-server child process for the local launcher and tests.
- client.connect: the coordinator's client (command deadline, reconnect retries); StoreUnavailable
  once Redis stays away past them.
"""

from specdec.store.client import StoreUnavailable, connect
from specdec.store.records import SCHEMA, SessionRecord, SessionStats, SessionStatus
from specdec.store.redis_server import EmbeddedRedis, find_redis_server
from specdec.store.replicas import Replica, ReplicaRegistry
from specdec.store.sessions import SchemaMismatch, SessionStore, VersionConflict

__all__ = [
    "SCHEMA",
    "EmbeddedRedis",
    "Replica",
    "ReplicaRegistry",
    "SchemaMismatch",
    "SessionRecord",
    "SessionStats",
    "SessionStatus",
    "SessionStore",
    "StoreUnavailable",
    "VersionConflict",
    "connect",
    "find_redis_server",
]
