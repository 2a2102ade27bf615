"""Server toolkit for the gRPC services: settings, credentials, interceptors and bootstrap."""
