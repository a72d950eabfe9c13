// opdispatch's compiled per-call fast path: a front door as a C builtin.
//
// A front door (opdispatch.attention, rms_norm, rotary_embedding, the compat drop-ins) called with a signature
// it has seen calls the kernel bound to that signature. The Python front door does this with a key tuple built
// from Python attribute reads (+2.5 to +7.7 µs over the kernel on the tiniest CPU call); this builtin reads the same fields straight
// from each tensor's TensorImpl and looks them up in a C++ table. Everything else — the first call of a
// signature, anything unusual (non-tensors, subclasses, compiling, a mask, an argument it does not know) — goes
// to the Python front door, which stays the reference behaviour: it validates, decides, binds and raises.
//
// Coherence: an entry keeps the Python key, the bound function and the manager's `fast` dict it was read from,
// with that dict's version tag. A C key that matches implies the Python key matches (the C key reads the same
// fields or finer ones). While the tag is unchanged the dict holds the same function under that key; after any
// change (a demotion, a retry, an eviction, another signature) one lookup of the Python key says whether it still
// does. A policy swap (the manager's new state brings a new dict) or a new process-wide manager forgets every
// table (opdispatch.base._native.forget), so the next call goes through Python and the entry is read again. So a hit
// never calls a function the Python path would not call.
//
// Built by opdispatch.base._native (torch.utils.cpp_extension) against torch's headers (`opdispatch build`); the design
// is in docs/architecture.md ("A call", step 1, Compiled).

#include <Python.h>

#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>
#include <c10/core/GradMode.h>
#include <ATen/Context.h>
#include <ATen/autocast_mode.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#if PY_VERSION_HEX < 0x030B0000
#error "opdispatch's compiled fast path needs Python 3.11 or newer (PyErr_SetHandledException); the Python path runs"
#endif
#if PY_VERSION_HEX >= 0x030E0000
#error "opdispatch's compiled fast path reads dict version tags, which Python 3.14 removed; the Python path runs"
#endif

namespace {

// How an argument enters the key: opdispatch.base._arguments.KEY_KINDS, plus the compat drop-ins' own.
enum Kind : int {
  kTensor = 0,     // required tensor: sizes, dtype, device; requires_grad joins the grad field
  kStrided = 1,    // as kTensor, plus the last dim's stride
  kOptTensor = 2,  // None, or sizes, dtype, device and requires_grad
  kIndex = 3,      // None, an int, or an accelerator tensor's sizes, dtype, device (a CPU tensor: Python)
  kValue = 4,      // None, bool, int, float (not NaN) or str, with its class
  kStr = 5,        // None or a str
  kIntTuple = 6,   // None or a tuple of ints
  kBypass = 7,     // must be None (anything else: Python)
  kZero = 8,       // a zero int or float (anything else: Python)
};

constexpr Py_ssize_t kMaxArgs = 48;
constexpr size_t kMaxWords = 512;
constexpr size_t kMaxObjects = 48;
constexpr uint32_t kSizedCallsBeforeExact = 32;  // see sized_or_miss
constexpr size_t kMaxEntries = 4096;  // the Python cache's own bound (CACHE_LIMIT) is far below

// One thread-local reentrancy flag per ThreadFlag object (the compat drop-ins' "inside an implementation").
constexpr int kMaxFlags = 16;
thread_local long tls_flags[kMaxFlags] = {0};
int flags_made = 0;

PyObject* s_manager = nullptr;  // "_manager"
PyObject* s_fast = nullptr;     // "fast"
PyObject* s_compiling = nullptr;  // "_is_compiling_flag"

inline uint64_t dict_version(PyObject* dict) {
  _Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wdeprecated-declarations\"")
  return reinterpret_cast<PyDictObject*>(dict)->ma_version_tag;
  _Pragma("GCC diagnostic pop")
}

struct Key {
  uint64_t words[kMaxWords];
  size_t n_words = 0;
  PyObject* equal[kMaxObjects];  // borrowed: str values, compared by equality
  size_t n_equal = 0;
  PyObject* held[kMaxObjects];  // new references: context values, keyed by identity
  size_t n_held = 0;

  ~Key() {
    for (size_t i = 0; i < n_held; ++i) Py_DECREF(held[i]);
  }
  bool push(uint64_t w) {
    if (n_words == kMaxWords) return false;
    words[n_words++] = w;
    return true;
  }
  // Four independent lanes: a key is 30-80 words, and one serial chain of multiplies would cost more than the
  // rest of the lookup.
  uint64_t hash() const {
    uint64_t lanes[4] = {0x84222325cbf29ce4ULL ^ n_words, 0x9e3779b97f4a7c15ULL, 0xc2b2ae3d27d4eb4fULL,
                         0x165667b19e3779f9ULL};
    size_t i = 0;
    for (; i + 4 <= n_words; i += 4) {
      for (size_t j = 0; j < 4; ++j) lanes[j] = (lanes[j] ^ words[i + j]) * 0x100000001b3ULL;
    }
    for (; i < n_words; ++i) lanes[0] = (lanes[0] ^ words[i]) * 0x100000001b3ULL;
    uint64_t h = lanes[0] ^ (lanes[1] >> 1) ^ (lanes[2] << 1) ^ (lanes[3] >> 3);
    return h ^ (h >> 29);
  }
};

// A key kept in a table: its words and strong references to its objects (what `Key` borrows or owns per call).
struct StoredKey {
  std::vector<uint64_t> words;
  std::vector<PyObject*> equal;  // strong
  std::vector<PyObject*> held;   // strong

  bool matches(const Key& key) const {
    if (words.size() != key.n_words || equal.size() != key.n_equal) return false;
    if (std::memcmp(words.data(), key.words, key.n_words * sizeof(uint64_t)) != 0) return false;
    for (size_t i = 0; i < key.n_equal; ++i) {
      if (equal[i] != key.equal[i] && PyUnicode_Compare(equal[i], key.equal[i]) != 0) return false;
    }
    return true;
  }
  void adopt(const Key& key) {
    words.assign(key.words, key.words + key.n_words);
    for (size_t i = 0; i < key.n_equal; ++i) {
      Py_INCREF(key.equal[i]);
      equal.push_back(key.equal[i]);
    }
    for (size_t i = 0; i < key.n_held; ++i) {
      Py_INCREF(key.held[i]);
      held.push_back(key.held[i]);
    }
  }
  void release_key() {
    for (PyObject* o : equal) Py_DECREF(o);
    for (PyObject* o : held) Py_DECREF(o);
    equal.clear();
    held.clear();
  }
};

struct Entry : StoredKey {
  PyObject* manager = nullptr;   // strong: the manager it was read from (its failure hook's first argument)
  PyObject* fast = nullptr;      // strong: the manager's dict the function was read from
  uint64_t fast_version = 0;
  PyObject* pykey = nullptr;  // strong: the Python path's key (the failure hook pops it)
  PyObject* fn = nullptr;     // strong: the bound function

  void release() {
    release_key();
    Py_CLEAR(manager);
    Py_CLEAR(fast);
    Py_CLEAR(pykey);
    Py_CLEAR(fn);
  }
};

// What a door keeps for calls that differ from a signature the Python path ran only in sizes (its key reduced as
// opdispatch.doors._api's `size_generic_key` does): the function its template bound, the sizes of its decision class
// as constraints on the tensors' sizes, what its output must be, and the dicts whose change may change what the
// Python path (`_sized_reuse`) would do — each with its version tag when read. `fn` nullptr: none is taken (until
// a watched dict changes). Made by the door's `size_entry` hook (`_native_size_entry`).
struct SizedEntry : StoredKey {
  PyObject* manager = nullptr;   // strong
  PyObject* fn = nullptr;        // strong, or nullptr
  PyObject* capturing = nullptr;  // strong, or nullptr: capturing() true hands the call to Python
  std::vector<int64_t> constraints;  // six per constraint: see _native_size_entry
  int64_t head_dim_v = 0;
  int scalar_type = -1;
  std::vector<std::pair<PyObject*, uint64_t>> watched;  // strong dicts, with their version tags

  bool current(PyObject* now_manager) const {
    if (now_manager != manager) return false;
    for (const auto& w : watched) {
      if (dict_version(w.first) != w.second) return false;
    }
    return true;
  }
  void release() {
    release_key();
    for (auto& w : watched) Py_DECREF(w.first);
    watched.clear();
    Py_CLEAR(manager);
    Py_CLEAR(fn);
    Py_CLEAR(capturing);
  }
};

// How one call site's arguments bind to a door's slots. A call site passes the same keyword-name tuple (a code
// constant) with the same number of positionals on every call, so the binding is worked out once per
// (nargs, kwnames) and reused: its slots, whether Python would accept it, and which slots were passed.
struct CallShape {
  PyObject* kwnames = nullptr;  // strong; nullptr: no keywords (or an empty slot of the cache, nargs -1)
  Py_ssize_t nargs = -1;
  bool binds = false;  // Python would bind it (no unknown or repeated keyword, every required slot given)
  uint64_t passed = 0;  // a bit per slot given by the caller: the key's first word
  Py_ssize_t n_kw = 0;
  Py_ssize_t kw_slot[kMaxArgs];  // the slot of each keyword, in kwnames' order
  Py_ssize_t n_keyed = 0;
  Py_ssize_t keyed[kMaxArgs];  // the slots the key reads: those given, and defaults that do not key as constants
  bool optional_given = false;  // a bound optional argument was given or defaults to a value (else all are None)
};

