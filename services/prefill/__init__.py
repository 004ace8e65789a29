"""prefill: computes a prompt (loading cached prefix blocks), the first token, and hands the KV to decode."""
