"""OpenAI-compatible HTTP frontend: a Flask app over the background engine, served by uvicorn
(see http_server.py)."""
from jaxserve.server.app import create_app

__all__ = ["create_app"]