constexpr int kCallShapes = 8;

struct SlotSpec {
  uint8_t kind;  // Kind
  bool exact;    // tensors must be torch.Tensor exactly (not Parameter)
  bool grad;     // requires_grad joins the grad field
};

struct Door;
PyObject* manager_of(Door* d);

struct Door {
  std::string name;
  std::string doc;
  PyMethodDef def{};
  Py_ssize_t n = 0;
  Py_ssize_t n_positional = 0;
  std::vector<PyObject*> names;     // strong, interned
  std::vector<PyObject*> defaults;  // strong; nullptr: required
  std::vector<SlotSpec> specs;  // per argument: how it enters the key
  std::vector<Py_ssize_t> bound, bound_optional;
  std::vector<char> default_keyed;  // the default is keyed on every call (it is not a constant the key can omit)
  CallShape shapes[kCallShapes];     // the call sites seen last (round-robin)
  int next_shape = 0;
  std::vector<PyObject*> context;  // strong: ContextVars (read directly) or callables
  PyObject* python = nullptr;      // the Python front door: every call that is not a hit
  PyObject* key_of = nullptr;      // key_of(*arguments): the Python path's key, or None
  PyObject* failed = nullptr;      // failed(manager, key, fn, exc, *arguments)
  PyObject* result = nullptr;      // result(out, arguments[result_arg]) when that argument is true
  Py_ssize_t result_arg = -1;
  int flag = -1;                   // the ThreadFlag slot set around the kernel, or -1
  PyObject* api_globals = nullptr;       // opdispatch.doors._api's globals (its `_manager`)
  PyObject* compiler_globals = nullptr;  // torch.compiler's globals (its `_is_compiling_flag`)
  // Entries by key hash; each is allocated once (a pointer to it stays valid until clear_table).
  std::unordered_map<uint64_t, std::vector<std::unique_ptr<Entry>>> table;
  size_t n_entries = 0;
  Entry* last = nullptr;  // the entry of the last hit or miss: a loop of one signature skips hashing
  PyObject* size_entry = nullptr;  // size_entry(*arguments) -> a SizedEntry's fields, or None (no sized entries)
  std::unordered_map<uint64_t, std::unique_ptr<SizedEntry>> sized;  // by reduced key hash (a collision replaces)
  uint64_t generation = 0;  // bumped by clear_table
  std::unordered_set<uint64_t> seen_once;  // hashes of keys missed once (read back from their second call)
  std::unordered_map<uint64_t, uint32_t> sized_seen;  // by key hash: calls a signature took through a sized entry
  uint64_t hits = 0, misses = 0, passes = 0, revalidated = 0, sized_hits = 0;
  uint64_t compiler_version = 0;  // torch.compiler's globals' version tag when `compiling` was read
  bool compiling = false;

  ~Door() {
    clear_table();
    for (CallShape& c : shapes) Py_CLEAR(c.kwnames);
    for (PyObject* o : names) Py_XDECREF(o);
    for (PyObject* o : defaults) Py_XDECREF(o);
    for (PyObject* o : context) Py_XDECREF(o);
    Py_XDECREF(python);
    Py_XDECREF(key_of);
    Py_XDECREF(failed);
    Py_XDECREF(result);
    Py_XDECREF(api_globals);
    Py_XDECREF(compiler_globals);
    Py_XDECREF(size_entry);
  }

  // Empties the table before releasing anything: a release may run Python code (a finaliser) that calls this
  // door again, and must find a consistent, empty table; `generation` tells a caller holding an entry it is gone.
  void clear_table() {
    decltype(table) old;
    old.swap(table);
    decltype(sized) old_sized;
    old_sized.swap(sized);
    last = nullptr;
    seen_once.clear();
    sized_seen.clear();
    n_entries = 0;
    ++generation;
    for (auto& bucket : old) {
      for (auto& e : bucket.second) e->release();
    }
    for (auto& entry : old_sized) entry.second->release();
  }

  // The binding of a call site (nargs positionals, these keyword names), worked out on its first call.
  const CallShape* call_shape(Py_ssize_t nargs, PyObject* kwnames) {
    for (const CallShape& c : shapes) {
      if (c.kwnames == kwnames && c.nargs == nargs) return &c;
    }
    return same_names_shape(nargs, kwnames);
  }

  // A call through ``**kwargs`` builds a new keyword-name tuple every time, of the same (interned) names.
  __attribute__((noinline)) const CallShape* same_names_shape(Py_ssize_t nargs, PyObject* kwnames) {
    if (kwnames != nullptr) {
      const Py_ssize_t nkw = PyTuple_GET_SIZE(kwnames);
      for (const CallShape& c : shapes) {
        if (c.nargs != nargs || c.kwnames == nullptr || PyTuple_GET_SIZE(c.kwnames) != nkw) continue;
        bool same = true;
        for (Py_ssize_t j = 0; j < nkw && same; ++j) {
          same = PyTuple_GET_ITEM(c.kwnames, j) == PyTuple_GET_ITEM(kwnames, j);
        }
        if (same) return &c;
      }
    }
    return new_call_shape(nargs, kwnames);
  }

