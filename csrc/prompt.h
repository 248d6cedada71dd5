// Prompt checks shared by the Python bindings and any future C++ caller (no Python headers here).
//
// A TTS prompt is N rows of W codec ids (the voice-cloning reference plus the text). The checks run on
// every admitted request, so they are written once, scan memory without the GIL, and report the first
// problem in row-major order with a message a client can act on.
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace tandem {

// A problem with the client's prompt; pybind11 maps std::invalid_argument to ValueError.
class PromptError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// The model's and the server's bounds for one prompt.
struct PromptLimits {
  int64_t row_width;
  int64_t vocab_size;
  int64_t max_rows;
};

// Per-column id ranges (rows whose columns hold different vocabularies, e.g. CSM's N codebooks and a
// text column): column j holds ids in [min_id, hi[j]); `hi` empty means every column's is vocab_size.
// min_id is 0, or -1 where a row may leave a column absent.
struct ColumnRanges {
  std::vector<int64_t> hi;
  int64_t min_id = 0;

  bool uniform() const { return hi.empty() && min_id == 0; }
  int64_t bound(int64_t col, int64_t vocab_size) const { return hi.empty() ? vocab_size : hi[col]; }
  // True when `id` is outside column `col`'s range: one unsigned compare catches both ends.
  bool outside(int64_t id, int64_t col, int64_t vocab_size) const {
    return static_cast<uint64_t>(id - min_id) >= static_cast<uint64_t>(bound(col, vocab_size) - min_id);
  }
};

// Rejects per-column bounds that do not fit the row: one positive bound per column, min_id 0 or -1.
inline void check_ranges(const ColumnRanges& r, const PromptLimits& lim) {
  if (!r.hi.empty() && static_cast<int64_t>(r.hi.size()) != lim.row_width) {
    throw std::invalid_argument("column_vocab has " + std::to_string(r.hi.size()) + " bounds; row_width is " +
                                std::to_string(lim.row_width));
  }
  for (const int64_t h : r.hi) {
    if (h < 1) throw std::invalid_argument("column_vocab bounds must be >= 1, got " + std::to_string(h));
  }
  if (r.min_id != 0 && r.min_id != -1) {
    throw std::invalid_argument("min_id must be 0 or -1, got " + std::to_string(r.min_id));
  }
}

// Rejects non-positive bounds: they come from configuration, and a zero width would make every later
// message misleading.
inline void check_limits(const PromptLimits& lim) {
  if (lim.row_width < 1) throw std::invalid_argument("row_width must be >= 1, got " + std::to_string(lim.row_width));
  if (lim.vocab_size < 1) {
    throw std::invalid_argument("vocab_size must be >= 1, got " + std::to_string(lim.vocab_size));
  }
  if (lim.max_rows < 1) throw std::invalid_argument("max_rows must be >= 1, got " + std::to_string(lim.max_rows));
}

inline void check_row_count(int64_t rows, const PromptLimits& lim) {
  if (rows < 1) throw PromptError("PROMPT has 0 rows; at least 1 is required");
  if (rows > lim.max_rows) {
    throw PromptError("PROMPT has " + std::to_string(rows) + " rows; the limit is " + std::to_string(lim.max_rows));
  }
}

inline void check_row_width(int64_t width, const PromptLimits& lim) {
  if (width != lim.row_width) {
    throw PromptError("PROMPT rows have width " + std::to_string(width) + "; this model's row_width is " +
                      std::to_string(lim.row_width));
  }
}

// `value` is pre-formatted so callers can report ids that do not fit in int64 (from Python lists).
inline std::string outside_vocab(int64_t row, int64_t col, const std::string& value, int64_t vocab_size) {
  return "PROMPT[" + std::to_string(row) + ", " + std::to_string(col) + "] = " + value +
         " is outside the vocabulary [0, " + std::to_string(vocab_size) + ")";
}

// True when `id` is not in [0, vocab_size): one unsigned compare catches negatives too.
inline bool out_of_vocab(int64_t id, int64_t vocab_size) {
  return static_cast<uint64_t>(id) >= static_cast<uint64_t>(vocab_size);
}

inline std::string outside_column(int64_t row, int64_t col, const std::string& value, int64_t lo, int64_t hi) {
  return "PROMPT[" + std::to_string(row) + ", " + std::to_string(col) + "] = " + value + " is outside column " +
         std::to_string(col) + "'s ids [" + std::to_string(lo) + ", " + std::to_string(hi) + ")";
}

// The message for an id outside its column's range (the vocabulary's own message when uniform).
inline std::string outside_range(int64_t row, int64_t col, const std::string& value, const ColumnRanges& r,
                                 int64_t vocab_size) {
  if (r.uniform()) return outside_vocab(row, col, value, vocab_size);
  return outside_column(row, col, value, r.min_id, r.bound(col, vocab_size));
}

// Scans like check_ids below, each column against its own range (ColumnRanges).
inline void check_column_ids(const char* base, int64_t rows, int64_t cols, int64_t row_stride,
                             int64_t col_stride, int64_t vocab_size, const ColumnRanges& r) {
  for (int64_t i = 0; i < rows; ++i) {
    const char* row = base + i * row_stride;
    for (int64_t j = 0; j < cols; ++j) {
      int64_t v;
      std::memcpy(&v, row + j * col_stride, sizeof v);
      if (r.outside(v, j, vocab_size)) throw PromptError(outside_range(i, j, std::to_string(v), r, vocab_size));
    }
  }
}

// Scans a [rows, cols] int64 matrix laid out with byte strides (any sign, any alignment) and throws a
// PromptError for the first id outside the vocabulary. Touches no Python state: safe without the GIL.
inline void check_ids(const char* base, int64_t rows, int64_t cols, int64_t row_stride, int64_t col_stride,
                      int64_t vocab_size) {
  auto load = [](const char* p) {
    int64_t v;
    std::memcpy(&v, p, sizeof v);  // numpy may hand us unaligned data; memcpy compiles to a plain load
    return v;
  };
  auto fail = [&](int64_t i) {
    const char* row = base + i * row_stride;
    for (int64_t j = 0; j < cols; ++j) {
      const int64_t v = load(row + j * col_stride);
      if (out_of_vocab(v, vocab_size)) throw PromptError(outside_vocab(i, j, std::to_string(v), vocab_size));
    }
  };
  const auto item = static_cast<int64_t>(sizeof(int64_t));
  if (col_stride == item && row_stride == cols * item) {
    // C-contiguous: branch-free OR-reduction over blocks of rows so the compiler can vectorise; only a
    // block with a bad id is rescanned row by row to name it.
    constexpr int64_t kBlockRows = 256;
    for (int64_t r0 = 0; r0 < rows; r0 += kBlockRows) {
      const int64_t r1 = r0 + kBlockRows < rows ? r0 + kBlockRows : rows;
      const char* p = base + r0 * row_stride;
      const int64_t n = (r1 - r0) * cols;
      bool bad = false;
      for (int64_t k = 0; k < n; ++k) bad |= out_of_vocab(load(p + k * item), vocab_size);
      if (bad) {
        for (int64_t i = r0; i < r1; ++i) fail(i);
      }
    }
    return;
  }
  for (int64_t i = 0; i < rows; ++i) {
    const char* row = base + i * row_stride;
    bool bad = false;
    for (int64_t j = 0; j < cols; ++j) bad |= out_of_vocab(load(row + j * col_stride), vocab_size);
    if (bad) fail(i);
  }
}

}  // namespace tandem
