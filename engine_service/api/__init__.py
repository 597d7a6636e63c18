"""What other packages (the prefix service, clients) may import from the engine: plain values and
functions, no grpc, no protos, no MLX."""
