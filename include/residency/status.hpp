// SPDX-License-Identifier: MIT
// residency: error reporting without exceptions.
//
// Every call a caller can get wrong returns a Status (or a Result<T>) that says what was
// expected, what was found and what to do. Nothing in the library asserts or aborts on a
// condition a caller can cause; the C API forwards these messages unchanged.
#pragma once

#include <string>
#include <utility>
#include <variant>

namespace residency {

enum class ErrorCode {
  ok = 0,
  invalid_argument,   // a value the caller passed is outside what is accepted
  limit_exceeded,     // a size or count over a configured or system limit
  permission_denied,  // the OS refused (EPERM, missing capability)
  out_of_memory,      // the OS or device had no memory left (ENOMEM, CUDA OOM)
  unsupported,        // the backend or platform cannot do this
  not_found,          // an unknown region, file or id
  io_error,           // reading a file or a /proc entry failed
  backend_error,      // any other backend failure (its message says which call)
  interrupted,        // a release stopped because a call began (Backend::interrupt_release)
};

// Returns a stable lower-case name ("invalid_argument", ...).
const char* to_string(ErrorCode code) noexcept;

class [[nodiscard]] Status {
 public:
  Status() = default;  // ok
  Status(ErrorCode code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status ok() { return {}; }

  bool is_ok() const noexcept { return code_ == ErrorCode::ok; }
  explicit operator bool() const noexcept { return is_ok(); }
  ErrorCode code() const noexcept { return code_; }
  const std::string& message() const noexcept { return message_; }

 private:
  ErrorCode code_ = ErrorCode::ok;
  std::string message_;
};

// A value or the Status that explains why there is none (std::expected is C++23).
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}       // NOLINT(google-explicit-constructor)
  Result(Status error) : v_(std::move(error)) {}  // NOLINT(google-explicit-constructor)
  Result(ErrorCode code, std::string message) : v_(Status(code, std::move(message))) {}

  bool is_ok() const noexcept { return std::holds_alternative<T>(v_); }
  explicit operator bool() const noexcept { return is_ok(); }
  // Precondition: is_ok(). Calling these on an error is a programming error of ours, not
  // of a caller: every public path checks first.
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &std::get<T>(v_); }
  const T* operator->() const { return &std::get<T>(v_); }
  T& operator*() & { return std::get<T>(v_); }
  const T& operator*() const& { return std::get<T>(v_); }

  Status status() const { return is_ok() ? Status() : std::get<Status>(v_); }
  const std::string& message() const {
    static const std::string empty;
    return is_ok() ? empty : std::get<Status>(v_).message();
  }

 private:
  std::variant<T, Status> v_;
};

}  // namespace residency
