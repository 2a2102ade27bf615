"""A TargetService on a real gRPC server inside the test's process, over a tiny engine: for tests
that must reach inside the servicer (its trimmer, a subclass with a fault) while calling it over the
wire. Services as subprocesses are in service_procs.py."""

from __future__ import annotations

import contextlib

from specdec.engine.target import TargetEngine
from specdec.models.loader import load_model
from specdec.observability.metrics import TargetMetrics, new_registry
from specdec.rpc import target_pb2_grpc
from specdec.server.bootstrap import ModelExecutor, ServiceHost
from specdec.server.settings import ClientSettings, ServerSettings
from target_service.client import connect


@contextlib.asynccontextmanager
async def hosted(target_dir, servicer_class, num_slots: int = 2, max_context: int = 256, **options):
    """servicer_class(engine, executor, metrics, **options) served on a free port; yields (client,
    servicer), and sets servicer.test_address to where it is served (for a coordinator under test)."""
    engine = TargetEngine(load_model(target_dir, backend="native", num_slots=num_slots, max_context=max_context))
    executor = ModelExecutor("in-process-target")
    servicer = servicer_class(engine, executor, TargetMetrics(new_registry(process=False)), **options)

    def register(server):
        target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
        return ["specdec.v1.TargetService"]

    host = ServiceHost(ServerSettings(port=0, plaintext=True, grace_period_s=0.0), register)
    await host.start()
    servicer.test_address = f"127.0.0.1:{host.port}"
    try:
        async with connect(f"127.0.0.1:{host.port}", ClientSettings(plaintext=True, timeout_s=30.0)) as target:
            yield target, servicer
    finally:
        await host.shutdown()
        executor.shutdown()
