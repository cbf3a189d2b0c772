// Step programs in native code: a recorded decode step's kernel calls with their arguments
// converted once, replayed by one call from Python (trillm/worker/step_program.py).
//
// Every void kernel of trillm._ext.cpu_kernels is defined with ``def_kernel``: besides the kernel
// itself, ``bind_<name>`` takes the same arguments (same names, same defaults) and returns a
// ``Thunk``, the call with its arguments converted and kept. A ``Program`` runs its thunks in
// order. At batch 1 the argument conversion of ~360 calls (keyword matching, tuples) was most of
// the Python left in a replayed step (benchmarks/archive/RESULTS-journal.md, section 31).
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <pybind11/pybind11.h>

namespace trillm_cpu {

// One kernel call, its arguments bound by value. The kernels release the GIL around their work
// themselves, so a thunk runs with the GIL held.
struct Thunk {
  std::function<void()> fn;
};

// m.def(name, f, extra...) and m.def("bind_" + name, ...) with the same arguments, bound.
template <typename... A, typename... Extra>
void def_kernel(pybind11::module_& m, const char* name, void (*f)(A...), const Extra&... extra) {
  m.def(name, f, extra...);
  m.def(
      ("bind_" + std::string(name)).c_str(),
      [f](A... a) { return Thunk{[f, a...]() { f(a...); }}; }, extra...,
      "The call with these arguments, bound: a step of a Program.");
}

}  // namespace trillm_cpu
