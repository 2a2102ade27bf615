"""Server toolkit for the gRPC services: settings, credentials, interceptors and bootstrap; the
process scaffolding of a service's main (service), what the model services' servicers share
(model_servicer, tokenizer_info) and what their clients share (client_base)."""
