"""kvstore: KV blocks by chain digest (gRPC ``deepserve.v1.KVStore``); files on disk, metadata in Redis."""
