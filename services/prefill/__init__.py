"""prefill: computes a prompt (cached prefix blocks loaded), its first token; KV to decode."""
