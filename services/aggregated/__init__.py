"""The aggregated instance: one engine that is both a prefill and a decode target."""
