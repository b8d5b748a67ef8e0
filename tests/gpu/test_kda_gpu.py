"""cudnn_jax.kda / cudnn_jax.gdn (the "xla" and "triton" engines) on the GPU at model-like
sizes, against the float64 token-by-token recurrence: long sequences, partial chunks,
K = V = 128, bf16."""

import dataclasses
import functools

import jax.numpy as jnp
import pytest

from gpu_sweep import rel_err
from kda_cases import (Config, check_gradients, check_intra_kernel, make_case, run,
                       run_oracle)

pytestmark = pytest.mark.gpu

REL_TOL = {"float32": 1e-4, "bfloat16": 2e-2}  # ||a - b|| / ||b||


CASES = [
    ("bf16_long", Config(b=2, t=1000, h=4, hv=4, k=128, v=128, dtype="bfloat16",
                         l2norm=True, initial_state=True)),
    ("f32_gate_lower_bound", Config(b=2, t=777, h=2, hv=4, k=64, v=128, gate="lower_bound",
                                    dt_bias=True, l2norm=True, beta_sigmoid=True)),
    ("f32_varlen", Config(cu_seqlens=(0, 1, 300, 300, 365, 1100), h=2, hv=2, k=128, v=64,
                          initial_state=True, gate="softplus", dt_bias=True)),
    ("gdn_bf16", Config(op="gdn", b=2, t=900, h=2, hv=4, k=128, v=128, dtype="bfloat16",
                        l2norm=True, gate="softplus", dt_bias=True, initial_state=True)),
    ("gdn_f32_varlen", Config(op="gdn", cu_seqlens=(0, 200, 200, 731), h=2, hv=4, k=64,
                              v=128, gate="lower_bound", dt_bias=True, l2norm=True,
                              beta_sigmoid=True, initial_state=True)),
]


# The "triton" engine: the same cases.
CASES += [(f"triton_{name}", dataclasses.replace(cfg, engine="triton"))
          for name, cfg in list(CASES)]


@pytest.mark.parametrize("cfg", [c for _, c in CASES], ids=[n for n, _ in CASES])
def test_forward_matches_recurrence(cfg):
  arrays, kwargs = make_case(cfg, seed=3)
  o, final = run(cfg, arrays, kwargs)
  ref_o, ref_final = run_oracle(arrays, kwargs)
  assert rel_err(o, ref_o) <= REL_TOL[cfg.dtype]
  assert rel_err(final, ref_final) <= REL_TOL[cfg.dtype]


@pytest.mark.time_limit(450)  # float64 central differences of long sequences
@pytest.mark.parametrize("cfg", [c for n, c in CASES if c.dtype == "float32"],
                         ids=[n for n, c in CASES if c.dtype == "float32"])
def test_gradients_match_finite_differences(cfg):
  check_gradients(cfg, *make_case(cfg, seed=4), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("span_limit", [None, 60.0])
@pytest.mark.parametrize("steep", [False, True])
@pytest.mark.parametrize("dt", [jnp.float32, jnp.bfloat16])
def test_intra_kernel_matches_reference(dt, steep, span_limit):
  """cudnn_jax/triton/kda_intra.py compiled by Triton, at C = 64, K = V = 128, against the
  reference's intra-chunk stage: pairs inside sub-blocks summed directly, or as products
  where the gates allow."""
  from cudnn_jax.triton import kda_intra  # pylint: disable=g-import-not-at-top
  check_intra_kernel(functools.partial(kda_intra.intra, span_limit=span_limit), 64, 128, 128,
                     dt, steep, lead=(3, 2, 4))
