"""Device meshes and partition rules that place params, the KV cache and batches on devices."""
