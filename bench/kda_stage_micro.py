import sys, time, functools, statistics
import jax, jax.numpy as jnp
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from harness import time_calls
from cudnn_jax.pallas import kda_intra, kda_scan
from cudnn_jax.reference import kda as ref
nc, b, h, c, kd, vd = 64, 8, 16, 64, 128, 128
ks = jax.random.split(jax.random.key(0), 6)
q = ref.l2norm(jax.random.normal(ks[0], (nc, b, h, c, kd)))
k = ref.l2norm(jax.random.normal(ks[1], (nc, b, h, c, kd)))
v = jax.random.normal(ks[2], (nc, b, h, c, vd))
G = ref._chunk_cumsum(-jax.nn.softplus(jax.random.normal(ks[3], (nc, b, h, c, kd))))
beta = jax.nn.sigmoid(jax.random.normal(ks[4], (nc, b, h, c, 1)))
dt = jnp.bfloat16
want = jax.jit(lambda *a: ref._intra(*a, dt))(q, k, v, G, beta)
def run(name, fn):
  try:
    t = time.time(); out = jax.block_until_ready(fn(q, k, v, G, beta)); comp = time.time() - t
    err = max(float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(y))) for x, y in zip(out, want))
    ms = 1e3 * time_calls(fn, (q, k, v, G, beta))
    print(f"{name:28s} {ms:8.3f} ms  first call {comp:5.1f} s  max rel err {err:.1e}", flush=True)
  except Exception as e:
    print(name, "FAILED", type(e).__name__, str(e)[:300], flush=True)
run("xla _intra", jax.jit(lambda *a: ref._intra(*a, dt)))
run("kernel", jax.jit(functools.partial(kda_intra.intra, dt=dt)))
