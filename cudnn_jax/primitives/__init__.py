"""JAX primitives: ``core`` (one helper for every local computation: abstract eval,
lowering, batching, custom partitioning, CPU emulation) and the FFI-backed primitives of
each op built on it."""