  __attribute__((noinline, cold)) const CallShape* new_call_shape(Py_ssize_t nargs, PyObject* kwnames) {
    CallShape& c = shapes[next_shape];
    next_shape = (next_shape + 1) % kCallShapes;
    Py_XINCREF(kwnames);
    Py_XSETREF(c.kwnames, kwnames);
    c.nargs = nargs;
    c.binds = false;
    c.passed = 0;
    c.n_kw = 0;
    c.n_keyed = 0;
    c.optional_given = false;
    if (nargs > n_positional) return &c;
    for (Py_ssize_t i = 0; i < nargs; ++i) c.passed |= uint64_t{1} << i;
    const Py_ssize_t nkw = kwnames == nullptr ? 0 : PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t j = 0; j < nkw; ++j) {
      PyObject* kw = PyTuple_GET_ITEM(kwnames, j);
      Py_ssize_t index = -1;
      for (Py_ssize_t i = 0; i < n && index < 0; ++i) {
        if (names[i] == kw) index = i;
      }
      for (Py_ssize_t i = 0; i < n && index < 0; ++i) {
        const int equal = PyUnicode_Compare(names[i], kw);
        if (equal == -1 && PyErr_Occurred()) PyErr_Clear();
        if (equal == 0) index = i;
      }
      if (index < 0 || (c.passed >> index & 1) != 0) return &c;  // unknown or repeated: Python's TypeError
      c.passed |= uint64_t{1} << index;
      c.kw_slot[c.n_kw++] = index;
    }
    for (Py_ssize_t i = 0; i < n; ++i) {
      const bool given = (c.passed >> i & 1) != 0;
      if (!given && defaults[i] == nullptr) return &c;  // a required argument missing: Python's TypeError
      if (given || default_keyed[i]) c.keyed[c.n_keyed++] = i;
    }
    for (Py_ssize_t i : bound_optional) {
      c.optional_given = c.optional_given || (c.passed >> i & 1) != 0 || defaults[i] != Py_None;
    }
    c.binds = true;
    return &c;
  }

  // Arguments into `slots` (borrowed), defaults filled in, as `shape` binds them.
  void parse(PyObject* const* args, Py_ssize_t nargs, const CallShape& shape, PyObject** slots) const {
    std::memcpy(slots, defaults.data(), static_cast<size_t>(n) * sizeof(PyObject*));
    for (Py_ssize_t i = 0; i < nargs; ++i) slots[i] = args[i];
    for (Py_ssize_t j = 0; j < shape.n_kw; ++j) slots[shape.kw_slot[j]] = args[nargs + j];
  }

  // Key words are written through a local cursor (`w`, with room up to `end`) so that the compiler keeps it in a
  // register across a call's arguments; Key::n_words is set once, at the end.
  using Cursor = uint64_t*;

  // A tensor's words: its dim, sizes and dtype/device word, then (strided) the last dim's stride and (with_grad)
  // requires_grad, which also joins *requires_grad.
  __attribute__((always_inline)) static bool tensor_words(Cursor& w, const uint64_t* end, PyObject* obj,
                                                          bool strided, bool with_grad, bool* requires_grad) {
    c10::TensorImpl* impl = THPVariable_Unpack(obj).unsafeGetTensorImpl();
    c10::IntArrayRef sizes = impl->sizes();  // throws for tensors without sizes (nested): Python decides
    const size_t dim = sizes.size();
    if (dim + 4 > static_cast<size_t>(end - w)) return false;  // dim, sizes, meta, stride, grad
    *w++ = dim;
    for (size_t i = 0; i < dim; ++i) *w++ = static_cast<uint64_t>(sizes[i]);
    const c10::Device device = impl->device();
    *w++ = static_cast<uint64_t>(impl->dtype().toScalarType()) | (static_cast<uint64_t>(device.type()) << 16) |
           (static_cast<uint64_t>(static_cast<uint8_t>(device.index())) << 32);
    if (strided) {
      if (dim == 0) return false;  // stride(-1) of a 0-d tensor raises: Python's
      *w++ = static_cast<uint64_t>(impl->strides()[dim - 1]);
    }
    if (requires_grad != nullptr) {
      const bool rg = impl->requires_grad();
      *requires_grad = *requires_grad || rg;
      if (with_grad) *w++ = rg;
    }
    return true;
  }

  static bool is_tensor(PyObject* obj, bool exact_only) {
    PyTypeObject* type = Py_TYPE(obj);
    return type == reinterpret_cast<PyTypeObject*>(THPVariableClass) ||
           (!exact_only && type == reinterpret_cast<PyTypeObject*>(ParameterClass));
  }

  static bool int_word(Cursor& w, PyObject* obj) {
    int overflow = 0;
    long long value = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (overflow != 0 || (value == -1 && PyErr_Occurred())) return false;
    *w++ = static_cast<uint64_t>(value);
    return true;
  }

  // The key of a call, or false where the Python path must decide (what it would not key alike). A default the
  // caller left out keys as a constant, so the key omits it: the shape's `passed` word says which slots it read.
  bool make_key(PyObject** slots, const CallShape& shape, Key& key) const {
    bool any_grad = false;
    Cursor w = key.words;
    const uint64_t* end = key.words + kMaxWords;
    *w++ = shape.passed;
    for (Py_ssize_t j = 0; j < shape.n_keyed; ++j) {
      const Py_ssize_t i = shape.keyed[j];
      if (!slot_words(w, end, key, i, slots[i], any_grad)) return false;
    }
    if (w == end) return false;
    *w++ = any_grad && c10::GradMode::is_enabled();  // grad mode read only when it matters
    key.n_words = static_cast<size_t>(w - key.words);
    return context_words(key);
  }

  // The key of a call with every tensor's sizes reduced to its rank and last dim, and an optional tensor's (a mask)
  // to its rank and broadcast pattern (`size_generic_key`), its sizes into `sizes` by slot; false where no sized
  // entry may take it (an index tensor, an optional tensor of more than 63 dims).
  bool make_sized_key(PyObject** slots, const CallShape& shape, Key& key, c10::IntArrayRef* sizes) const {
    bool any_grad = false;
    Cursor w = key.words;
    const uint64_t* end = key.words + kMaxWords;
    *w++ = shape.passed;
    for (Py_ssize_t j = 0; j < shape.n_keyed; ++j) {
      const Py_ssize_t i = shape.keyed[j];
      const SlotSpec spec = specs[i];
      PyObject* v = slots[i];
      if (spec.kind == kTensor || spec.kind == kStrided) {
        if (!is_tensor(v, spec.exact) || end - w < 5) return false;
        c10::TensorImpl* impl = THPVariable_Unpack(v).unsafeGetTensorImpl();
        c10::IntArrayRef dims = impl->sizes();
        const size_t dim = dims.size();
        if (dim == 0) return false;
        sizes[i] = dims;
        *w++ = dim;
        *w++ = static_cast<uint64_t>(dims[dim - 1]);
        const c10::Device device = impl->device();
        *w++ = static_cast<uint64_t>(impl->dtype().toScalarType()) |
               (static_cast<uint64_t>(device.type()) << 16) |
               (static_cast<uint64_t>(static_cast<uint8_t>(device.index())) << 32);
        if (spec.kind == kStrided) *w++ = static_cast<uint64_t>(impl->strides()[dim - 1]);
        if (spec.grad) any_grad = any_grad || impl->requires_grad();
        continue;
      }
      if (spec.kind == kOptTensor && v != Py_None) {
        // As the exact key's words (`value_words_into`), with the sizes as one word of broadcast bits (size 1)
        // after the rank: the sizes themselves are the entry's constraints to check.
        if (!is_tensor(v, spec.exact) || end - w < 5) return false;
        c10::TensorImpl* impl = THPVariable_Unpack(v).unsafeGetTensorImpl();
        c10::IntArrayRef dims = impl->sizes();
        const size_t dim = dims.size();
        if (dim > 63) return false;
        uint64_t ones = 0;
        for (size_t b = 0; b < dim; ++b) ones |= static_cast<uint64_t>(dims[b] == 1) << b;
        sizes[i] = dims;
        *w++ = 7;
        *w++ = dim;
        *w++ = ones;
        const c10::Device device = impl->device();
        *w++ = static_cast<uint64_t>(impl->dtype().toScalarType()) |
               (static_cast<uint64_t>(device.type()) << 16) |
               (static_cast<uint64_t>(static_cast<uint8_t>(device.index())) << 32);
        const bool rg = impl->requires_grad();
        *w++ = rg;
        any_grad = any_grad || (spec.grad && rg);
        continue;
      }
      if (spec.kind == kIndex && v != Py_None && !PyLong_CheckExact(v)) return false;
      if (!value_words_into(w, end, key, i, v, any_grad)) return false;
    }
    if (w == end) return false;
    *w++ = any_grad && c10::GradMode::is_enabled();
    key.n_words = static_cast<size_t>(w - key.words);
    return context_words(key);
  }

  // Whether `sizes` meet the entry's constraints (what _native_size_entry says they are).
  bool inside(const SizedEntry& s, const c10::IntArrayRef* sizes) const {
    const std::vector<int64_t>& c = s.constraints;
    auto at = [&](int64_t slot, int64_t dim, int64_t& out) {
      if (slot < 0 || slot >= n || dim < 0 || static_cast<size_t>(dim) >= sizes[slot].size()) return false;
      out = sizes[slot][static_cast<size_t>(dim)];
      return true;
    };
    for (size_t i = 0; i + 6 <= c.size(); i += 6) {
      int64_t x = 0, y = 0;
      if (!at(c[i + 1], c[i + 2], x)) return false;
      switch (c[i]) {
        case 0:
          if (x < c[i + 3] || (c[i + 4] >= 0 && x >= c[i + 4])) return false;
          break;
        case 1:
          if (!at(c[i + 3], c[i + 4], y) || x != y) return false;
          break;
        case 2:
          if (!at(c[i + 3], c[i + 4], y) || x != c[i + 5] * y) return false;
          break;
        default:
          return false;
      }
    }
    return true;
  }

  SizedEntry* find_sized(const Key& key, uint64_t h) {
    auto it = sized.find(h);
    return it != sized.end() && it->second->matches(key) ? it->second.get() : nullptr;
  }

  // After the Python path ran a call: what the size_entry hook says, kept under the call's reduced key. Errors
  // from the hook keep nothing (the next miss asks again).
  void refresh_sized(const Key& key, uint64_t h, PyObject** slots) {
    PyObject* manager = manager_of(this);
    if (manager == nullptr) return;
    PyObject* got = PyObject_Vectorcall(size_entry, slots, n, nullptr);
    if (got == nullptr) {
      PyErr_Clear();
      return;
    }
    auto entry = std::make_unique<SizedEntry>();
    if (fill_sized(*entry, got, manager)) {
      entry->adopt(key);
      if (sized.size() >= kMaxEntries) clear_table();
      std::unique_ptr<SizedEntry> old;
      auto it = sized.find(h);
      if (it != sized.end()) old.swap(it->second);
      sized[h] = std::move(entry);
      if (old) old->release();  // last: releasing may run Python code
    } else {
      entry->release();
      if (PyErr_Occurred()) PyErr_Clear();
    }
    Py_DECREF(got);
  }

  // (fn, constraints, head_dim_v, dtype, watched dicts, capturing) into `s`; false for None or anything else.
  bool fill_sized(SizedEntry& s, PyObject* got, PyObject* manager) const {
    if (!PyTuple_CheckExact(got) || PyTuple_GET_SIZE(got) != 6) return false;
    PyObject* fn = PyTuple_GET_ITEM(got, 0);
    PyObject* constraints = PyTuple_GET_ITEM(got, 1);
    PyObject* watched = PyTuple_GET_ITEM(got, 4);
    PyObject* capturing = PyTuple_GET_ITEM(got, 5);
    if (!PyTuple_CheckExact(constraints) || PyTuple_GET_SIZE(constraints) % 6 != 0 || !PyTuple_CheckExact(watched))
      return false;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(watched); ++i) {
      PyObject* dict = PyTuple_GET_ITEM(watched, i);
      if (!PyDict_CheckExact(dict)) return false;
      Py_INCREF(dict);
      s.watched.emplace_back(dict, dict_version(dict));
    }
    Py_INCREF(manager);
    s.manager = manager;
    if (fn == Py_None) return true;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(constraints); ++i) {
      const long long c = PyLong_AsLongLong(PyTuple_GET_ITEM(constraints, i));
      if (c == -1 && PyErr_Occurred()) return false;
      s.constraints.push_back(c);
    }
    const long long head_dim_v = PyLong_AsLongLong(PyTuple_GET_ITEM(got, 2));
    if (head_dim_v == -1 && PyErr_Occurred()) return false;
    PyObject* dtype = PyTuple_GET_ITEM(got, 3);
    if (!THPDtype_Check(dtype)) return false;
    s.head_dim_v = head_dim_v;
    s.scalar_type = static_cast<int>(reinterpret_cast<THPDtype*>(dtype)->scalar_type);
    if (capturing != Py_None) {
      Py_INCREF(capturing);
      s.capturing = capturing;
    }
    Py_INCREF(fn);
    s.fn = fn;
    return true;
  }

  // Whether a default keys as a constant (the same words every call, whatever state tensors are in).
  bool default_is_constant(Py_ssize_t i) const {
    if (defaults[i] == nullptr) return true;  // required: always given
    if (is_tensor(defaults[i], false)) return false;
    Key key;
    Cursor w = key.words;
    bool any_grad = false;
    bool keyed;
    try {
      keyed = slot_words(w, key.words + kMaxWords, key, i, defaults[i], any_grad);
    } catch (...) {
      keyed = false;
    }
    if (PyErr_Occurred()) PyErr_Clear();
    return keyed;
  }

  // One argument's words (slot i holding v); str values also go to key.equal. The required tensors inline, the
  // rest out of line (a compact hot path stays in fewer cache lines).
  __attribute__((always_inline)) bool slot_words(Cursor& w, const uint64_t* end, Key& key, Py_ssize_t i,
                                                 PyObject* v, bool& any_grad) const {
    const SlotSpec spec = specs[i];
    if (spec.kind == kTensor || spec.kind == kStrided) {
      return is_tensor(v, spec.exact) &&
             tensor_words(w, end, v, spec.kind == kStrided, false, spec.grad ? &any_grad : nullptr);
    }
    Cursor next = value_words(w, end, key, i, v, any_grad);
    if (next == nullptr) return false;
    w = next;
    return true;
  }

  // The cursor after the words of a non-tensor kind, or nullptr (by value: a cursor passed by reference to a call
  // would live in memory through the whole key).
  __attribute__((noinline)) Cursor value_words(Cursor w, const uint64_t* end, Key& key, Py_ssize_t i, PyObject* v,
                                               bool& any_grad) const {
    return value_words_into(w, end, key, i, v, any_grad) ? w : nullptr;
  }

  bool value_words_into(Cursor& w, const uint64_t* end, Key& key, Py_ssize_t i, PyObject* v, bool& any_grad) const {
    const SlotSpec spec = specs[i];
    if (end - w < 3) return false;  // these kinds write 3 words at most (tensors and tuples check their own)
    switch (spec.kind) {
      case kOptTensor: {
        if (v == Py_None) {
          *w++ = 0;
          return true;
        }
        if (!is_tensor(v, spec.exact)) return false;
        *w++ = 7;
        bool rg = false;
        if (!tensor_words(w, end, v, false, true, &rg)) return false;
        any_grad = any_grad || (spec.grad && rg);
        return true;
      }
      case kIndex:
        if (v == Py_None) {
          *w++ = 0;
          return true;
        }
        if (PyLong_CheckExact(v)) {
          *w++ = 2;
          return int_word(w, v);
        }
        if (!is_tensor(v, false)) return false;
        if (THPVariable_Unpack(v).unsafeGetTensorImpl()->device().is_cpu()) return false;  // values read
        *w++ = 6;
        return tensor_words(w, end, v, false, false, nullptr);
      case kValue:
      case kStr: {
        if (v == Py_None) {
          *w++ = 0;
          return true;
        }
        if (PyUnicode_CheckExact(v)) {
          Py_hash_t h = reinterpret_cast<PyASCIIObject*>(v)->hash;  // cached after the first hash
          if (h == -1) h = PyObject_Hash(v);
          if (h == -1 || key.n_equal == kMaxObjects) return false;
          *w++ = 4;
          *w++ = static_cast<uint64_t>(h);
          key.equal[key.n_equal++] = v;
          return true;
        }
        if (spec.kind == kStr) return false;
        if (v == Py_True || v == Py_False) {
          *w++ = 1;
          *w++ = v == Py_True;
          return true;
        }
        if (PyLong_CheckExact(v)) {
          *w++ = 2;
          return int_word(w, v);
        }
        if (!PyFloat_CheckExact(v)) return false;
        const double d = PyFloat_AS_DOUBLE(v);
        if (std::isnan(d)) return false;  // NaN != NaN: the Python key never matches it
        uint64_t bits;
        std::memcpy(&bits, &d, sizeof bits);
        *w++ = 3;
        *w++ = bits;
        return true;
      }
      case kIntTuple: {
        if (v == Py_None) {
          *w++ = 0;
          return true;
        }
        if (!PyTuple_CheckExact(v)) return false;
        const Py_ssize_t len = PyTuple_GET_SIZE(v);
        if (len + 2 > end - w) return false;
        *w++ = 5;
        *w++ = static_cast<uint64_t>(len);
        for (Py_ssize_t j = 0; j < len; ++j) {
          PyObject* item = PyTuple_GET_ITEM(v, j);
          if (!PyLong_CheckExact(item) || !int_word(w, item)) return false;
        }
        return true;
      }
      case kBypass:
        return v == Py_None;
      case kZero:
        if (PyLong_CheckExact(v)) {
          int overflow = 0;
          if (PyLong_AsLongLongAndOverflow(v, &overflow) != 0 || overflow != 0) return false;
          *w++ = 8;
          *w++ = 0;
          return true;
        }
        if (!PyFloat_CheckExact(v) || PyFloat_AS_DOUBLE(v) != 0.0) return false;
        *w++ = 8;
        *w++ = 1;
        return true;
      default:
        return false;
    }
  }

  // The context's words: torch's determinism flag, ContextVars' values, callables' results (by identity); the
  // "autocast" marker keys nothing and hands the call to Python while autocast is on for any device type.
  bool context_words(Key& key) const {
    for (PyObject* c : context) {
      PyObject* value = nullptr;
      if (c == Py_None) {  // torch's determinism flag, read where torch keeps it (a Python call costs ~0.1 µs)
        if (!key.push(10 + at::globalContext().deterministicAlgorithms())) return false;
        continue;
      }
      if (PyUnicode_CheckExact(c)) {  // "autocast": while torch.autocast is on, the Python door casts as torch does
        // Every device type torch's autocast serves that opdispatch may meet (each is one thread-local read).
        for (c10::DeviceType type : {at::kCPU, at::kCUDA, at::kXPU, at::kHPU, at::kMPS, at::kPrivateUse1}) {
          if (at::autocast::is_autocast_enabled(type)) return false;
        }
        continue;
      }
      if (PyContextVar_CheckExact(c)) {
        if (PyContextVar_Get(c, nullptr, &value) < 0) return false;
        if (value == nullptr) return false;  // no value, no default: Python raises
      } else {
        value = PyObject_CallNoArgs(c);
        if (value == nullptr) return false;
      }
      if (key.n_held == kMaxObjects) {
        Py_DECREF(value);
        return false;
      }
      key.held[key.n_held++] = value;
      if (!key.push(reinterpret_cast<uintptr_t>(value))) return false;
    }
    return true;
  }

  Entry* find(const Key& key, uint64_t h) {
    auto it = table.find(h);
    if (it == table.end()) return nullptr;
    for (auto& e : it->second) {
      if (e->matches(key)) return e.get();
    }
    return nullptr;
  }

  void remember(const Key& key, uint64_t h, PyObject* manager, PyObject* fast, PyObject* pykey, PyObject* fn) {
    Entry* e = find(key, h);
    if (e == nullptr) {
      if (n_entries >= kMaxEntries) clear_table();
      std::vector<std::unique_ptr<Entry>>& bucket = table[h];
      bucket.push_back(std::make_unique<Entry>());
      e = bucket.back().get();
      e->adopt(key);
      ++n_entries;
    }
    // The old references go last: releasing them may run Python code that clears this table.
    PyObject* old[4] = {e->manager, e->fast, e->pykey, e->fn};
    Py_INCREF(manager);
    Py_INCREF(fast);
    Py_INCREF(pykey);
    Py_INCREF(fn);
    e->manager = manager;
    e->fast = fast;
    e->fast_version = dict_version(fast);
    e->pykey = pykey;
    e->fn = fn;
    last = e;
    for (PyObject* o : old) Py_XDECREF(o);
  }
};

