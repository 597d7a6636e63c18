"""The gRPC process plumbing both services share: server build and drain, service main, auth (tokens,
TLS), status <-> error mapping with structured details, RPC metrics, and the engine's wire messages."""
