"""Pure-JAX engines: the readable definition of every op, the CPU path and the fallback."""
