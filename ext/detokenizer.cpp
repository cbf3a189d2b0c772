// Stage 10, native twin of trillm/engine/detokenizer.py (PyVocab / PyIncrementalDetokenizer).
//
// Vocab: the token -> bytes table of one tokenizer, built once. IncrementalDetokenizer: one
// request's undecided bytes. add_tokens() returns only text that is final; flush() the rest.
// The UTF-8 replacement rule is "one U+FFFD per maximal invalid subpart", the rule of Python's
// errors='replace' and Rust's from_utf8_lossy (tokenizers' ByteLevel decoder).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

constexpr int kByteLevel = 0;
constexpr int kByteFallback = 1;
const char kReplacement[] = "\xEF\xBF\xBD";  // U+FFFD in UTF-8

enum class Step { kChar, kInvalid, kIncomplete };

// Classifies the sequence starting at s[0] (n > 0 bytes available). On kChar or kInvalid,
// *len is how many bytes it consumes (kInvalid: the maximal subpart, at least 1 byte).
Step next_sequence(const unsigned char* s, size_t n, size_t* len) {
  const unsigned char lead = s[0];
  if (lead < 0x80) {
    *len = 1;
    return Step::kChar;
  }
  size_t need;
  unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (lead >= 0xC2 && lead <= 0xDF) {
    need = 2;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    need = 3;
    if (lead == 0xE0) lo = 0xA0;
    if (lead == 0xED) hi = 0x9F;
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    need = 4;
    if (lead == 0xF0) lo = 0x90;
    if (lead == 0xF4) hi = 0x8F;
  } else {
    *len = 1;
    return Step::kInvalid;
  }
  for (size_t i = 1; i < need; ++i) {
    if (i >= n) return Step::kIncomplete;
    const unsigned char lower = i == 1 ? lo : 0x80;
    const unsigned char upper = i == 1 ? hi : 0xBF;
    if (s[i] < lower || s[i] > upper) {
      *len = i;
      return Step::kInvalid;
    }
  }
  *len = need;
  return Step::kChar;
}

// Appends the lossy decoding of data[0:n] to out; returns the bytes consumed. Unless final,
// an incomplete (but so far valid) trailing sequence is left unconsumed.
size_t decode_lossy(const std::string& data, bool final, std::string* out) {
  const auto* s = reinterpret_cast<const unsigned char*>(data.data());
  const size_t n = data.size();
  size_t i = 0;
  while (i < n) {
    size_t start = i;
    while (i < n && s[i] < 0x80) ++i;  // ASCII fast path
    if (i > start) out->append(data, start, i - start);
    if (i == n) break;
    size_t len = 0;
    switch (next_sequence(s + i, n - i, &len)) {
      case Step::kChar:
        out->append(data, i, len);
        i += len;
        break;
      case Step::kInvalid:
        out->append(kReplacement);
        i += len;
        break;
      case Step::kIncomplete:
        if (!final) return i;
        out->append(kReplacement);  // the rest is one maximal subpart
        return n;
    }
  }
  return n;
}

// True if run is valid UTF-8 except possibly for an incomplete last sequence.
bool valid_prefix(const std::string& run) {
  const auto* s = reinterpret_cast<const unsigned char*>(run.data());
  size_t i = 0;
  while (i < run.size()) {
    size_t len = 0;
    Step step = next_sequence(s + i, run.size() - i, &len);
    if (step == Step::kInvalid) return false;
    if (step == Step::kIncomplete) return true;
    i += len;
  }
  return true;
}

// Token ids from a Python list/tuple (fast path) or any iterable of ints.
std::vector<int64_t> to_ids(py::handle obj) {
  std::vector<int64_t> ids;
  PyObject* seq = obj.ptr();
  if (PyList_Check(seq) || PyTuple_Check(seq)) {
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject** items = PySequence_Fast_ITEMS(seq);
    ids.resize(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
      const long long v = PyLong_AsLongLong(items[i]);
      if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
      ids[static_cast<size_t>(i)] = v;
    }
    return ids;
  }
  for (py::handle item : py::iter(obj)) ids.push_back(item.cast<int64_t>());
  return ids;
}

