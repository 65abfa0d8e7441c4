// Convolution backward-weights on the CPU: oneDNN's primitive (what the engine runs) against
// im2col + GEMM, for the models' convolution shapes (batch 64, one thread).
//   build/benchmarks/micro/bench_conv --benchmark_min_time=0.2
#include <benchmark/benchmark.h>
#include <omp.h>

#include <vector>

#include "dtrain/core/rng.h"
#include "dtrain/kernels/engine.h"
#include "im2col.h"

using namespace dtrain;

namespace {

struct Case {
  Conv2dGeom g;
  Tensor x, dy, dw, db;
  explicit Case(const Conv2dGeom& geom) : g(geom) {
    Rng rng(1);
    x = Tensor::empty({g.n, g.c, g.h, g.w});
    dy = Tensor::empty({g.n, g.k, g.out_h(), g.out_w()});
    for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = rng.normal();
    for (int64_t i = 0; i < dy.numel(); ++i) dy.f32()[i] = rng.normal();
    dw = Tensor::zeros({g.k, g.c, g.r, g.s});
    db = Tensor::zeros({g.k});
  }
};

Conv2dGeom shape(int64_t c, int64_t hw, int64_t k) { return Conv2dGeom{64, c, hw, hw, k, 3, 3, 1, 1}; }

const Conv2dGeom kShapes[] = {
    shape(1, 28, 16),   // SimpleCNN conv1 (Fashion-MNIST)
    shape(16, 14, 32),  // SimpleCNN conv2
    shape(3, 32, 16),   // ResNet-20 stem (CIFAR-10)
    shape(16, 32, 16),  // ResNet-20 stage 1
};

void BM_onednn(benchmark::State& st) {
  Case c(kShapes[st.range(0)]);
  Engine& e = cpu_engine();
  for (auto _ : st) e.conv2d_backward_weights(c.g, c.x, c.dy, c.dw, c.db);
  st.SetLabel("C=" + std::to_string(c.g.c) + " HW=" + std::to_string(c.g.h) + " K=" + std::to_string(c.g.k));
}

void BM_im2col(benchmark::State& st) {
  Case c(kShapes[st.range(0)]);
  std::vector<float> cols(static_cast<size_t>(c.g.c * 9 * c.g.out_h() * c.g.out_w()));
  for (auto _ : st) cpu::conv2d_backward_weights_im2col(c.g, c.x.f32(), c.dy.f32(), c.dw.f32(), c.db.f32(), cols.data());
  st.SetLabel("C=" + std::to_string(c.g.c) + " HW=" + std::to_string(c.g.h) + " K=" + std::to_string(c.g.k));
}

}  // namespace

BENCHMARK(BM_onednn)->DenseRange(0, 3)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_im2col)->DenseRange(0, 3)->Unit(benchmark::kMicrosecond);

int main(int argc, char** argv) {
  cpu_engine().set_threads(1);
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  return 0;
}
