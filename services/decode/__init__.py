"""decode: continuous batching of requests whose KV arrives from prefill; streams tokens over NATS."""