py::str to_str(const std::string& text) {
  PyObject* out = PyUnicode_DecodeUTF8(text.data(), static_cast<Py_ssize_t>(text.size()), nullptr);
  if (out == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(out);
}

struct Vocab {
  std::vector<std::string> table;  // [vocab] token id -> bytes
  std::vector<std::string> first_table;  // [vocab] bytes when it is the first token, or empty
  std::vector<uint8_t> special;    // [vocab] 1 = special (dropped when skipping)
  std::vector<uint8_t> is_byte;    // [vocab] 1 = <0xNN> byte-fallback token
  int scheme;
  int strip_leading_spaces;

  Vocab(const std::vector<py::bytes>& table_in, const std::vector<int64_t>& special_ids,
        int scheme_in, const std::vector<int64_t>& byte_token_ids, int strip,
        const std::vector<py::bytes>& first_table_in)
      : scheme(scheme_in), strip_leading_spaces(strip) {
    if (scheme != kByteLevel && scheme != kByteFallback)
      throw py::value_error("scheme must be 0 (BYTE_LEVEL) or 1 (BYTE_FALLBACK).");
    if (!first_table_in.empty() && first_table_in.size() != table_in.size())
      throw py::value_error("first_table must be empty or as long as table.");
    table.reserve(table_in.size());
    for (const auto& b : table_in) table.emplace_back(static_cast<std::string>(b));
    first_table.reserve(first_table_in.size());
    for (const auto& b : first_table_in) first_table.emplace_back(static_cast<std::string>(b));
    special.assign(table.size(), 0);
    is_byte.assign(table.size(), 0);
    for (int64_t id : special_ids) special[checked(id)] = 1;
    for (int64_t id : byte_token_ids) {
      if (table[checked(id)].size() != 1)
        throw py::value_error("a byte token's table entry must be exactly one byte.");
      is_byte[id] = 1;
    }
  }

  size_t checked(int64_t id) const {
    if (id < 0 || static_cast<size_t>(id) >= table.size())
      throw py::index_error("token id " + std::to_string(id) + " is outside the table of " +
                            std::to_string(table.size()) + " tokens.");
    return static_cast<size_t>(id);
  }

  size_t size() const { return table.size(); }
};

class IncrementalDetokenizer {
 public:
  IncrementalDetokenizer(std::shared_ptr<Vocab> vocab, bool skip_special_tokens,
                         const std::vector<int64_t>& prompt_token_ids)
      : vocab_(std::move(vocab)),
        skip_(skip_special_tokens),
        strip_left_(vocab_->strip_leading_spaces),
        first_(!vocab_->first_table.empty()) {
    if (!prompt_token_ids.empty()) add(prompt_token_ids);  // primes state; text discarded
  }

  // Final text made by ids (UTF-8; pybind converts to str).
  std::string add(const std::vector<int64_t>& ids_in) {
    // Ids past the tokenizer (a model's padded vocabulary can sample them) have no text, as
    // in the tokenizer's own decode: dropped here, never an error. Negative ids are a bug.
    std::vector<int64_t> kept;
    const std::vector<int64_t>* ids_p = &ids_in;
    for (int64_t id : ids_in) {
      if (id < 0) vocab_->checked(id);
      if (static_cast<size_t>(id) >= vocab_->size()) {
        for (int64_t k : ids_in)
          if (k >= 0 && static_cast<size_t>(k) < vocab_->size()) kept.push_back(k);
        ids_p = &kept;
        break;
      }
    }
    const std::vector<int64_t>& ids = *ids_p;
    std::string out;
    if (vocab_->scheme == kByteLevel) {
      add_byte_level(ids, &out);
    } else {
      add_byte_fallback(ids, &out);
      strip(&out);
    }
    return out;
  }

  std::string flush() {
    std::string out;
    if (vocab_->scheme == kByteLevel) {
      decode_lossy(pending_, /*final=*/true, &out);
      pending_.clear();
    } else {
      close_run(&out);
      strip(&out);
    }
    return out;
  }

  bool has_pending() const { return !pending_.empty(); }

 private:
  void add_byte_level(const std::vector<int64_t>& ids, std::string* out) {
    for (int64_t id : ids) {
      if (skip_ && vocab_->special[id]) continue;
      pending_ += vocab_->table[id];
    }
    size_t used = decode_lossy(pending_, /*final=*/false, out);
    pending_.erase(0, used);
  }

  // pending_ holds the open run of byte tokens, valid UTF-8 so far.
  void add_byte_fallback(const std::vector<int64_t>& ids, std::string* out) {
    for (int64_t id : ids) {
      if (skip_ && vocab_->special[id]) continue;
      const bool first = first_;
      first_ = false;
      if (!vocab_->is_byte[id]) {
        close_run(out);
        *out += first ? vocab_->first_table[id] : vocab_->table[id];
      } else if (run_invalid_) {
        out->append(kReplacement);
      } else {
        pending_ += vocab_->table[id];
        if (!valid_prefix(pending_)) {
          // ByteFallback turns an invalid run into one U+FFFD per byte, whatever follows.
          for (size_t i = 0; i < pending_.size(); ++i) out->append(kReplacement);
          pending_.clear();
          run_invalid_ = true;
        }
      }
    }
  }

  void close_run(std::string* out) {
    if (!pending_.empty()) {
      const auto* s = reinterpret_cast<const unsigned char*>(pending_.data());
      size_t len = 0;
      // Valid so far; it is complete unless its last sequence is cut short.
      size_t i = 0;
      bool complete = true;
      while (i < pending_.size()) {
        if (next_sequence(s + i, pending_.size() - i, &len) != Step::kChar) {
          complete = false;
          break;
        }
        i += len;
      }
      if (complete) {
        *out += pending_;
      } else {
        for (size_t k = 0; k < pending_.size(); ++k) out->append(kReplacement);
      }
      pending_.clear();
    }
    run_invalid_ = false;
  }

  void strip(std::string* text) {
    size_t cut = 0;
    while (strip_left_ > 0 && cut < text->size()) {
      if ((*text)[cut] != ' ') {
        strip_left_ = 0;
        break;
      }
      ++cut;
      --strip_left_;
    }
    if (cut) text->erase(0, cut);
  }

  std::shared_ptr<Vocab> vocab_;
  bool skip_;
  int strip_left_;
  std::string pending_;
  bool run_invalid_ = false;
  bool first_;  // the next kept token is the request's first (Metaspace's first_table)
};

}  // namespace

