"""kvstore: KV blocks by chain digest (gRPC ``deepserve.v1.KVStore``); metadata in Redis."""
