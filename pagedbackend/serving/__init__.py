"""Serving glue between Triton's Python backend and the engine: request parsing, the engine loop,
metrics and the launcher. Importable and testable without Triton."""
