// Arguments of collective bindings (buffer.cpp, dp.cpp, eplb_relocation.cpp).
//
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/shared_ptr.h>

#include <cstdint>
#include <exception>
#include <limits>
#include <memory>
#include <string>

#include "bind.h"
#include "epx/error.h"

namespace epx::py {

// Collective bindings take every argument as nb::handle and convert it with these, inside `collective`
// below, so that nanobind rejects nothing before the binding runs (see there). A value of the wrong Python
// type is a TypeError, as nanobind's own rejection was; a value out of range is epx.InvalidArgumentError.
// Both name the argument.

// "str", "numpy.bool", "epx._epx.LowLatencyHandle".
inline std::string type_name_of(nb::handle obj) {
  nb::handle type = obj.type();
  const std::string module = nb::cast<std::string>(nb::str(type.attr("__module__")));
  const std::string name = nb::cast<std::string>(nb::str(type.attr("__qualname__")));
  return module == "builtins" ? name : module + "." + name;
}

[[noreturn]] inline void wrong_type(const char* name, const char* expected, nb::handle obj) {
  throw nb::type_error((std::string(name) + ": expected " + expected + ", got " + type_name_of(obj)).c_str());
}

// A Python int or anything with __index__ (numpy integers); not bool, float or str.
template <typename Int>
Int to_int(nb::handle obj, const char* name) {
  if (PyBool_Check(obj.ptr()) || !PyIndex_Check(obj.ptr())) wrong_type(name, "an int", obj);
  nb::object index = nb::steal(PyNumber_Index(obj.ptr()));
  if (!index.is_valid()) {  // an __index__ that raises (numpy.bool_)
    PyErr_Clear();
    wrong_type(name, "an int", obj);
  }
  int overflow = 0;
  const long long value = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
  if (value == -1 && PyErr_Occurred()) throw nb::python_error();
  if (overflow != 0 || value < std::numeric_limits<Int>::min() || value > std::numeric_limits<Int>::max()) {
    throw Error(ErrorCode::kInvalidArgument, std::string(name) + ": " + nb::str(index).c_str() +
                                                 " does not fit in int" + std::to_string(8 * sizeof(Int)));
  }
  return static_cast<Int>(value);
}

// True or False, or a numpy.bool_; not an int.
inline bool to_bool(nb::handle obj, const char* name) {
  if (!PyBool_Check(obj.ptr())) {
    const std::string type = type_name_of(obj);
    if (type != "numpy.bool" && type != "numpy.bool_") wrong_type(name, "a bool", obj);
  }
  const int value = PyObject_IsTrue(obj.ptr());
  if (value < 0) throw nb::python_error();
  return value != 0;
}

template <typename T>
T to_enum(nb::handle obj, const char* name, const char* expected) {
  T value{};
  if (!nb::try_cast(obj, value)) wrong_type(name, expected, obj);
  return value;
}

// None (no handle) or a handle of type `Handle`.
template <typename Handle>
std::shared_ptr<const Handle> to_handle(nb::handle obj, const char* name, const char* expected) {
  std::shared_ptr<const Handle> handle;
  if (!obj.is_none() && !nb::try_cast(obj, handle)) wrong_type(name, expected, obj);
  return handle;
}

// Runs the collective `call` on the arguments that convert(args) fills in. If convert throws (a float64
// array, a str for num_experts), this rank still makes the call, with empty arguments, which the backend
// rejects like any invalid input (the host backend takes part in the rendezvous with an error flag, so the
// peers raise kPeerFailure at once); then it raises the conversion error.
// NOTE: without this the rank skipped the call, and its peers paired their call with its next one (the same
// collective number): silently wrong data, or a timeout (docs/reliability.md, Soak). The same holds for an
// argument nanobind rejects before the binding runs, hence nb::handle for every argument.
template <typename Args, typename Convert, typename Call>
auto collective(Convert&& convert, Call&& call) {
  Args args;
  try {
    convert(args);
  } catch (...) {
    {
      nb::gil_scoped_release release;
      try {
        call(Args{});
      } catch (...) {  // the expected rejection; this rank's error is the conversion error
      }
    }
    throw;
  }
  nb::gil_scoped_release release;
  return call(args);
}

// As collective(), for a call whose backend takes part with an error flag through an explicit failure call
// instead of rejecting empty arguments (BatchMetadataSync::fail): if convert throws, this rank calls
// fail(reason, args) with the arguments converted so far (convert those that fail() needs first), then raises
// the conversion error.
template <typename Args, typename Convert, typename Call, typename Fail>
auto collective_or_fail(Convert&& convert, Call&& call, Fail&& fail) {
  Args args;
  try {
    convert(args);
  } catch (...) {
    std::string reason = "the binding could not convert its arguments";
    try {
      throw;
    } catch (const std::exception& e) {
      reason = e.what();
    } catch (...) {
    }
    {
      nb::gil_scoped_release release;
      fail(reason, args);
    }
    throw;
  }
  nb::gil_scoped_release release;
  return call(args);
}

}  // namespace epx::py