struct DoorObject {
  PyObject_HEAD
  Door* door;
};

struct FlagObject {
  PyObject_HEAD
  int slot;
};

// A bound kernel as one C call: kernel(*tensors, *tail, **kwargs), then its result's item `index` (-1: the
// result itself). What `opdispatch.base._native.kernel_call` makes for an implementation's `bind`, so that neither the
// compiled front door nor plan() enters a Python frame between the caller and the aten op.
struct KernelCallObject {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  PyObject* kernel;    // strong
  PyObject* tail;      // strong: a tuple of positional arguments after the tensors
  PyObject* kwnames;   // strong: a tuple of keyword names, or nullptr
  PyObject* kwvalues;  // strong: their values (a tuple), or nullptr
  Py_ssize_t index;
  PyObject* dict;      // attributes (the manager sets `decision`)
};

PyTypeObject DoorType = {PyVarObject_HEAD_INIT(nullptr, 0)};
PyTypeObject FlagType = {PyVarObject_HEAD_INIT(nullptr, 0)};
PyTypeObject KernelCallType = {PyVarObject_HEAD_INIT(nullptr, 0)};

constexpr Py_ssize_t kMaxKernelArgs = 32;

// kc's kernel on the arguments in stack[0:nargs], which has room for kMaxKernelArgs: the tail and the keyword
// values are written after them.
PyObject* kernel_call_invoke(KernelCallObject* kc, PyObject** stack, Py_ssize_t nargs) {
  const Py_ssize_t ntail = PyTuple_GET_SIZE(kc->tail);
  const Py_ssize_t nkw = kc->kwnames == nullptr ? 0 : PyTuple_GET_SIZE(kc->kwnames);
  if (nargs + ntail + nkw > kMaxKernelArgs) {
    PyErr_Format(PyExc_TypeError, "a bound kernel takes at most %zd arguments in all", kMaxKernelArgs);
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < ntail; ++i) stack[nargs + i] = PyTuple_GET_ITEM(kc->tail, i);
  for (Py_ssize_t i = 0; i < nkw; ++i) stack[nargs + ntail + i] = PyTuple_GET_ITEM(kc->kwvalues, i);
  PyObject* out = PyObject_Vectorcall(kc->kernel, stack, nargs + ntail, kc->kwnames);
  if (out == nullptr || kc->index < 0) return out;
  PyObject* item;
  if (PyTuple_Check(out)) {
    if (kc->index >= PyTuple_GET_SIZE(out)) {
      Py_DECREF(out);
      PyErr_Format(PyExc_IndexError, "the kernel returned %zd results; the bound kernel takes item %zd",
                   PyTuple_GET_SIZE(out), kc->index);
      return nullptr;
    }
    item = PyTuple_GET_ITEM(out, kc->index);
    Py_INCREF(item);
  } else {
    item = PySequence_GetItem(out, kc->index);
  }
  Py_DECREF(out);
  return item;
}

