"""The entrypoint: the public token-level gRPC API (see main.py)."""
