"""Expert parallelism: routed experts sharded over the ranks of one engine instance."""