PyObject* kernel_call_vectorcall(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  auto* kc = reinterpret_cast<KernelCallObject*>(self);
  const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  if (kwnames != nullptr && PyTuple_GET_SIZE(kwnames) != 0) {
    PyErr_SetString(PyExc_TypeError, "a bound kernel takes its tensors positionally");
    return nullptr;
  }
  if (nargs > kMaxKernelArgs) {
    PyErr_Format(PyExc_TypeError, "a bound kernel takes at most %zd arguments in all", kMaxKernelArgs);
    return nullptr;
  }
  PyObject* stack[kMaxKernelArgs];
  for (Py_ssize_t i = 0; i < nargs; ++i) stack[i] = args[i];
  return kernel_call_invoke(kc, stack, nargs);
}

int kernel_call_traverse(PyObject* self, visitproc visit, void* arg) {
  auto* kc = reinterpret_cast<KernelCallObject*>(self);
  Py_VISIT(kc->kernel);
  Py_VISIT(kc->tail);
  Py_VISIT(kc->kwvalues);
  Py_VISIT(kc->dict);
  return 0;
}

int kernel_call_clear(PyObject* self) {
  auto* kc = reinterpret_cast<KernelCallObject*>(self);
  Py_CLEAR(kc->kernel);
  Py_CLEAR(kc->tail);
  Py_CLEAR(kc->kwnames);
  Py_CLEAR(kc->kwvalues);
  Py_CLEAR(kc->dict);
  return 0;
}

void kernel_call_dealloc(PyObject* self) {
  PyObject_GC_UnTrack(self);
  kernel_call_clear(self);
  Py_TYPE(self)->tp_free(self);
}

PyObject* kernel_call_repr(PyObject* self) {
  auto* kc = reinterpret_cast<KernelCallObject*>(self);
  return PyUnicode_FromFormat("<opdispatch kernel call %R(*tensors, *%R, **%R values %R)[%zd]>", kc->kernel, kc->tail,
                              kc->kwnames == nullptr ? Py_None : kc->kwnames,
                              kc->kwvalues == nullptr ? Py_None : kc->kwvalues, kc->index);
}

PyGetSetDef kernel_call_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, nullptr, nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyObject* make_kernel_call(PyObject*, PyObject* args, PyObject* kwargs) {
  static const char* keywords[] = {"kernel", "tail", "kwnames", "kwvalues", "index", nullptr};
  PyObject *kernel, *tail, *kwnames, *kwvalues;
  Py_ssize_t index;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO!O!O!n:kernel_call", const_cast<char**>(keywords), &kernel,
                                   &PyTuple_Type, &tail, &PyTuple_Type, &kwnames, &PyTuple_Type, &kwvalues, &index))
    return nullptr;
  if (!PyCallable_Check(kernel)) return PyErr_Format(PyExc_TypeError, "kernel_call: %R is not callable", kernel);
  if (PyTuple_GET_SIZE(kwnames) != PyTuple_GET_SIZE(kwvalues))
    return PyErr_Format(PyExc_ValueError, "kernel_call: %zd keyword names for %zd values", PyTuple_GET_SIZE(kwnames),
                        PyTuple_GET_SIZE(kwvalues));
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(kwnames); ++i) {
    if (!PyUnicode_CheckExact(PyTuple_GET_ITEM(kwnames, i)))
      return PyErr_Format(PyExc_TypeError, "kernel_call: keyword names must be str");
  }
  auto* kc = PyObject_GC_New(KernelCallObject, &KernelCallType);
  if (kc == nullptr) return nullptr;
  kc->vectorcall = kernel_call_vectorcall;
  Py_INCREF(kernel);
  Py_INCREF(tail);
  kc->kernel = kernel;
  kc->tail = tail;
  if (PyTuple_GET_SIZE(kwnames) == 0) {
    kc->kwnames = nullptr;
    kc->kwvalues = nullptr;
  } else {
    Py_INCREF(kwnames);
    Py_INCREF(kwvalues);
    kc->kwnames = kwnames;
    kc->kwvalues = kwvalues;
  }
  kc->index = index;
  kc->dict = nullptr;
  PyObject_GC_Track(reinterpret_cast<PyObject*>(kc));
  return reinterpret_cast<PyObject*>(kc);
}

// -- the call ---------------------------------------------------------------------------------------------------

PyObject* manager_of(Door* d) {
  PyObject* manager = PyDict_GetItemWithError(d->api_globals, s_manager);  // borrowed
  if (manager == nullptr || manager == Py_None) {
    PyErr_Clear();
    return nullptr;
  }
  return manager;
}

// torch.compiler.is_compiling() as the Python front door asks it: torch.compiler's `_is_compiling_flag`, read again
// only when that module's globals changed (their version tag; a lookup per call costs as much as the key's fields).
bool compiling(Door* d) {
  const uint64_t version = dict_version(d->compiler_globals);
  if (version != d->compiler_version || version == 0) {
    PyObject* flag = PyDict_GetItemWithError(d->compiler_globals, s_compiling);  // borrowed
    if (flag == nullptr) PyErr_Clear();
    d->compiling = flag != nullptr && flag != Py_False;
    d->compiler_version = version;
  }
  return d->compiling;
}

// What is not a hit stays out of the hot path's cache lines (a kernel evicts them between calls): cold, not inlined.
#define OPDISPATCH_COLD __attribute__((noinline, cold))

OPDISPATCH_COLD PyObject* pass_to_python(Door* d, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  ++d->passes;
  return PyObject_Vectorcall(d->python, args, nargs, kwnames);
}

// A miss: the Python front door runs the call (and remembers its bound function); then the entry is read back
// from the manager's dict under the key the Python path used — from a signature's second call on (`known`: an
// entry exists, or the key was seen once): reading the key back costs a Python call, which a signature seen once
// (a decode loop over a growing cache: a new shape every step) would pay for nothing.
OPDISPATCH_COLD PyObject* miss(Door* d, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames, PyObject** slots,
               const Key& key, uint64_t h, bool known) {
  ++d->misses;
  PyObject* out = PyObject_Vectorcall(d->python, args, nargs, kwnames);
  if (out == nullptr) return nullptr;
  if (!known && d->seen_once.insert(h).second) {
    if (d->seen_once.size() > kMaxEntries) d->seen_once.clear();
    return out;
  }
  PyObject* manager = manager_of(d);
  if (manager == nullptr) return out;
  PyObject* pykey = PyObject_Vectorcall(d->key_of, slots, d->n, nullptr);
  if (pykey == nullptr) {
    PyErr_Clear();
    return out;
  }
  if (pykey != Py_None) {
    PyObject* fast = PyObject_GetAttr(manager, s_fast);
    if (fast == nullptr) {
      PyErr_Clear();
    } else {
      if (PyDict_CheckExact(fast)) {
        PyObject* fn = PyDict_GetItemWithError(fast, pykey);  // borrowed
        if (fn != nullptr) {
          d->remember(key, h, manager, fast, pykey, fn);
        } else {
          PyErr_Clear();
        }
      }
      Py_DECREF(fast);
    }
  }
  Py_DECREF(pykey);
  return out;
}

// As the Python path's `except Exception as exc: return failed(manager, key, fn, exc, *arguments)`.
OPDISPATCH_COLD PyObject* kernel_failed(Door* d, PyObject* manager, PyObject* pykey, PyObject* fn, PyObject** slots) {
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  PyErr_NormalizeException(&type, &value, &traceback);
  if (traceback != nullptr) PyException_SetTraceback(value, traceback);
  PyObject* previous = PyErr_GetHandledException();
  PyErr_SetHandledException(value);
  PyObject* failed_args[4 + kMaxArgs] = {manager, pykey, fn, value};
  for (Py_ssize_t i = 0; i < d->n; ++i) failed_args[4 + i] = slots[i];
  PyObject* out = PyObject_Vectorcall(d->failed, failed_args, 4 + d->n, nullptr);
  PyErr_SetHandledException(previous);
  Py_XDECREF(previous);
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(traceback);
  return out;
}

