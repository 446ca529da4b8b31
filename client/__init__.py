"""Clients for a running pagedbackend Triton server: `client.triton_client` (gRPC streaming,
importable), `python -m client.stream` (CLI), and the OpenAI gateway."""
