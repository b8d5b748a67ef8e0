// Reading a handler's attributes from the whole attribute dictionary (a binding's
// `.Attrs()`), with errors that name the attribute at fault.
#pragma once

#include <string>
#include <string_view>

#include "common/errors.h"

namespace cudnn_jax {

// Reads attribute `name` into *out: "" or what is wrong (missing, or of another type; the
// types must match exactly, e.g. a Python float must arrive as np.float32).
template <typename T>
std::string get_attribute(const ffi::Dictionary& attrs, const char* name, T* out) {
  if (!attrs.contains(name)) return std::string("missing attribute '") + name + "'";
  ffi::ErrorOr<T> value = attrs.get<T>(name);
  if (value.has_error()) {
    return std::string("attribute '") + name + "': " + value.error().message();
  }
  *out = *value;
  return "";
}

// A string attribute (a Python str) into *out.
inline std::string get_attribute(const ffi::Dictionary& attrs, const char* name,
                                 std::string* out) {
  std::string_view view;
  if (std::string err = get_attribute(attrs, name, &view); !err.empty()) return err;
  *out = std::string(view);
  return "";
}

// The first attribute of `attrs` that is not one of `names`, as an error; "" when none.
template <size_t N>
std::string unexpected_attribute(const ffi::Dictionary& attrs, const char* const (&names)[N]) {
  for (std::string_view name : attrs) {
    bool known = false;
    for (const char* expected : names) known = known || name == expected;
    if (!known) return "unexpected attribute '" + std::string(name) + "'";
  }
  return "";
}

}  // namespace cudnn_jax