// `out` reshaped by the door's result function when its result argument is true (return_attn_probs).
OPDISPATCH_COLD PyObject* shaped_result(Door* d, PyObject* out, PyObject** slots) {
  int wanted = PyObject_IsTrue(slots[d->result_arg]);
  if (wanted < 0) {
    Py_DECREF(out);
    return nullptr;
  }
  if (!wanted) return out;
  PyObject* shaped = PyObject_CallFunctionObjArgs(d->result, out, slots[d->result_arg], nullptr);
  Py_DECREF(out);
  return shaped;
}

__attribute__((always_inline)) inline PyObject* hit(Door* d, Entry* e, PyObject* manager, PyObject** slots,
                                                    bool optional_given) {
  ++d->hits;
  PyObject* fn = e->fn;
  PyObject* pykey = e->pykey;
  Py_INCREF(fn);  // the entry may be refilled while the kernel runs (a re-entrant call)
  Py_INCREF(pykey);
  Py_INCREF(manager);
  PyObject* call[kMaxArgs + kMaxKernelArgs];  // room for a kernel call's tail
  Py_ssize_t count = 0;
  for (Py_ssize_t i : d->bound) call[count++] = slots[i];
  bool optional = false;
  if (optional_given) {
    for (Py_ssize_t i : d->bound_optional) optional = optional || slots[i] != Py_None;
  }
  if (optional) {
    for (Py_ssize_t i : d->bound_optional) call[count++] = slots[i];
  }
  if (d->flag >= 0) tls_flags[d->flag] = 1;
  // A kernel call (what the built-in implementations bind) is made here: one C call less between door and kernel.
  PyObject* out = Py_TYPE(fn) == &KernelCallType && count <= kMaxKernelArgs
                      ? kernel_call_invoke(reinterpret_cast<KernelCallObject*>(fn), call, count)
                      : PyObject_Vectorcall(fn, call, count, nullptr);
  if (__builtin_expect(out == nullptr, 0) && PyErr_ExceptionMatches(PyExc_Exception)) {
    out = kernel_failed(d, manager, pykey, fn, slots);
  }
  if (d->flag >= 0) tls_flags[d->flag] = 0;
  Py_DECREF(fn);
  Py_DECREF(pykey);
  Py_DECREF(manager);
  if (out != nullptr && d->result != nullptr && slots[d->result_arg] != Py_False) out = shaped_result(d, out, slots);
  return out;
}

// A call that the size-generic entry `s` (current, with a function, its constraints met) takes: capture checked,
// its function run — with the optional tensors after q, k, v where one is given (a mask), as `hit` passes them —
// and its output checked as `_sized_reuse` does. `kPass` where the Python path must run the call instead (capture
// under way, an Exception raised, an output not as the call's), nullptr for any other exception.
PyObject kPassObject;
PyObject* const kPass = &kPassObject;  // a sentinel address, never a Python object handed out

OPDISPATCH_COLD PyObject* sized_call(Door* d, SizedEntry* s, PyObject** slots, const c10::IntArrayRef* sizes) {
  if (s->capturing != nullptr) {
    PyObject* capturing = PyObject_CallNoArgs(s->capturing);
    const int yes = capturing == nullptr ? -1 : PyObject_IsTrue(capturing);
    Py_XDECREF(capturing);
    if (yes != 0) {
      PyErr_Clear();
      return kPass;
    }
  }
  PyObject* fn = s->fn;
  const int64_t head_dim_v = s->head_dim_v;
  const int scalar_type = s->scalar_type;
  PyObject* call[kMaxArgs + kMaxKernelArgs];
  Py_ssize_t count = 0;
  for (Py_ssize_t i : d->bound) call[count++] = slots[i];
  bool optional = false;
  for (Py_ssize_t i : d->bound_optional) optional = optional || slots[i] != Py_None;
  if (optional) {
    for (Py_ssize_t i : d->bound_optional) call[count++] = slots[i];
  }
  Py_INCREF(fn);  // the entry may go while the kernel runs (a re-entrant call)
  PyObject* out = Py_TYPE(fn) == &KernelCallType && count <= kMaxKernelArgs
                      ? kernel_call_invoke(reinterpret_cast<KernelCallObject*>(fn), call, count)
                      : PyObject_Vectorcall(fn, call, count, nullptr);
  Py_DECREF(fn);
  if (out == nullptr) {
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return nullptr;
    PyErr_Clear();  // what a failure means is the Python path's to say: it runs the call again
    return kPass;
  }
  const c10::IntArrayRef q = sizes[d->bound[0]];
  bool fine = Door::is_tensor(out, true);
  if (fine) {
    c10::TensorImpl* impl = THPVariable_Unpack(out).unsafeGetTensorImpl();
    c10::IntArrayRef got = impl->sizes();
    fine = got.size() == q.size() && got[got.size() - 1] == head_dim_v &&
           std::equal(got.begin(), got.end() - 1, q.begin()) &&
           static_cast<int>(impl->dtype().toScalarType()) == scalar_type &&
           impl->device() == THPVariable_Unpack(slots[d->bound[0]]).unsafeGetTensorImpl()->device();
  }
  if (!fine) {
    Py_DECREF(out);
    return kPass;
  }
  ++d->sized_hits;
  return out;
}

// A miss of the exact key at a door with sized entries: the entry of the call's reduced key takes it where it is
// current and its constraints hold; else the Python path runs it (and a missing or outdated entry is made again).
OPDISPATCH_COLD PyObject* sized_or_miss(Door* d, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames,
                                        PyObject** slots, const CallShape* shape, const Key& key, uint64_t h,
                                        bool known) {
  Key reduced;
  c10::IntArrayRef sizes[kMaxArgs];
  bool keyed;
  try {
    keyed = d->make_sized_key(slots, *shape, reduced, sizes);
  } catch (...) {
    keyed = false;
  }
  if (!keyed) {
    if (PyErr_Occurred()) PyErr_Clear();
    return miss(d, args, nargs, kwnames, slots, key, h, known);
  }
  // A signature the Python path ran once goes there again at its second call, which reads its exact entry back
  // (`miss`, a Python hit): a repeated signature ends on an exact hit. One that came through sized entries has no
  // entry in Python's cache — there its second call would run the whole Python path, a serving step's budget (a
  // padded decode revisiting its lengths paid 1.76x torch's SDPA on the H100, h100-ee86431) — so it goes to
  // Python only once it keeps coming back (kSizedCallsBeforeExact sized calls: a training loop's one shape), and
  // a server's revisited lengths stay sized instead of filling the exact table.
  if (d->seen_once.count(h) != 0) return miss(d, args, nargs, kwnames, slots, key, h, known);
  auto seen = d->sized_seen.find(h);
  if (seen != d->sized_seen.end() && seen->second >= kSizedCallsBeforeExact) {
    d->sized_seen.erase(seen);
    d->seen_once.insert(h);  // so `miss` reads the entry back
    return miss(d, args, nargs, kwnames, slots, key, h, known);
  }
  const uint64_t rh = reduced.hash();
  SizedEntry* s = d->find_sized(reduced, rh);
  if (s != nullptr && s->fn != nullptr && s->current(manager_of(d)) && d->inside(*s, sizes)) {
    PyObject* out = sized_call(d, s, slots, sizes);
    if (out != kPass) {
      if (out != nullptr) {
        ++d->sized_seen[h];
        if (d->sized_seen.size() > kMaxEntries) d->sized_seen.clear();
      }
      return out;
    }
  }
  PyObject* out = miss(d, args, nargs, kwnames, slots, key, h, known);
  // The hook is asked only where the entry is missing or outdated once the Python path ran (it may have just
  // made the template, or changed a watched dict): an entry of "nothing" (fn nullptr) that stays current — a
  // class without a size box, a function bound per call — costs each new length no Python call.
  if (out != nullptr) {
    s = d->find_sized(reduced, rh);  // again: the Python path may have cleared the table
    if (s == nullptr || !s->current(manager_of(d))) d->refresh_sized(reduced, rh, slots);
  }
  return out;
}

