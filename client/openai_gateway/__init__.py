"""OpenAI-compatible HTTP gateway in front of the Triton `ensemble` (docs/OPENAI.md)."""
from client.openai_gateway.app import create_app

__all__ = ["create_app"]
