"""The gateway: the prefix service's flows over one engine as domain code (lookup, insert, the gateway
Generate and its stream, pressure handling); no gRPC."""
