"""JAX primitives over the FFI handlers: abstract eval, lowering, batching, partitioning."""
