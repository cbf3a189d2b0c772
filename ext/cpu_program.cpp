// trillm._ext.cpu_kernels.program: Thunk and Program (ext/cpu_program.h says why).
#include "cpu_program.h"

namespace py = pybind11;

namespace {

using trillm_cpu::Thunk;

// Thunks run in order by one call. The pointers they hold are the caller's to keep valid (a step
// program keeps the buffers and weights they point into).
class Program {
 public:
  void append(const Thunk& t) {
    if (!t.fn) throw std::invalid_argument("an empty thunk");
    steps_.push_back(t.fn);
  }
  size_t size() const { return steps_.size(); }
  void run() const {
    for (const auto& step : steps_) step();
  }

 private:
  std::vector<std::function<void()>> steps_;
};

}  // namespace

void register_cpu_program(py::module_& m) {
  m.doc() = "Native step programs: bound kernel calls (Thunk), run in order (Program).";
  py::class_<Thunk>(m, "Thunk").def("__call__", [](const Thunk& t) { t.fn(); });
  py::class_<Program>(m, "Program")
      .def(py::init<>())
      .def("append", &Program::append, py::arg("thunk"))
      .def("__len__", &Program::size)
      .def("run", &Program::run, "Run the thunks in order (an error stops the run).");
}
