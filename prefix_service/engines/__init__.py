"""The prefix service's engine clients over gRPC: the backend that serves the cache, the gateway and
the tier (``engine_backend.py``), the engines' health watch and the pool that keeps the fleet in step
with the engines there are."""