// An entry whose dict changed since it was read (another signature, another front door, a demotion), or none.
// The entry stands if the Python path would still find this very function under its key — one dict lookup, not a
// Python call. Hashing the key may run Python code (and let another thread clear the table): hold what is read,
// check the generation.
OPDISPATCH_COLD PyObject* stale_or_miss(Door* d, Entry* e, PyObject* const* args, Py_ssize_t nargs,
                                        PyObject* kwnames, PyObject** slots, const CallShape* shape,
                                        const Key& key, uint64_t h, bool optional_given) {
  if (e != nullptr) {
    const uint64_t generation = d->generation;
    PyObject *fast = e->fast, *pykey = e->pykey, *fn = e->fn;
    Py_INCREF(fast);
    Py_INCREF(pykey);
    Py_INCREF(fn);
    PyObject* now = PyDict_GetItemWithError(fast, pykey);  // borrowed
    if (now == nullptr) PyErr_Clear();
    const bool current = now == fn && d->generation == generation;
    if (current) {
      e->fast_version = dict_version(fast);
      ++d->revalidated;
    } else if (d->generation != generation) {
      e = nullptr;  // gone with the table
    }
    Py_DECREF(fast);
    Py_DECREF(pykey);
    Py_DECREF(fn);
    if (current) {
      d->last = e;
      return hit(d, e, e->manager, slots, optional_given);
    }
  }
  if (h == 0) h = key.hash();
  if (d->size_entry != nullptr && d->result == nullptr && d->flag < 0 && e == nullptr) {
    return sized_or_miss(d, args, nargs, kwnames, slots, shape, key, h, false);
  }
  return miss(d, args, nargs, kwnames, slots, key, h, e != nullptr);
}

PyObject* door_call(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  Door* d = reinterpret_cast<DoorObject*>(self)->door;
  PyObject* slots[kMaxArgs];
  nargs = PyVectorcall_NARGS(nargs);
  const CallShape* shape = d->call_shape(nargs, kwnames);
  if (!shape->binds) return pass_to_python(d, args, nargs, kwnames);
  if (compiling(d)) return pass_to_python(d, args, nargs, kwnames);
  if (d->flag >= 0 && tls_flags[d->flag] != 0) return pass_to_python(d, args, nargs, kwnames);
  d->parse(args, nargs, *shape, slots);
  // Read now: a context callable may call this door again and reuse the shape's cache slot.
  const bool optional_given = shape->optional_given;
  Key key;
  bool keyed;
  try {
    keyed = d->make_key(slots, *shape, key);
  } catch (...) {  // a c10::Error from a tensor without sizes or strides: the Python path decides
    keyed = false;
  }
  if (!keyed) {
    if (PyErr_Occurred()) PyErr_Clear();
    return pass_to_python(d, args, nargs, kwnames);
  }
  // A loop of one signature: the last entry, compared without hashing the key.
  uint64_t h = 0;
  Entry* e = d->last;
  if (e == nullptr || !e->matches(key)) {
    h = key.hash();
    e = d->find(key, h);
  }
  // The entry's dict is the manager's own until it swaps it (a policy change) or is replaced: both forget every
  // table (opdispatch.base._native.forget). Unchanged, it holds the same function under the entry's key.
  if (e != nullptr && __builtin_expect(dict_version(e->fast) == e->fast_version, 1)) {
    d->last = e;
    return hit(d, e, e->manager, slots, optional_given);
  }
  return stale_or_miss(d, e, args, nargs, kwnames, slots, shape, key, h, optional_given);
}

// -- the door's state object --------------------------------------------------------------------------------------

void door_dealloc(PyObject* self) {
  PyObject_GC_UnTrack(self);
  delete reinterpret_cast<DoorObject*>(self)->door;
  reinterpret_cast<DoorObject*>(self)->door = nullptr;
  Py_TYPE(self)->tp_free(self);
}

int door_traverse(PyObject* self, visitproc visit, void* arg) {
  Door* d = reinterpret_cast<DoorObject*>(self)->door;
  if (d == nullptr) return 0;
  for (PyObject* o : d->defaults) Py_VISIT(o);
  for (PyObject* o : d->context) Py_VISIT(o);
  Py_VISIT(d->python);
  Py_VISIT(d->key_of);
  Py_VISIT(d->failed);
  Py_VISIT(d->result);
  Py_VISIT(d->api_globals);
  Py_VISIT(d->compiler_globals);
  for (auto& bucket : d->table) {
    for (auto& e : bucket.second) {
      for (PyObject* o : e->held) Py_VISIT(o);
      Py_VISIT(e->manager);
      Py_VISIT(e->fast);
      Py_VISIT(e->pykey);
      Py_VISIT(e->fn);
    }
  }
  Py_VISIT(d->size_entry);
  for (auto& entry : d->sized) {
    SizedEntry& s = *entry.second;
    for (PyObject* o : s.held) Py_VISIT(o);
    Py_VISIT(s.manager);
    Py_VISIT(s.fn);
    Py_VISIT(s.capturing);
  }
  return 0;
}

int door_clear(PyObject* self) {
  Door* d = reinterpret_cast<DoorObject*>(self)->door;
  if (d == nullptr) return 0;
  d->clear_table();
  for (PyObject*& o : d->context) Py_CLEAR(o);
  d->context.clear();
  Py_CLEAR(d->python);
  Py_CLEAR(d->key_of);
  Py_CLEAR(d->failed);
  Py_CLEAR(d->result);
  Py_CLEAR(d->size_entry);
  return 0;
}

PyObject* door_stats(PyObject* self, PyObject*) {
  Door* d = reinterpret_cast<DoorObject*>(self)->door;
  return Py_BuildValue("{s:K,s:K,s:K,s:K,s:n,s:K,s:n}", "hits", static_cast<unsigned long long>(d->hits), "misses",
                       static_cast<unsigned long long>(d->misses), "passes",
                       static_cast<unsigned long long>(d->passes), "revalidated",
                       static_cast<unsigned long long>(d->revalidated), "entries",
                       static_cast<Py_ssize_t>(d->n_entries), "sized_hits",
                       static_cast<unsigned long long>(d->sized_hits), "sized_entries",
                       static_cast<Py_ssize_t>(d->sized.size()));
}

PyObject* door_set_size_entry(PyObject* self, PyObject* hook) {
  Door* d = reinterpret_cast<DoorObject*>(self)->door;
  if (!PyCallable_Check(hook)) return PyErr_Format(PyExc_TypeError, "size_entry must be callable");
  Py_INCREF(hook);
  Py_XSETREF(d->size_entry, hook);
  d->clear_table();
  Py_RETURN_NONE;
}

PyObject* door_forget(PyObject* self, PyObject*) {
  reinterpret_cast<DoorObject*>(self)->door->clear_table();
  Py_RETURN_NONE;
}

PyMethodDef door_methods[] = {
    {"stats", door_stats, METH_NOARGS, "hits, misses (Python ran and the entry was read back), passes (handed "
                                       "to Python unkeyed), revalidated (hits after the manager's dict changed, "
                                       "checked by one lookup) and entries of this front door"},
    {"forget", door_forget, METH_NOARGS, "Drop every entry (the next call of each signature goes through Python)"},
    {"set_size_entry", door_set_size_entry, METH_O, "The hook that makes this door's size-generic entries "
                                                     "(opdispatch.base._native.compiled_front_door's size_entry)"},
    {nullptr, nullptr, 0, nullptr}};

// -- thread flags -------------------------------------------------------------------------------------------------

PyObject* flag_get(PyObject* self, void*) {
  return PyLong_FromLong(tls_flags[reinterpret_cast<FlagObject*>(self)->slot]);
}

int flag_set(PyObject* self, PyObject* value, void*) {
  if (value == nullptr) {
    tls_flags[reinterpret_cast<FlagObject*>(self)->slot] = 0;
    return 0;
  }
  long v = PyLong_AsLong(value);
  if (v == -1 && PyErr_Occurred()) return -1;
  tls_flags[reinterpret_cast<FlagObject*>(self)->slot] = v;
  return 0;
}

PyGetSetDef flag_getset[] = {
    {"active", flag_get, flag_set, "this thread's value (0: not inside)", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyObject* flag_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  if (!PyArg_ParseTuple(args, ":ThreadFlag")) return nullptr;
  if (flags_made >= kMaxFlags) {
    PyErr_Format(PyExc_RuntimeError, "opdispatch.base._native: at most %d ThreadFlag objects", kMaxFlags);
    return nullptr;
  }
  PyObject* self = type->tp_alloc(type, 0);
  if (self != nullptr) reinterpret_cast<FlagObject*>(self)->slot = flags_made++;
  return self;
}

// -- module -------------------------------------------------------------------------------------------------------

bool sequence_of_ints(PyObject* seq, std::vector<Py_ssize_t>& out, const char* what) {
  PyObject* fast = PySequence_Fast(seq, what);
  if (fast == nullptr) return false;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); ++i) {
    Py_ssize_t v = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(fast, i));
    if (v == -1 && PyErr_Occurred()) {
      Py_DECREF(fast);
      return false;
    }
    out.push_back(v);
  }
  Py_DECREF(fast);
  return true;
}

