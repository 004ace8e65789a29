"""Entrypoint policy with no I/O: request validation, the ordered token stream, retry
decisions after an instance fails, and admission by instance capacity (backpressure)."""
