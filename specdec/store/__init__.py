"""Session store: session state and replica discovery in Redis. The only package that imports redis.

- sessions.SessionStore: one hash and one append-only token list per session, written by versioned
  Lua scripts with a sliding TTL.
- replicas.ReplicaRegistry: draft and target replicas under leases; least-loaded choice; draining.
- redis_server.EmbeddedRedis: a real redis-server child process for the local launcher and tests.
"""

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
    "VersionConflict",
    "find_redis_server",
]
