"""The serving system: KV pages, scheduler, sampler, engine and the gRPC service."""
