"""decode: continuous batching of requests whose KV arrives from prefill; tokens over NATS."""
