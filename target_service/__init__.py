"""The target service: the target model behind gRPC (servicer, client, `python -m target_service`).

    from target_service.client import TargetClient, connect
"""
