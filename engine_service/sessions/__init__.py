"""The engine's domain facade over the Runner for one owner: handles and quotas, generate / clone /
close / export / import, the capture rule; no grpc, no protos."""
