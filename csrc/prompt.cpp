// tandem.csrc._native: prompt validation and packing off the scheduler's hot path.
//
// Why native: prompts are 1000+ rows of W ids. Validating and packing them as Python lists on the
// scheduler thread put prefill admission's p99 at 667 ms (every admission waited behind the packing);
// doing it here (GIL released for the array scan, one pass without per-id Python objects for lists)
// cut it to 149 ms.
//
// Errors: every problem is a C++ exception translated by pybind11 (PromptError -> ValueError for bad
// prompts, py::type_error -> TypeError for a wrong argument kind). Nothing returns a status code.
// The pure-numpy fallback in csrc/__init__.py produces the same messages; the tests hold both to it.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "prompt.h"

namespace py = pybind11;

namespace tandem {
namespace {

constexpr const char* kVersion = "0.1.0";

// type(obj).__name__, matching what the Python fallback prints. Only called on error paths.
std::string type_name(py::handle obj) {
  return py::str(py::handle(reinterpret_cast<PyObject*>(Py_TYPE(obj.ptr()))).attr("__name__"));
}

std::string plural(int64_t n, const char* word) {
  return std::to_string(n) + " " + word + (n == 1 ? "" : "s");
}

bool is_row_container(PyObject* obj) { return PyList_Check(obj) || PyTuple_Check(obj); }

// Validates an int64 [N, W] array in place; strided and non-contiguous arrays are scanned without a copy.
void validate_rows(py::object obj, int64_t row_width, int64_t vocab_size, int64_t max_rows,
                   std::vector<int64_t> column_vocab, int64_t min_id) {
  const PromptLimits lim{row_width, vocab_size, max_rows};
  check_limits(lim);
  const ColumnRanges ranges{std::move(column_vocab), min_id};
  check_ranges(ranges, lim);
  if (!py::isinstance<py::array>(obj)) throw py::type_error("PROMPT must be a numpy array, got " + type_name(obj));
  auto arr = py::reinterpret_borrow<py::array>(obj);
  if (!arr.dtype().equal(py::dtype::of<int64_t>())) {
    throw py::type_error("PROMPT must be an int64 array, got " + std::string(py::str(arr.dtype())));
  }
  if (arr.ndim() != 2) {
    throw PromptError("PROMPT must have 2 dimensions [rows, row_width]; got " + std::to_string(arr.ndim()));
  }
  const int64_t rows = arr.shape(0);
  const int64_t cols = arr.shape(1);
  check_row_count(rows, lim);
  check_row_width(cols, lim);
  const char* base = static_cast<const char*>(arr.data());
  const int64_t row_stride = arr.strides(0);
  const int64_t col_stride = arr.strides(1);
  // `obj` stays referenced by the caller's frame, so the buffer outlives the scan; numpy refuses to
  // resize an array that has other references.
  py::gil_scoped_release nogil;
  if (ranges.uniform()) {
    check_ids(base, rows, cols, row_stride, col_stride, vocab_size);
  } else {
    check_column_ids(base, rows, cols, row_stride, col_stride, vocab_size, ranges);
  }
}

// Reads one id from a Python int without creating any object (the common path), or throws.
int64_t read_id(PyObject* item, int64_t i, int64_t j, int64_t vocab_size, const ColumnRanges& r) {
  if (!PyLong_Check(item) || PyBool_Check(item)) {
    throw PromptError("PROMPT[" + std::to_string(i) + ", " + std::to_string(j) + "] is not an integer (got " +
                      type_name(item) + ")");
  }
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
  if (overflow != 0) {
    // Too large for int64: format the exact value (int(item) drops any subclass's __str__).
    py::object exact = py::reinterpret_steal<py::object>(PyNumber_Long(item));
    if (!exact) throw py::error_already_set();
    throw PromptError(outside_range(i, j, std::string(py::str(exact)), r, vocab_size));
  }
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  if (r.outside(v, j, vocab_size)) throw PromptError(outside_range(i, j, std::to_string(v), r, vocab_size));
  return static_cast<int64_t>(v);
}

// Packs a list/tuple of list/tuple of ints (a decoded JSON prompt) into a fresh int64 [N, W] array.
// Needs the GIL throughout (it reads Python objects) but runs no Python code until it fails, so the
// borrowed item pointers cannot be invalidated under it.
py::array_t<int64_t> pack_rows(py::object rows, int64_t row_width, int64_t vocab_size, int64_t max_rows,
                               std::vector<int64_t> column_vocab, int64_t min_id) {
  const PromptLimits lim{row_width, vocab_size, max_rows};
  check_limits(lim);
  const ColumnRanges ranges{std::move(column_vocab), min_id};
  check_ranges(ranges, lim);
  PyObject* outer = rows.ptr();
  if (!is_row_container(outer)) throw PromptError("PROMPT must be a list of rows, got " + type_name(rows));
  const int64_t n = PySequence_Fast_GET_SIZE(outer);
  check_row_count(n, lim);
  py::array_t<int64_t> out({n, row_width});
  int64_t* dst = out.mutable_data();
  PyObject** row_items = PySequence_Fast_ITEMS(outer);
  for (int64_t i = 0; i < n; ++i) {
    PyObject* row = row_items[i];
    if (!is_row_container(row)) {
      throw PromptError("PROMPT row " + std::to_string(i) + " must be a list of ids, got " + type_name(row));
    }
    const int64_t w = PySequence_Fast_GET_SIZE(row);
    if (w != row_width) {
      throw PromptError("PROMPT row " + std::to_string(i) + " has " + plural(w, "id") + "; expected " +
                        std::to_string(row_width));
    }
    PyObject** ids = PySequence_Fast_ITEMS(row);
    for (int64_t j = 0; j < w; ++j) dst[i * row_width + j] = read_id(ids[j], i, j, vocab_size, ranges);
  }
  return out;
}

std::string build_info() {
  std::string compiler;
#if defined(__clang__)
  compiler = "clang " __clang_version__;
#elif defined(__GNUC__)
  compiler = "gcc " __VERSION__;
#else
  compiler = "unknown compiler";
#endif
  return std::string("tandem.csrc._native ") + kVersion + " (pybind11 " + std::to_string(PYBIND11_VERSION_MAJOR) +
         "." + std::to_string(PYBIND11_VERSION_MINOR) + "." + std::to_string(PYBIND11_VERSION_PATCH) + ", " +
         compiler + ", C++" + std::to_string(__cplusplus / 100 % 100) + ")";
}

}  // namespace
}  // namespace tandem

