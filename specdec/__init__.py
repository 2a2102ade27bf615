"""specdec: distributed speculative decoding.

Layers (enforced by tests/test_layers.py): the pure core (sampling math, proposers, KV cache, models)
<- engines (session-keyed state) <- servers (gRPC translation) / session store (the only Redis importer).
"""

__version__ = "0.1.0"
