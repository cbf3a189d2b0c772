// trillm._ext.cpu_kernels.program: Thunk and Program (ext/cpu_program.h says why).
#include "cpu_program.h"

#include <time.h>

#include <chrono>

#include <pybind11/stl.h>

#include "cpu_common.h"

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
  // run(), each thunk timed: [(this thread's CPU ns, wall ns)] in order (a breakdown of the
  // step by kernel: benchmarks/engine/step_breakdown.py).
  std::vector<std::pair<int64_t, int64_t>> run_timed() const {
    std::vector<std::pair<int64_t, int64_t>> out;
    out.reserve(steps_.size());
    for (const auto& step : steps_) {
      const int64_t c0 = thread_ns(), w0 = wall_ns();
      step();
      out.emplace_back(thread_ns() - c0, wall_ns() - w0);
    }
    return out;
  }
  static int64_t thread_ns() {
    timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return static_cast<int64_t>(t.tv_sec) * 1000000000 + t.tv_nsec;
  }
  static int64_t wall_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

 private:
  std::vector<std::function<void()>> steps_;
};

// The thread pool's cost of one call: `calls` calls of `num_items` empty items on `num_threads`
// threads (the caller included); (wall ns, this thread's CPU ns) a call.
std::pair<double, double> pool_dispatch_ns(int num_threads, int num_items, int calls) {
  py::gil_scoped_release release;
  std::atomic<int> sink{0};
  const auto item = [&](int i) { sink.fetch_add(i, std::memory_order_relaxed); };
  run_items(num_threads, num_items, item);  // makes the pool
  const int64_t c0 = Program::thread_ns(), w0 = Program::wall_ns();
  for (int c = 0; c < calls; ++c) run_items(num_threads, num_items, item);
  const double n = std::max(calls, 1);
  return {(Program::wall_ns() - w0) / n, (Program::thread_ns() - c0) / n};
}

}  // namespace

void register_cpu_program(py::module_& m) {
  m.doc() = "Native step programs: bound kernel calls (Thunk), run in order (Program).";
  py::class_<Thunk>(m, "Thunk").def("__call__", [](const Thunk& t) { t.fn(); });
  py::class_<Program>(m, "Program")
      .def(py::init<>())
      .def("append", &Program::append, py::arg("thunk"))
      .def("__len__", &Program::size)
      .def("run", &Program::run, "Run the thunks in order (an error stops the run).")
      .def("run_timed", &Program::run_timed,
           "run(), each thunk timed: [(this thread's CPU ns, wall ns)] in order.");
  m.def("pool_dispatch_ns", &pool_dispatch_ns, py::arg("num_threads"), py::arg("num_items"),
        py::arg("calls"),
        "The thread pool's cost of a call of empty items: (wall ns, caller CPU ns) a call.");
  m.def("park_pools", &trillm_cpu::park_pools,
        "The pools' threads stop polling for the next call and sleep until it comes (a step "
        "has ended).");
}
