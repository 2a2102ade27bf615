"""Sampling math: parameters, logit warping, counter-based randomness, lossless verification.

Pure modules: no grpc, redis or asyncio imports (tests/test_layers.py enforces it).
"""
