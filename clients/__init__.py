"""forkline clients: Python wrappers over the gRPC stubs and the mlx_run_llm_batched CLI."""