PyObject* make_front_door(PyObject*, PyObject* args, PyObject* kwargs) {
  static const char* keywords[] = {"name", "doc", "names", "n_positional", "defaults", "required", "kinds",
                                   "exact", "grad", "bound", "bound_optional", "context", "python", "key_of",
                                   "failed", "api_globals", "compiler_globals", "result", "result_arg", "flag",
                                   nullptr};
  const char *name, *doc;
  PyObject *names, *defaults, *required, *kinds, *exact, *grad, *bound, *bound_optional, *context, *python,
      *key_of, *failed, *api_globals, *compiler_globals, *result = Py_None, *flag = Py_None;
  Py_ssize_t n_positional, result_arg = -1;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "ssOnOOOOOOOOOOOO!O!|OnO:front_door",
                                   const_cast<char**>(keywords), &name, &doc, &names, &n_positional, &defaults,
                                   &required, &kinds, &exact, &grad, &bound, &bound_optional, &context, &python,
                                   &key_of, &failed, &PyDict_Type, &api_globals, &PyDict_Type, &compiler_globals,
                                   &result, &result_arg, &flag))
    return nullptr;
  auto door = std::make_unique<Door>();
  door->name = name;
  door->doc = doc;
  door->n_positional = n_positional;
  PyObject* names_fast = PySequence_Fast(names, "names must be a sequence");
  PyObject* defaults_fast = PySequence_Fast(defaults, "defaults must be a sequence");
  if (names_fast == nullptr || defaults_fast == nullptr) {
    Py_XDECREF(names_fast);
    Py_XDECREF(defaults_fast);
    return nullptr;
  }
  door->n = PySequence_Fast_GET_SIZE(names_fast);
  bool ok = door->n <= kMaxArgs && PySequence_Fast_GET_SIZE(defaults_fast) == door->n;
  for (Py_ssize_t i = 0; ok && i < door->n; ++i) {
    PyObject* nm = PySequence_Fast_GET_ITEM(names_fast, i);
    if (!PyUnicode_CheckExact(nm)) {
      ok = false;
      break;
    }
    Py_INCREF(nm);
    PyUnicode_InternInPlace(&nm);
    door->names.push_back(nm);
    PyObject* dflt = PySequence_Fast_GET_ITEM(defaults_fast, i);
    if (dflt == required) {
      door->defaults.push_back(nullptr);
    } else {
      Py_INCREF(dflt);
      door->defaults.push_back(dflt);
    }
  }
  Py_DECREF(names_fast);
  Py_DECREF(defaults_fast);
  std::vector<Py_ssize_t> kinds_v, exact_v, grad_v, context_dummy;
  if (!ok) {
    PyErr_Format(PyExc_ValueError, "front_door %s: names must be at most %zd str, one default each", name,
                 kMaxArgs);
    return nullptr;
  }
  if (!sequence_of_ints(kinds, kinds_v, "kinds") || !sequence_of_ints(exact, exact_v, "exact") ||
      !sequence_of_ints(grad, grad_v, "grad") || !sequence_of_ints(bound, door->bound, "bound") ||
      !sequence_of_ints(bound_optional, door->bound_optional, "bound_optional"))
    return nullptr;
  if (static_cast<Py_ssize_t>(kinds_v.size()) != door->n || static_cast<Py_ssize_t>(exact_v.size()) != door->n ||
      static_cast<Py_ssize_t>(grad_v.size()) != door->n) {
    PyErr_Format(PyExc_ValueError, "front_door %s: kinds, exact and grad need one item per argument", name);
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < door->n; ++i) {
    if (kinds_v[i] < kTensor || kinds_v[i] > kZero) {
      PyErr_Format(PyExc_ValueError, "front_door %s: unknown key kind %zd", name, kinds_v[i]);
      return nullptr;
    }
    door->specs.push_back(SlotSpec{static_cast<uint8_t>(kinds_v[i]), exact_v[i] != 0, grad_v[i] != 0});
  }
  for (Py_ssize_t i = 0; i < door->n; ++i) door->default_keyed.push_back(!door->default_is_constant(i));
  for (Py_ssize_t i : door->bound) {
    if (i < 0 || i >= door->n) return PyErr_Format(PyExc_ValueError, "front_door %s: bad bound index", name);
  }
  for (Py_ssize_t i : door->bound_optional) {
    if (i < 0 || i >= door->n) return PyErr_Format(PyExc_ValueError, "front_door %s: bad bound index", name);
  }
  if (result != Py_None && (result_arg < 0 || result_arg >= door->n))
    return PyErr_Format(PyExc_ValueError, "front_door %s: result needs a result_arg", name);
  PyObject* context_fast = PySequence_Fast(context, "context must be a sequence");
  if (context_fast == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(context_fast); ++i) {
    PyObject* c = PySequence_Fast_GET_ITEM(context_fast, i);
    Py_INCREF(c);
    door->context.push_back(c);
  }
  Py_DECREF(context_fast);
  if (flag != Py_None) {
    if (Py_TYPE(flag) != &FlagType) return PyErr_Format(PyExc_TypeError, "flag must be a ThreadFlag");
    door->flag = reinterpret_cast<FlagObject*>(flag)->slot;
  }
  for (PyObject* o : {python, key_of, failed, api_globals, compiler_globals}) Py_INCREF(o);
  door->python = python;
  door->key_of = key_of;
  door->failed = failed;
  door->api_globals = api_globals;
  door->compiler_globals = compiler_globals;
  if (result != Py_None) {
    Py_INCREF(result);
    door->result = result;
    door->result_arg = result_arg;
  }
  door->def.ml_name = door->name.c_str();
  door->def.ml_meth = reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(door_call));
  door->def.ml_flags = METH_FASTCALL | METH_KEYWORDS;
  door->def.ml_doc = door->doc.c_str();
  DoorObject* state = PyObject_GC_New(DoorObject, &DoorType);
  if (state == nullptr) return nullptr;
  state->door = door.release();
  PyObject_GC_Track(reinterpret_cast<PyObject*>(state));
  PyObject* module_name = PyUnicode_FromString("opdispatch");
  if (module_name == nullptr) {
    Py_DECREF(state);
    return nullptr;
  }
  PyObject* fn = PyCFunction_NewEx(&state->door->def, reinterpret_cast<PyObject*>(state), module_name);
  Py_DECREF(module_name);
  Py_DECREF(state);
  return fn;
}

PyMethodDef module_methods[] = {
    {"front_door", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(make_front_door)),
     METH_VARARGS | METH_KEYWORDS, "A front door as a C builtin (see opdispatch.base._native.compiled_front_door)"},
    {"kernel_call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(make_kernel_call)),
     METH_VARARGS | METH_KEYWORDS, "A bound kernel as one C call (see opdispatch.base._native.kernel_call)"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, nullptr, "opdispatch's compiled per-call fast path", -1,
                          module_methods};

}  // namespace

#ifndef TORCH_EXTENSION_NAME
#error "build with torch.utils.cpp_extension, which defines TORCH_EXTENSION_NAME (opdispatch.base._native.build does)"
#endif
#define OPDISPATCH_CONCAT2(a, b) a##b
#define OPDISPATCH_CONCAT(a, b) OPDISPATCH_CONCAT2(a, b)
#define OPDISPATCH_STR2(a) #a
#define OPDISPATCH_STR(a) OPDISPATCH_STR2(a)

PyMODINIT_FUNC OPDISPATCH_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  module_def.m_name = OPDISPATCH_STR(TORCH_EXTENSION_NAME);
  DoorType.tp_name = "opdispatch.FrontDoorState";
  DoorType.tp_basicsize = sizeof(DoorObject);
  DoorType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
  DoorType.tp_doc = "The state of one compiled front door: its spec, its table, its counters";
  DoorType.tp_dealloc = door_dealloc;
  DoorType.tp_traverse = door_traverse;
  DoorType.tp_clear = door_clear;
  DoorType.tp_methods = door_methods;
  FlagType.tp_name = "opdispatch.ThreadFlag";
  FlagType.tp_basicsize = sizeof(FlagObject);
  FlagType.tp_flags = Py_TPFLAGS_DEFAULT;
  FlagType.tp_doc = "A per-thread int, `active`, readable from C without a lookup";
  FlagType.tp_new = flag_new;
  FlagType.tp_getset = flag_getset;
  KernelCallType.tp_name = "opdispatch.KernelCall";
  KernelCallType.tp_basicsize = sizeof(KernelCallObject);
  KernelCallType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL;
  KernelCallType.tp_doc = "kernel(*tensors, *tail, **kwargs)[index] as one C call";
  KernelCallType.tp_vectorcall_offset = offsetof(KernelCallObject, vectorcall);
  KernelCallType.tp_call = PyVectorcall_Call;
  KernelCallType.tp_dictoffset = offsetof(KernelCallObject, dict);
  KernelCallType.tp_getattro = PyObject_GenericGetAttr;
  KernelCallType.tp_setattro = PyObject_GenericSetAttr;
  KernelCallType.tp_getset = kernel_call_getset;
  KernelCallType.tp_traverse = kernel_call_traverse;
  KernelCallType.tp_clear = kernel_call_clear;
  KernelCallType.tp_dealloc = kernel_call_dealloc;
  KernelCallType.tp_repr = kernel_call_repr;
  if (PyType_Ready(&DoorType) < 0 || PyType_Ready(&FlagType) < 0 || PyType_Ready(&KernelCallType) < 0)
    return nullptr;
  s_manager = PyUnicode_InternFromString("_manager");
  s_fast = PyUnicode_InternFromString("fast");
  s_compiling = PyUnicode_InternFromString("_is_compiling_flag");
  if (s_manager == nullptr || s_fast == nullptr || s_compiling == nullptr) return nullptr;
  PyObject* module = PyModule_Create(&module_def);
  if (module == nullptr) return nullptr;
  Py_INCREF(&FlagType);
  if (PyModule_AddObject(module, "ThreadFlag", reinterpret_cast<PyObject*>(&FlagType)) < 0) {
    Py_DECREF(&FlagType);
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
