"""The draft service: a proposer behind gRPC (servicer, client, `python -m draft_service`).

    from draft_service.client import DraftClient, connect
"""
