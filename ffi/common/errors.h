// Error helpers for FFI handlers: every failure becomes an ffi::Error whose message names
// the op and the failing stage, and no C++ exception reaches XLA.
#pragma once

#include <exception>
#include <string>
#include <string_view>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace cudnn_jax {

namespace ffi = xla::ffi;

// "<op>: <stage>: <message>", the format of every error this library reports.
inline std::string stage_message(std::string_view op, std::string_view stage,
                                 std::string_view message) {
  std::string out(op);
  out.append(": ").append(stage).append(": ").append(message);
  return out;
}

inline ffi::Error internal_error(std::string message) {
  return ffi::Error(ffi::ErrorCode::kInternal, std::move(message));
}

inline ffi::Error invalid_argument(std::string message) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, std::move(message));
}

// Runs `body` (returning ffi::Error) and turns any escaping exception into an error.
template <typename Body>
ffi::Error guarded(std::string_view op, Body&& body) noexcept {
  try {
    return std::forward<Body>(body)();
  } catch (const std::exception& e) {
    return internal_error(stage_message(op, "exception", e.what()));
  } catch (...) {
    return internal_error(stage_message(op, "exception", "unknown C++ exception"));
  }
}

}  // namespace cudnn_jax
