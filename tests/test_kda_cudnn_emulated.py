"""The "cudnn" engine of kda and gdn on the CPU, against the float64 oracle.

Off the GPU its primitives (cudnn_jax/primitives/kda.py) lower to the handlers' contracts
in plain JAX, so everything the engine does around NVIDIA's kernels runs here: the
preprocessing the kernels lack, the state transposes, grouped value heads in the backward,
the scale folded into q, the sanitised sequences and the device-side choice of the
segmented forward, and the gradients through all of it. Engine choice is forced past the
support check (which declines without a Hopper GPU) by conftest's ``emulated``.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kda_cases as cases
from cudnn_jax.primitives import kda as cudnn_kda

_BASE = cases.Config(b=2, t=37, h=1, hv=1, k=128, v=128, dtype="bfloat16", engine="cudnn")
CONFIGS = {
    "plain": _BASE,
    "l2norm, beta sigmoid (segmented)": dataclasses.replace(_BASE, l2norm=True,
                                                           beta_sigmoid=True),
    "l2norm, raw beta (checked on the device)": dataclasses.replace(_BASE, l2norm=True),
    "softplus gate, dt_bias, initial state": dataclasses.replace(
        _BASE, gate="softplus", dt_bias=True, initial_state=True),
    "lower-bound gate without a_log": dataclasses.replace(_BASE, gate="lower_bound",
                                                          a_log=False, dt_bias=True),
    "allow_neg_eigval, scale 0.3": dataclasses.replace(_BASE, beta_sigmoid=True,
                                                       neg_eig=True, scale=0.3),
    "gva": dataclasses.replace(_BASE, h=1, hv=2, l2norm=True, initial_state=True),
    "gdn, lower-bound gate": dataclasses.replace(_BASE, op="gdn", gate="lower_bound",
                                                 dt_bias=True, l2norm=True),
    "one sequence (the backward's whole-sequence path)": dataclasses.replace(
        _BASE, b=1, t=70, l2norm=True, initial_state=True),
    "cu_seqlens: empty and one-token sequences": dataclasses.replace(
        _BASE, cu_seqlens=(0, 0, 1, 20, 20, 33), initial_state=True, l2norm=True),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_values_match_float64(emulated, name):
  cfg = CONFIGS[name]
  emulated(cfg.op, "cudnn")
  arrays, kwargs = cases.make_case(cfg, seed=1)
  o, final = cases.run(cfg, arrays, kwargs)
  want_o, want_final = cases.run_oracle(arrays, kwargs)
  cases.assert_close(o, want_o, cfg.dtype, "o")
  cases.assert_close(final, want_final, cfg.dtype, "final_state")


@pytest.mark.parametrize("name", ["plain", "softplus gate, dt_bias, initial state", "gva",
                                  "one sequence (the backward's whole-sequence path)",
                                  "allow_neg_eigval, scale 0.3", "gdn, lower-bound gate",
                                  "cu_seqlens: empty and one-token sequences"])
def test_gradients_match_float64(emulated, name):
  cfg = CONFIGS[name]
  emulated(cfg.op, "cudnn")
  arrays, kwargs = cases.make_case(cfg, seed=2)
  cases.check_gradients(cfg, arrays, kwargs, rtol=5e-2, atol=3e-2)


@pytest.mark.parametrize("cu", [(0, 16, 8, 24), (0, 10, 30, 30), (3, 12, 12, 24)])
def test_bad_cu_seqlens_give_specs_result(emulated, cu):
  """SPEC section 8: an unserved sequence keeps its initial state, tokens no served
  sequence owns output 0 and get no gradient; the kernels never see an entry outside
  [0, T] or one below an earlier entry."""
  cfg = dataclasses.replace(_BASE, cu_seqlens=None, b=1, t=24, initial_state=True)
  emulated("kda", "cudnn")
  arrays, kwargs = cases.make_case(dataclasses.replace(cfg, cu_seqlens=(0, 8, 16, 24)))
  arrays["cu_seqlens"] = np.asarray(cu, np.int32)
  o, final = cases.run(cfg, arrays, kwargs)
  want_o, want_final = cases.run_oracle(arrays, kwargs)
  cases.assert_close(o, want_o, cfg.dtype, "o")
  cases.assert_close(final, want_final, cfg.dtype, "final_state")
  grads = jax.jit(jax.grad(lambda q: jnp.sum(
      cases.call_op("kda", {**arrays, "q": q}, kwargs, "cudnn")[0].astype(jnp.float32))))(
          arrays["q"])
  owned = np.asarray(cudnn_kda.owned(*cudnn_kda.sequences(jnp.asarray(cu), 24), 24))
  np.testing.assert_array_equal(np.asarray(grads, np.float32)[0, ~owned], 0.0)


def test_sanitised_sequences_keep_every_served_range():
  cu = jnp.asarray([5, 2, 9, 9, 30, 12], jnp.int32)
  got, served = cudnn_kda.sequences(cu, 24)
  np.testing.assert_array_equal(got, [5, 5, 9, 9, 24, 24])
  np.testing.assert_array_equal(served, [0, 0, 0, 0, 0])  # [9,9) is served but empty
  np.testing.assert_array_equal(cudnn_kda.owned(got, served, 24), np.zeros(24, bool))
  got, served = cudnn_kda.sequences(jnp.asarray([0, 4, 4, 10], jnp.int32), 12)
  np.testing.assert_array_equal(served, [1, 0, 1])
  np.testing.assert_array_equal(cudnn_kda.owned(got, served, 12), np.arange(12) < 10)


@pytest.mark.parametrize("l2norm,beta_sigmoid,neg_eig,scale,beta,want", [
    (True, True, False, None, 3.0, True),  # a sigmoid: in (0, 1) whatever its logit
    (True, False, False, None, 0.5, True),  # as given, checked on the device
    (True, False, False, None, 1.5, False),
    (True, False, False, None, -0.1, False),
    (True, True, True, None, 0.5, False),  # allow_neg_eigval: beta in (0, 2)
    (False, True, False, None, 0.5, False),  # q, k not normalised
    (True, True, False, 0.5, 0.5, False),  # scale > 1/sqrt(128)
])
def test_segmented_forward_only_inside_the_truncation_bound(l2norm, beta_sigmoid, neg_eig,
                                                             scale, beta, want):
  opts = cudnn_kda.Options(
      scale=cudnn_kda.KERNEL_SCALE if scale is None else scale, qk_l2norm=l2norm,
      gate_in_kernel=False, lower_bound=None, beta_sigmoid=beta_sigmoid,
      allow_neg_eigval=neg_eig, varlen=False)
  beta = jnp.full((1, 8, 2), beta, jnp.float32).at[0, 3, 1].set(0.5)
  assert bool(jax.jit(lambda b: jnp.asarray(cudnn_kda.segmented_forward(opts, b)))(beta)) == want
