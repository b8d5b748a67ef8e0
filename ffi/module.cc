// The nanobind module cudnn_jax._ffi: handler registrations, support checks, plan-cache
// counters and the cuDNN version. See README.md for the contract.

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "common/cudnn_runtime.h"
#include "common/plan_cache.h"
#include "grouped_matmul_cudnn.h"
#include "sdpa_cudnn.h"
#ifdef CUDNN_JAX_HAVE_AOT_KERNELS
#include "aot_kernels_ffi.h"
#include "aot_kernels.h"
#endif

namespace nb = nanobind;

namespace {

template <typename Fn>
nb::capsule handler_capsule(Fn* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, Fn, XLA_FFI_CallFrame*>,
                "an XLA FFI handler takes a call frame");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

nb::dict registrations() {
  nb::dict out;
  out["cudnn_jax_sdpa_fwd"] = handler_capsule(CudnnJaxSdpaFwd);
  out["cudnn_jax_sdpa_bwd"] = handler_capsule(CudnnJaxSdpaBwd);
  out["cudnn_jax_grouped_matmul"] = handler_capsule(CudnnJaxGroupedMatmul);
#ifdef CUDNN_JAX_HAVE_AOT_KERNELS
  out["cudnn_jax_aot_axpy"] = handler_capsule(CudnnJaxAotAxpy);
  out["cudnn_jax_cute_grouped_gemm"] = handler_capsule(CudnnJaxCuteGroupedGemm);
  out["cudnn_jax_cute_grouped_wgrad"] = handler_capsule(CudnnJaxCuteGroupedWgrad);
#endif
  return out;
}

// Names of the ahead-of-time compiled kernel variants linked in (kernels/aot.py).
nb::list aot_kernels() {
  nb::list out;
#ifdef CUDNN_JAX_HAVE_AOT_KERNELS
  std::string names = CUDNN_JAX_AOT_KERNELS;
  for (size_t start = 0; start < names.size();) {
    size_t end = names.find(',', start);
    if (end == std::string::npos) end = names.size();
    out.append(names.substr(start, end - start));
    start = end + 1;
  }
#endif
  return out;
}

// ---- config dict parsing -------------------------------------------------------------

// Config values may be Python or NumPy scalars (np.bool_, np.int32, np.float32).
nb::handle entry(const nb::dict& d, const char* name) {
  if (!d.contains(name)) {
    throw nb::value_error(("config lacks '" + std::string(name) + "'").c_str());
  }
  return d[name];
}

[[noreturn]] void wrong_type(const char* name, const char* want) {
  throw nb::type_error(
      ("config['" + std::string(name) + "'] must be " + want).c_str());
}

bool as_bool(const nb::dict& d, const char* name) {
  int value = PyObject_IsTrue(entry(d, name).ptr());
  if (value < 0) {
    PyErr_Clear();
    wrong_type(name, "a bool");
  }
  return value != 0;
}

int64_t as_int(const nb::dict& d, const char* name) {
  PyObject* index = PyNumber_Index(entry(d, name).ptr());
  long long value = index ? PyLong_AsLongLong(index) : -1;
  Py_XDECREF(index);
  if (PyErr_Occurred()) {
    PyErr_Clear();
    wrong_type(name, "an int");
  }
  return value;
}

float as_float(const nb::dict& d, const char* name) {
  double value = PyFloat_AsDouble(entry(d, name).ptr());
  if (value == -1.0 && PyErr_Occurred()) {
    PyErr_Clear();
    wrong_type(name, "a float");
  }
  return static_cast<float>(value);
}

std::string as_string(const nb::dict& d, const char* name) {
  nb::handle value = entry(d, name);
  if (!nb::isinstance<nb::str>(value)) wrong_type(name, "a str");
  return nb::cast<std::string>(value);
}

xla::ffi::DataType parse_dtype(const std::string& name) {
  if (name == "bfloat16") return xla::ffi::DataType::BF16;
  if (name == "float16") return xla::ffi::DataType::F16;
  if (name == "float32") return xla::ffi::DataType::F32;
  throw nb::value_error(("unknown dtype '" + name + "'").c_str());
}

cudnn_jax::SdpaConfig parse_sdpa_config(const nb::dict& d) {
  auto flag = [&](const char* name) { return d.contains(name) && as_bool(d, name); };
  cudnn_jax::SdpaConfig c;
  c.backward = as_bool(d, "backward");
  c.dtype = parse_dtype(as_string(d, "dtype"));
  c.b = as_int(d, "b");
  c.t = as_int(d, "t");
  c.s = as_int(d, "s");
  c.n = as_int(d, "n");
  c.k = as_int(d, "k");
  c.h = as_int(d, "h");
  c.hv = as_int(d, "hv");
  c.scale = as_float(d, "scale");
  c.causal = flag("causal");
  c.bottom_right = flag("bottom_right");
  c.window_left = d.contains("window_left") ? static_cast<int32_t>(as_int(d, "window_left")) : -1;
  c.window_right =
      d.contains("window_right") ? static_cast<int32_t>(as_int(d, "window_right")) : -1;
  c.softcap = d.contains("softcap") ? as_float(d, "softcap") : 0.f;
  c.has_bias = flag("has_bias");
  c.has_padding = flag("has_padding");
  c.has_dbias = flag("has_dbias");
  c.with_lse = !d.contains("with_lse") || as_bool(d, "with_lse");
  c.bias_b = c.has_bias ? as_int(d, "bias_b") : 0;
  c.bias_n = c.has_bias ? as_int(d, "bias_n") : 0;
  return c;
}

std::string sdpa_check(const nb::dict& config) {
  cudnn_jax::SdpaConfig c = parse_sdpa_config(config);
  nb::gil_scoped_release release;  // plan building can take a while
  return cudnn_jax::sdpa_check(c);
}

// Workspace bytes from `query` (a *_workspace function); raises ValueError when cuDNN
// cannot serve the configuration.
template <typename Config>
int64_t workspace_or_raise(int64_t (*query)(const Config&, std::string*), const Config& c) {
  std::string err;
  int64_t bytes;
  {
    nb::gil_scoped_release release;  // plan building can take a while
    bytes = query(c, &err);
  }
  if (bytes < 0) throw nb::value_error(err.c_str());
  return bytes;
}

int64_t sdpa_workspace(const nb::dict& config) {
  return workspace_or_raise(&cudnn_jax::sdpa_workspace, parse_sdpa_config(config));
}

cudnn_jax::GroupedMatmulConfig parse_grouped_matmul_config(const nb::dict& d) {
  cudnn_jax::GroupedMatmulConfig c;
  c.dtype = parse_dtype(as_string(d, "dtype"));
  c.m = as_int(d, "m");
  c.k = as_int(d, "k");
  c.n = as_int(d, "n");
  c.groups = as_int(d, "groups");
  return c;
}

std::string grouped_matmul_check(const nb::dict& d) {
  cudnn_jax::GroupedMatmulConfig c = parse_grouped_matmul_config(d);
  nb::gil_scoped_release release;
  return cudnn_jax::grouped_matmul_check(c);
}

int64_t grouped_matmul_workspace(const nb::dict& config) {
  return workspace_or_raise(&cudnn_jax::grouped_matmul_workspace,
                            parse_grouped_matmul_config(config));
}

nb::dict cache_info() {
  cudnn_jax::PlanCacheInfo info = cudnn_jax::PlanCache::global().info();
  nb::dict out;
  out["size"] = info.size;
  out["capacity"] = info.capacity;
  out["hits"] = info.hits;
  out["misses"] = info.misses;
  out["evictions"] = info.evictions;
  out["recorded"] = info.recorded;
  nb::dict plans;
  for (const auto& [key, name] : info.plans) plans[key.c_str()] = name;
  out["plans"] = plans;
  return out;
}

}  // namespace