PYBIND11_MODULE(detokenizer, m) {
  m.doc() = "Incremental detokenizer (native twin of trillm.engine.detokenizer).";
  py::class_<Vocab, std::shared_ptr<Vocab>>(m, "Vocab")
      .def(py::init<const std::vector<py::bytes>&, const std::vector<int64_t>&, int,
                    const std::vector<int64_t>&, int, const std::vector<py::bytes>&>(),
           py::arg("table"), py::arg("special_ids"), py::arg("scheme") = kByteLevel,
           py::arg("byte_token_ids") = std::vector<int64_t>{},
           py::arg("strip_leading_spaces") = 0,
           py::arg("first_table") = std::vector<py::bytes>{})
      .def_property_readonly("size", &Vocab::size)
      .def_readonly("scheme", &Vocab::scheme)
      .def_readonly("strip_leading_spaces", &Vocab::strip_leading_spaces);
  py::class_<IncrementalDetokenizer>(m, "IncrementalDetokenizer")
      .def(py::init<std::shared_ptr<Vocab>, bool, const std::vector<int64_t>&>(),
           py::arg("vocab"), py::arg("skip_special_tokens"),
           py::arg("prompt_token_ids") = std::vector<int64_t>{})
      .def(
          "add_tokens",
          [](IncrementalDetokenizer& self, py::handle ids) { return to_str(self.add(to_ids(ids))); },
          py::arg("ids"))
      .def("flush", [](IncrementalDetokenizer& self) { return to_str(self.flush()); })
      .def_property_readonly("has_pending", &IncrementalDetokenizer::has_pending);
}
