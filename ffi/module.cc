// The nanobind module cudnn_jax._ffi: handler registrations and attributes, support
// checks, plan-cache counters, the kernels' constants and the cuDNN version. See README.md
// for the contract.

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstddef>
#include <iterator>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "common/cudnn_runtime.h"
#include "common/plan_cache.h"
#include "conv3d_cudnn.h"
#include "grouped_matmul_cudnn.h"
#include "kernel_constants.h"
#include "sdpa_cudnn.h"
#include "sdpa_fp8_cudnn.h"
#ifdef CUDNN_JAX_HAVE_AOT_KERNELS
#include "aot_kernels_ffi.h"
#include "aot_kernels.h"
#endif
#ifdef CUDNN_JAX_HAVE_KDA_SM90
#include "kda_cudnn.h"
#endif

namespace nb = nanobind;

namespace {

// One FFI target of the extension: its name, its handler and the names of the attributes
// the handler takes.
struct Target {
  const char* name;
  XLA_FFI_Handler* handler;
  std::vector<const char*> attributes;
};

std::vector<const char*> conv3d_attributes() {
  return {std::begin(cudnn_jax::kConv3dAttributeNames), std::end(cudnn_jax::kConv3dAttributeNames)};
}

std::vector<const char*> sdpa_fp8_attributes() {
  return {std::begin(cudnn_jax::kSdpaFp8AttributeNames),
          std::end(cudnn_jax::kSdpaFp8AttributeNames)};
}

const std::vector<Target>& targets() {
  static const std::vector<Target> all = {
      {"cudnn_jax_sdpa_fwd", CudnnJaxSdpaFwd,
       {std::begin(cudnn_jax::kSdpaAttributeNames), std::end(cudnn_jax::kSdpaAttributeNames)}},
      {"cudnn_jax_sdpa_bwd", CudnnJaxSdpaBwd,
       {std::begin(cudnn_jax::kSdpaAttributeNames), std::end(cudnn_jax::kSdpaAttributeNames)}},
      {"cudnn_jax_sdpa_fp8_fwd", CudnnJaxSdpaFp8Fwd, sdpa_fp8_attributes()},
      {"cudnn_jax_sdpa_fp8_bwd", CudnnJaxSdpaFp8Bwd, sdpa_fp8_attributes()},
      {"cudnn_jax_grouped_matmul", CudnnJaxGroupedMatmul, {}},
      {"cudnn_jax_conv3d_fwd", CudnnJaxConv3dFwd, conv3d_attributes()},
      {"cudnn_jax_conv3d_dgrad", CudnnJaxConv3dDgrad, conv3d_attributes()},
      {"cudnn_jax_conv3d_wgrad", CudnnJaxConv3dWgrad, conv3d_attributes()},
#ifdef CUDNN_JAX_HAVE_AOT_KERNELS
      {"cudnn_jax_cute_grouped_gemm", CudnnJaxCuteGroupedGemm,
       {cudnn_jax::kCuteGroupedGemmEpilogue}},
      {"cudnn_jax_cute_grouped_wgrad", CudnnJaxCuteGroupedWgrad, {}},
#endif
#ifdef CUDNN_JAX_AOT_BSA_SM90  // kernels/aot.py built kernels/bsa_sm90.py
      {"cudnn_jax_bsa_fwd", CudnnJaxBsaFwd,
       {std::begin(cudnn_jax::kBsaAttributeNames), std::end(cudnn_jax::kBsaAttributeNames)}},
      {"cudnn_jax_bsa_bwd", CudnnJaxBsaBwd,
       {std::begin(cudnn_jax::kBsaAttributeNames), std::end(cudnn_jax::kBsaAttributeNames)}},
#endif
#ifdef CUDNN_JAX_HAVE_KDA_SM90
      {"cudnn_jax_kda_fwd", CudnnJaxKdaFwd,
       {std::begin(cudnn_jax::kKdaFwdAttributeNames), std::end(cudnn_jax::kKdaFwdAttributeNames)}},
      {"cudnn_jax_kda_bwd", CudnnJaxKdaBwd,
       {std::begin(cudnn_jax::kKdaBwdAttributeNames), std::end(cudnn_jax::kKdaBwdAttributeNames)}},
#endif
  };
  return all;
}

nb::tuple str_tuple(const char* const* names, size_t count) {
  nb::tuple out = nb::steal<nb::tuple>(PyTuple_New(static_cast<Py_ssize_t>(count)));
  for (size_t i = 0; i < count; ++i) {
    PyTuple_SetItem(out.ptr(), static_cast<Py_ssize_t>(i), nb::str(names[i]).release().ptr());
  }
  return out;
}

nb::dict registrations() {
  nb::dict out;
  for (const Target& t : targets()) out[t.name] = nb::capsule(reinterpret_cast<void*>(t.handler));
  return out;
}

nb::dict handler_attributes() {
  nb::dict out;
  for (const Target& t : targets()) {
    out[t.name] = str_tuple(t.attributes.data(), t.attributes.size());
  }
  return out;
}

// The constants of kernel_constants.h (kernels/aot.py), by kernel and name.
nb::object constant(int64_t value) { return nb::int_(value); }

template <size_t N>
nb::object constant(const char* const (&names)[N]) {
  return str_tuple(names, N);
}

nb::dict kernel_constants() {
  nb::dict out;
  auto section = [&](const char* kernel) {
    if (!out.contains(kernel)) out[kernel] = nb::dict();
    return nb::borrow<nb::dict>(out[kernel]);
  };
#define CUDNN_JAX_CONSTANT(kernel, name) \
  section(#kernel)[#name] = constant(cudnn_jax::kernel_constants::kernel::name);
  CUDNN_JAX_KERNEL_CONSTANTS(CUDNN_JAX_CONSTANT)
#undef CUDNN_JAX_CONSTANT
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

// NVIDIA's kernels compiled in from the nvidia-cudnn-frontend wheel's sources: kernel name
// -> "<source path in the wheel> (nvidia-cudnn-frontend <version>)"; empty without them.
nb::dict frontend_kernels() {
  nb::dict out;
#ifdef CUDNN_JAX_HAVE_KDA_SM90
  const std::string from = " (nvidia-cudnn-frontend " CUDNN_JAX_KDA_FRONTEND_VERSION ")";
  out["kda_fused"] = CUDNN_JAX_KDA_FWD_PATH + from;
  for (const char* name : {"k_meta", "k_prep", "k_scan_t", "k_bwd"}) {
    out[name] = CUDNN_JAX_KDA_BWD_PATH + from;
  }
#endif
  return out;
}

#ifdef CUDNN_JAX_HAVE_KDA_SM90
int64_t kda_bwd_workspace(int64_t t, int64_t h, int64_t n) {
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  if (t < 0 || h < 0 || n < 0 || t > kMax || h > kMax || n > kMax) {
    throw nb::value_error("kda_bwd_workspace: t, h and n must lie in [0, 2^31-1]");
  }
  return static_cast<int64_t>(cudnn_jax_kda_bwd_workspace(
      static_cast<int>(t), static_cast<int>(h), static_cast<int>(n)));
}
#endif

#ifdef CUDNN_JAX_AOT_BSA_SM90
int64_t bsa_bwd_workspace(int64_t b, int64_t n, int64_t sq, int64_t skv, int64_t c,
                          int64_t block_size) {
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  for (int64_t x : {b, n, sq, skv, c}) {
    if (x < 1 || x > kMax) {
      throw nb::value_error("bsa_bwd_workspace: b, n, sq, skv and c must lie in [1, 2^31-1]");
    }
  }
  if (block_size != 64 && block_size != 128) {
    throw nb::value_error("bsa_bwd_workspace: block_size must be 64 or 128");
  }
  return cudnn_jax_bsa_bwd_workspace_bytes(b, n, sq, skv, c, block_size);
}
#endif

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
  PyObject* value = entry(d, name).ptr();
  if (!PyBool_Check(value)) {
    // numpy's bool scalars too; the stable ABI has no PyTypeObject fields, so the type's
    // module and name are read as attributes.
    nb::handle type = nb::handle(value).type();
    if (nb::cast<std::string>(type.attr("__module__")) != "numpy" ||
        nb::cast<std::string>(type.attr("__name__")).rfind("bool", 0) != 0) {
      wrong_type(name, "a bool");
    }
  }
  return PyObject_IsTrue(value) == 1;
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

int32_t as_int32(const nb::dict& d, const char* name) {
  int64_t value = as_int(d, name);
  if (value < std::numeric_limits<int32_t>::min() || value > std::numeric_limits<int32_t>::max()) {
    throw nb::value_error(("config['" + std::string(name) + "'] is out of int32 range").c_str());
  }
  return static_cast<int32_t>(value);
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

// Reads the config dict's entry `name` as the attribute's type, for decode_sdpa_attributes;
// a missing or mistyped entry raises (as the as_* readers do), so it returns "".
struct ConfigEntry {
  const nb::dict& d;
  std::string operator()(const char* name, bool* out) const {
    *out = as_bool(d, name);
    return "";
  }
  std::string operator()(const char* name, int32_t* out) const {
    *out = as_int32(d, name);
    return "";
  }
  std::string operator()(const char* name, float* out) const {
    *out = as_float(d, name);
    return "";
  }
  std::string operator()(const char* name, std::string* out) const {
    *out = as_string(d, name);
    return "";
  }
};

cudnn_jax::SdpaConfig parse_sdpa_config(const nb::dict& d) {
  cudnn_jax::SdpaConfig c;
  cudnn_jax::decode_sdpa_attributes(ConfigEntry{d}, &c);
  c.backward = as_bool(d, "backward");
  c.dtype = parse_dtype(as_string(d, "dtype"));
  c.b = as_int(d, "b");
  c.t = as_int(d, "t");
  c.s = as_int(d, "s");
  c.n = as_int(d, "n");
  c.k = as_int(d, "k");
  c.h = as_int(d, "h");
  c.hv = as_int(d, "hv");
  c.bias_b = c.has_bias ? as_int(d, "bias_b") : 0;
  c.bias_n = c.has_bias ? as_int(d, "bias_n") : 0;
  c.pages = c.paged ? as_int(d, "pages") : 0;
  c.page = c.paged ? as_int(d, "page") : 0;
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

cudnn_jax::SdpaFp8Config parse_sdpa_fp8_config(const nb::dict& d) {
  cudnn_jax::SdpaFp8Config c;
  cudnn_jax::visit_sdpa_fp8_attributes(c, [&](const char* name, auto& field) {
    ConfigEntry{d}(name, &field);
  });
  c.backward = as_bool(d, "backward");
  const std::string out_dtype = as_string(d, "out_dtype");
  if (!cudnn_jax::sdpa_fp8_out_dtype(out_dtype, &c.out_dtype)) {
    throw nb::value_error(("config['out_dtype']: unknown dtype '" + out_dtype + "'").c_str());
  }
  int64_t* dims[] = {&c.b, &c.t, &c.s, &c.n, &c.k, &c.h, &c.hv};
  const char* names[] = {"b", "t", "s", "n", "k", "h", "hv"};
  for (size_t i = 0; i < std::size(names); ++i) *dims[i] = as_int(d, names[i]);
  return c;
}

std::string sdpa_fp8_check(const nb::dict& d) {
  cudnn_jax::SdpaFp8Config c = parse_sdpa_fp8_config(d);
  nb::gil_scoped_release release;
  return cudnn_jax::sdpa_fp8_check(c);
}

int64_t sdpa_fp8_workspace(const nb::dict& config) {
  return workspace_or_raise(&cudnn_jax::sdpa_fp8_workspace, parse_sdpa_fp8_config(config));
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

cudnn_jax::Conv3dConfig parse_conv3d_config(const nb::dict& d) {
  cudnn_jax::Conv3dConfig c;
  cudnn_jax::visit_conv3d_attributes(c, [&](const char* name, auto& field) { ConfigEntry{d}(name, &field); });
  const std::string pass = as_string(d, "pass");
  if (pass == "dgrad") {
    c.pass = cudnn_jax::Conv3dPass::kDgrad;
  } else if (pass == "wgrad") {
    c.pass = cudnn_jax::Conv3dPass::kWgrad;
  } else if (pass != "forward") {
    throw nb::value_error(("config['pass'] must be 'forward', 'dgrad' or 'wgrad', got '" + pass + "'").c_str());
  }
  c.dtype = parse_dtype(as_string(d, "dtype"));
  c.out_dtype = parse_dtype(as_string(d, "out_dtype"));
  c.residual_dtype = parse_dtype(as_string(d, "residual_dtype"));
  int64_t* dims[] = {&c.n, &c.t, &c.h, &c.w, &c.c, &c.k, &c.kt, &c.kh, &c.kw, &c.ot, &c.oh, &c.ow};
  const char* names[] = {"n", "t", "h", "w", "c", "k", "kt", "kh", "kw", "ot", "oh", "ow"};
  for (size_t i = 0; i < std::size(names); ++i) *dims[i] = as_int(d, names[i]);
  return c;
}

std::string conv3d_check(const nb::dict& d) {
  cudnn_jax::Conv3dConfig c = parse_conv3d_config(d);
  nb::gil_scoped_release release;
  return cudnn_jax::conv3d_check(c);
}

int64_t conv3d_workspace(const nb::dict& config) {
  return workspace_or_raise(&cudnn_jax::conv3d_workspace, parse_conv3d_config(config));
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
  m.doc() = "XLA FFI handlers of cudnn_jax (cuDNN and ahead-of-time kernel engines).";
  m.def("registrations", &registrations,
        "Handler name -> capsule, to register for platform 'CUDA'.");
  m.def("handler_attributes", &handler_attributes,
        "Handler name -> the names of the attributes it takes (every one, exactly), for each "
        "target registrations() lists.");
  m.def("kernel_constants", &kernel_constants,
        "The constants the kernels and their handlers were built with, by kernel: "
        "{'grouped_gemm': {'tile_m': 128, 'epilogues': ('none', ...), ...}}.");
  m.def("sdpa_check", &sdpa_check, nb::arg("config"),
        "'' when cuDNN can serve this SDPA configuration on the current device, else why "
        "not. Builds and caches the plan.");
  m.def("grouped_matmul_check", &grouped_matmul_check, nb::arg("config"),
        "'' when cuDNN can serve this grouped matmul (dtype, m, k, n, groups) on the current "
        "device, else why not. Builds and caches the plan.");
  m.def("sdpa_workspace", &sdpa_workspace, nb::arg("config"),
        "Bytes of the SDPA handlers' workspace result for this configuration (the dict "
        "sdpa_check takes); ValueError when cuDNN cannot serve it.");
  m.def("sdpa_fp8_check", &sdpa_fp8_check, nb::arg("config"),
        "'' when cuDNN can serve this FP8 SDPA configuration (the handler attributes, "
        "backward, out_dtype and shapes) on the current device, else why not. Builds and "
        "caches the plan.");
  m.def("sdpa_fp8_workspace", &sdpa_fp8_workspace, nb::arg("config"),
        "Bytes of an FP8 SDPA handler's workspace result for this configuration (the dict "
        "sdpa_fp8_check takes); ValueError when cuDNN cannot serve it.");
  m.def("grouped_matmul_workspace", &grouped_matmul_workspace, nb::arg("config"),
        "Bytes of the grouped matmul handler's workspace result; ValueError when cuDNN "
        "cannot serve the configuration.");
  m.def("conv3d_check", &conv3d_check, nb::arg("config"),
        "'' when cuDNN can serve this conv3d pass (the handler attributes, pass, dtypes and "
        "shapes) on the current device, else why not. Builds and caches the plan.");
  m.def("conv3d_workspace", &conv3d_workspace, nb::arg("config"),
        "Bytes of a conv3d handler's workspace result for this configuration (the dict "
        "conv3d_check takes); ValueError when cuDNN cannot serve it.");
  m.def("aot_kernels", &aot_kernels,
        "Names of the ahead-of-time compiled CuTe DSL kernel variants linked in.");
  m.def("frontend_kernels", &frontend_kernels,
        "NVIDIA's kernels compiled in from the nvidia-cudnn-frontend wheel's sources: name -> "
        "'<source path in the wheel> (nvidia-cudnn-frontend <version>)'; empty without them.");
#ifdef CUDNN_JAX_AOT_BSA_SM90
  m.def("bsa_bwd_workspace", &bsa_bwd_workspace, nb::arg("b"), nb::arg("n"), nb::arg("sq"),
        nb::arg("skv"), nb::arg("c"), nb::arg("block_size"),
        "Bytes of cudnn_jax_bsa_bwd's workspace result for these shapes (c: block_index's "
        "width).");
#endif
#ifdef CUDNN_JAX_HAVE_KDA_SM90
  m.def("kda_bwd_workspace", &kda_bwd_workspace, nb::arg("t"), nb::arg("h"), nb::arg("n"),
        "Bytes of cudnn_jax_kda_bwd's workspace result for t tokens, h heads, n sequences.");
#endif
  m.def("cache_info", &cache_info,
        "Counters of the process-wide cuDNN plan cache, and each entry's chosen plan.");
  m.def("cudnn_version", [] { return cudnn_jax::cudnn_runtime_version(); },
        "Version of the libcudnn loaded at run time (e.g. 91900); 0 when none loads.");
}
