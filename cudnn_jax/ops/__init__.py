"""One module per op family: the public functions, their argument checks and their engines.

``cudnn_jax/__init__.py`` re-exports the public functions; these modules keep names that
no public function shadows (``cudnn_jax.ops.gemm`` is the module, ``cudnn_jax.gemm`` the
function).
"""
