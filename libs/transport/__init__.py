"""Transports shared by the services: in-process twins of NATS and the KV push (``inproc``),
so the whole pipeline runs inside one process with no servers."""