PYBIND11_MODULE(_native, m) {
  m.doc() = "Prompt validation and packing for tandem (see csrc/prompt.cpp for why this is native).";
  m.attr("__version__") = tandem::kVersion;
  m.def("validate_rows", &tandem::validate_rows, py::arg("arr"), py::arg("row_width"), py::arg("vocab_size"),
        py::arg("max_rows"), py::arg("column_vocab") = std::vector<int64_t>{}, py::arg("min_id") = 0,
        "Check an int64 [N, W] array: 2-D, 1 <= N <= max_rows, W == row_width, ids in [0, vocab_size)\n"
        "(with column_vocab, column j's in [min_id, column_vocab[j]); min_id -1 lets a column be absent).\n"
        "Raises ValueError naming the first problem (row-major), TypeError for a non-int64 or non-array "
        "argument. The id scan runs with the GIL released; no copy is made.");
  m.def("pack_rows", &tandem::pack_rows, py::arg("rows"), py::arg("row_width"), py::arg("vocab_size"),
        py::arg("max_rows"), py::arg("column_vocab") = std::vector<int64_t>{}, py::arg("min_id") = 0,
        "Pack a list/tuple of list/tuple of Python ints into a new C-contiguous int64 [N, W] array,\n"
        "with the same checks as validate_rows; every problem raises ValueError.");
  m.def("build_info", &tandem::build_info, "Version, pybind11 and compiler this module was built with.");
}
