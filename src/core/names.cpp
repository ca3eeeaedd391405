// SPDX-License-Identifier: MIT
// String names of the public enums, used in logs, messages and the C API.
#include "residency/backend.hpp"
#include "residency/config.hpp"
#include "residency/status.hpp"

namespace residency {

const char* to_string(ErrorCode code) noexcept {
  switch (code) {
    case ErrorCode::ok: return "ok";
    case ErrorCode::invalid_argument: return "invalid_argument";
    case ErrorCode::limit_exceeded: return "limit_exceeded";
    case ErrorCode::permission_denied: return "permission_denied";
    case ErrorCode::out_of_memory: return "out_of_memory";
    case ErrorCode::unsupported: return "unsupported";
    case ErrorCode::not_found: return "not_found";
    case ErrorCode::io_error: return "io_error";
    case ErrorCode::backend_error: return "backend_error";
    case ErrorCode::interrupted: return "interrupted";
  }
  return "unknown";
}

const char* to_string(RegionClass c) noexcept {
  switch (c) {
    case RegionClass::weights: return "weights";
    case RegionClass::kv_cache: return "kv_cache";
    case RegionClass::scratch: return "scratch";
  }
  return "unknown";
}

const char* to_string(LogLevel l) noexcept {
  switch (l) {
    case LogLevel::error: return "error";
    case LogLevel::warn: return "warn";
    case LogLevel::info: return "info";
    case LogLevel::debug: return "debug";
  }
  return "unknown";
}

const char* to_string(Layout l) noexcept {
  switch (l) {
    case Layout::per_buffer: return "per_buffer";
    case Layout::sharded: return "sharded";
  }
  return "unknown";
}

}  // namespace residency
