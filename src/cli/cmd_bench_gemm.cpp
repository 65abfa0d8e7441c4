// dtrain bench gemm: GFLOP/s of the engine's GEMM against plain dnnl_sgemm and OpenBLAS
// cblas_sgemm on the same shapes: the models' layer shapes and squares 256..2048.
#include <cblas.h>
#include <oneapi/dnnl/dnnl.h>

#include <algorithm>
#include <boost/program_options.hpp>
#include <functional>
#include <iostream>
#include <vector>

#include "commands.h"
#include "dtrain/comm/runtime.h"
#include "dtrain/core/rng.h"
#include "dtrain/core/timer.h"
#include "dtrain/kernels/engine.h"

namespace po = boost::program_options;

namespace dtrain::cli {

namespace {
struct Shape3 {
  const char* what;
  int64_t m, n, k;
  bool ta, tb;
};

// Best-of-`reps` seconds per call after a warm-up, repeating calls until each timing spans >= 20 ms.
double time_call(const std::function<void()>& f, int reps) {
  f();
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    int calls = 0;
    double t0 = now_s(), t;
    do {
      f();
      ++calls;
      t = now_s();
    } while (t - t0 < 0.02);
    best = std::min(best, (t - t0) / calls);
  }
  return best;
}
}  // namespace

int cmd_bench_gemm(int argc, char** argv) {
  int threads = 1, reps = 5;
  std::string device = "cpu";
  po::options_description opts("usage: dtrain bench gemm [options]");
  opts.add_options()("help,h", "print this help")("threads", po::value<int>(&threads)->default_value(1),
                                                  "threads for all three libraries")(
      "reps", po::value<int>(&reps)->default_value(5), "timed repetitions (best is reported)")(
      "device", po::value<std::string>(&device)->default_value("cpu"), "cpu (cuda once the CUDA engine lands)");
  po::variables_map vm;
  try {
    po::store(po::command_line_parser(argc, argv).options(opts).run(), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    throw InputError(e.what());
  }
  if (vm.count("help")) {
    std::cout << opts << "\n";
    return 0;
  }
  DT_INPUT_CHECK(threads >= 1, "option --threads must be >= 1");
  DT_INPUT_CHECK(device == "cpu", "option --device: '" << device << "' is not available in this build");
  if (comm::Runtime::get().topology().rank != 0) return 0;
  Engine& e = cpu_engine();
  e.set_threads(threads);
  openblas_set_num_threads(threads);
  // Layer GEMMs at batch 64: forward y = x W^T, backward dW = dy^T x, dx = dy W.
  std::vector<Shape3> shapes = {
      {"simple_cnn fc fwd", 64, 10, 1568, false, true},    {"simple_cnn fc dW", 10, 1568, 64, true, false},
      {"mlp fc1 fwd (784->256)", 64, 256, 784, false, true}, {"mlp fc1 dW", 256, 784, 64, true, false},
      {"mlp fc1 dx", 64, 784, 256, false, false},           {"gpt qkv (B8 T128, 256->768)", 1024, 768, 256, false, true},
      {"gpt mlp up (256->1024)", 1024, 1024, 256, false, true},
  };
  for (int64_t s = 256; s <= 2048; s *= 2) shapes.push_back({"square", s, s, s, false, false});
  std::printf("GEMM GFLOP/s, %d thread(s); OPENBLAS_CORETYPE=%s\n", threads,
              std::getenv("OPENBLAS_CORETYPE") ? std::getenv("OPENBLAS_CORETYPE") : "(unset)");
  std::printf("%-30s %6s %6s %6s  %9s %9s %9s  %s\n", "shape", "M", "N", "K", "dtrain", "dnnl", "openblas",
              "dtrain/openblas");
  Rng rng(1);
  for (const Shape3& s : shapes) {
    Tensor a = Tensor::empty({s.m * s.k}), b = Tensor::empty({s.k * s.n}), c = Tensor::zeros({s.m * s.n});
    for (int64_t i = 0; i < a.numel(); ++i) a.f32()[i] = rng.uniform(-1, 1);
    for (int64_t i = 0; i < b.numel(); ++i) b.f32()[i] = rng.uniform(-1, 1);
    double flop = 2.0 * static_cast<double>(s.m) * static_cast<double>(s.n) * static_cast<double>(s.k);
    int64_t lda = s.ta ? s.m : s.k, ldb = s.tb ? s.k : s.n;
    double t_engine = time_call([&] { e.gemm(s.ta, s.tb, s.m, s.n, s.k, 1.f, a, b, 0.f, c); }, reps);
    double t_dnnl = time_call(
        [&] {
          dnnl_sgemm(s.ta ? 'T' : 'N', s.tb ? 'T' : 'N', s.m, s.n, s.k, 1.f, a.f32(), lda, b.f32(), ldb, 0.f, c.f32(),
                     s.n);
        },
        reps);
    double t_blas = time_call(
        [&] {
          cblas_sgemm(CblasRowMajor, s.ta ? CblasTrans : CblasNoTrans, s.tb ? CblasTrans : CblasNoTrans,
                      static_cast<int>(s.m), static_cast<int>(s.n), static_cast<int>(s.k), 1.f, a.f32(),
                      static_cast<int>(lda), b.f32(), static_cast<int>(ldb), 0.f, c.f32(), static_cast<int>(s.n));
        },
        reps);
    std::printf("%-30s %6lld %6lld %6lld  %9.1f %9.1f %9.1f  %.2fx\n", s.what, static_cast<long long>(s.m),
                static_cast<long long>(s.n), static_cast<long long>(s.k), flop / t_engine * 1e-9,
                flop / t_dnnl * 1e-9, flop / t_blas * 1e-9, t_blas / t_engine);
  }
  return 0;
}

}  // namespace dtrain::cli
