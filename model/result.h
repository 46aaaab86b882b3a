#pragma once
// Errors as values: a Result<T> holds either a T or an error message. Used at
// every boundary that can fail on bad input (files, configs, frames, HTTP)
// so that callers cannot ignore a failure silently.

#include <string>
#include <utility>
#include <variant>

namespace moe {

struct Error {
  std::string message;
};

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}
  Result(Error e) : v_(std::move(e)) {}

  bool ok() const { return v_.index() == 0; }
  explicit operator bool() const { return ok(); }
  T& value() & { return std::get<0>(v_); }
  const T& value() const& { return std::get<0>(v_); }
  T&& value() && { return std::get<0>(std::move(v_)); }
  T* operator->() { return &std::get<0>(v_); }
  const T* operator->() const { return &std::get<0>(v_); }
  T& operator*() & { return std::get<0>(v_); }
  const T& operator*() const& { return std::get<0>(v_); }
  const std::string& error() const { return std::get<1>(v_).message; }

 private:
  std::variant<T, Error> v_;
};

// For operations that return nothing but can fail.
class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(Error e) : err_(std::move(e.message)), failed_(true) {}
  static Status ok_status() { return Status(); }
  bool ok() const { return !failed_; }
  explicit operator bool() const { return ok(); }
  const std::string& error() const { return err_; }

 private:
  std::string err_;
  bool failed_ = false;
};

inline Error make_error(std::string msg) { return Error{std::move(msg)}; }

}  // namespace moe

// Returns the failure of `expr` (a Status or a Result) from the enclosing
// function, whose return type is a Status or any Result; goes on otherwise.
#define MOE_TRY(expr)                                                   \
  do {                                                                  \
    if (auto&& moe_try_ = (expr); !moe_try_.ok())                       \
      return ::moe::make_error(std::string(moe_try_.error()));           \
  } while (0)
