"""Model backends (native Llama family, generic transformers fallback) and the default-model registry."""