NB_MODULE(_ffi, m) {
  m.doc() = "XLA FFI handlers of cudnn_jax (cuDNN engines).";
  m.def("registrations", &registrations,
        "Handler name -> capsule, to register for platform 'CUDA'.");
  m.def("sdpa_check", &sdpa_check, nb::arg("config"),
        "'' when cuDNN can serve this SDPA configuration on the current device, else why "
        "not. Builds and caches the plan.");
  m.def("grouped_matmul_check", &grouped_matmul_check, nb::arg("config"),
        "'' when cuDNN can serve this grouped matmul (dtype, m, k, n, groups) on the current "
        "device, else why not. Builds and caches the plan.");
  m.def("sdpa_workspace", &sdpa_workspace, nb::arg("config"),
        "Bytes of the SDPA handlers' workspace result for this configuration (the dict "
        "sdpa_check takes); ValueError when cuDNN cannot serve it.");
  m.def("grouped_matmul_workspace", &grouped_matmul_workspace, nb::arg("config"),
        "Bytes of the grouped matmul handler's workspace result; ValueError when cuDNN "
        "cannot serve the configuration.");
  m.def("aot_kernels", &aot_kernels,
        "Names of the ahead-of-time compiled CuTe DSL kernel variants linked in.");
  m.def("cache_info", &cache_info,
        "Counters of the process-wide cuDNN plan cache, and each entry's chosen plan.");
  m.def("cudnn_version", [] { return cudnn_jax::cudnn_runtime_version(); },
        "Version of the libcudnn loaded at run time (e.g. 91900); 0 when none loads.");
}
