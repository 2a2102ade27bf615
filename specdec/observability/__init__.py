"""Tracing (OpenTelemetry) and metrics (Prometheus) shared by the services and the engines."""
