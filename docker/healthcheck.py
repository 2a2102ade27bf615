#!/opt/venv/bin/python
"""Docker HEALTHCHECK: exit 0 when the service's grpc.health.v1 reports SERVING on this container.

The port is the one the service itself reads from the environment: the plaintext health port
(SPECDEC_HEALTH_PORT) when the main port has TLS, else the main port (SPECDEC_PORT). Kubernetes does
not use this: its pods have native gRPC probes on the same port.
"""

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def health_port(env=os.environ) -> str:
    plaintext = env.get("SPECDEC_PLAINTEXT", "").strip().lower() in ("1", "true", "yes", "on")
    health = env.get("SPECDEC_HEALTH_PORT", "").strip().lower()
    if not plaintext and health not in ("", "none", "off", "disabled"):
        return health
    return env.get("SPECDEC_PORT", "50051")


def main() -> int:
    with grpc.insecure_channel(f"127.0.0.1:{health_port()}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3.0)
        except grpc.RpcError as exc:
            print(f"unhealthy: {exc.code().name}", file=sys.stderr)
            return 1
    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
    print(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
