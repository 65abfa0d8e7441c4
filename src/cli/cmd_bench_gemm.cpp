// dtrain bench gemm: GFLOP/s of the engine's GEMM against plain dnnl_sgemm and OpenBLAS
// cblas_sgemm on the same shapes: the models' layer shapes and squares 256..2048, with the engine's
// bf16 math (AVX512-BF16) beside its fp32, and SimpleCNN's convolutions in fp32 and bf16.
// --device cuda: TFLOP/s of the CUDA engine (cuBLASLt) in fp32, tf32, bf16 and fp16 math and the
// fraction of the device's dense peak for that precision.
#include <cblas.h>
#include <oneapi/dnnl/dnnl.h>

#include <algorithm>
#include <boost/program_options.hpp>
#include <iostream>
#include <vector>

#include "bench_timing.h"
#include "commands.h"
#include "dtrain/train/options.h"
#include "dtrain/comm/runtime.h"
#include "dtrain/core/rng.h"
#include "dtrain/kernels/engine.h"
#if defined(DTRAIN_WITH_CUDA_ENGINE)
#include "dtrain/kernels/cuda.h"
#endif

namespace po = boost::program_options;

namespace dtrain::cli {

namespace {
struct Shape3 {
  const char* what;
  int64_t m, n, k;
  bool ta, tb;
};

std::vector<Shape3> layer_shapes() {
  // Layer GEMMs at batch 64: forward y = x W^T, backward dW = dy^T x, dx = dy W. The GPT rows are
  // issue 5's model (B 8, T 128, C 256): 1024 tokens through the qkv projection.
  std::vector<Shape3> shapes = {
      {"simple_cnn fc fwd", 64, 10, 1568, false, true},
      {"simple_cnn fc dW", 10, 1568, 64, true, false},
      {"mlp fc1 fwd (784->256)", 64, 256, 784, false, true},
      {"mlp fc1 dW", 256, 784, 64, true, false},
      {"mlp fc1 dx", 64, 784, 256, false, false},
      {"gpt qkv (B8 T128, 256->768)", 1024, 768, 256, false, true},
      {"gpt qkv dW", 768, 256, 1024, true, false},
      {"gpt qkv dx", 1024, 256, 768, false, false},
      {"gpt mlp up (256->1024)", 1024, 1024, 256, false, true},
  };
  for (int64_t s = 256; s <= 2048; s *= 2) shapes.push_back({"square", s, s, s, false, false});
  return shapes;
}

// SimpleCNN's convolutions (batch 64, 28x28 inputs) and one ResNet-20 shape: forward, backward
// data and backward weights together, fp32 against bf16 math.
void bench_convs(Engine& e, int reps) {
  std::printf("\nconvolution GFLOP/s (engine; forward + backward data + backward weights)\n");
  std::printf("%-36s %9s %9s  %s\n", "conv (N,C,H,W -> K, 3x3 pad 1)", "fp32", "bf16", "bf16/fp32");
  struct ConvCase {
    const char* what;
    Conv2dGeom g;
  };
  std::vector<ConvCase> cases = {{"simple_cnn conv1 (64,1,28,28->16)", {64, 1, 28, 28, 16, 3, 3, 1, 1}},
                                 {"simple_cnn conv2 (64,16,14,14->32)", {64, 16, 14, 14, 32, 3, 3, 1, 1}},
                                 {"resnet20 stage3 (64,64,8,8->64)", {64, 64, 8, 8, 64, 3, 3, 1, 1}}};
  Rng rng(2);
  for (const ConvCase& c : cases) {
    const Conv2dGeom& g = c.g;
    Tensor x = Tensor::empty({g.n, g.c, g.h, g.w}), w = Tensor::empty({g.k, g.c, g.r, g.s});
    Tensor b = Tensor::zeros({g.k}), y = Tensor::empty({g.n, g.k, g.out_h(), g.out_w()});
    Tensor dy = Tensor::empty(y.shape()), dx = Tensor::empty(x.shape()), dw = Tensor::zeros(w.shape()),
           db = Tensor::zeros({g.k});
    fill_uniform(x, rng);
    fill_uniform(w, rng);
    fill_uniform(dy, rng);
    double macs = static_cast<double>(g.n * g.k * g.out_h() * g.out_w()) * static_cast<double>(g.c * g.r * g.s);
    double flop = 3 * 2 * macs;
    double t[2];
    for (int prec = 0; prec < 2; ++prec) {
      e.set_math_precision(prec ? MathPrecision::BF16 : MathPrecision::F32);
      t[prec] = time_call(
          [&] {
            e.conv2d_forward(g, x, w, b, y);
            e.conv2d_backward_data(g, dy, w, dx);
            e.conv2d_backward_weights(g, x, dy, dw, db);
          },
          reps);
    }
    e.set_math_precision(MathPrecision::F32);
    std::printf("%-36s %9.1f %9.1f  %.2fx\n", c.what, flop / t[0] * 1e-9, flop / t[1] * 1e-9, t[0] / t[1]);
  }
}

#if defined(DTRAIN_WITH_CUDA_ENGINE)
int bench_cuda(int reps) {
  DT_INPUT_CHECK(enable_cuda() > 0, "option --device cuda: no GPU is visible (cudaGetDeviceCount found none)");
  Engine& e = engine_for(Device::cuda(0));
  cuda::DeviceInfo info = cuda::device_info(0);
  std::printf("GEMM TFLOP/s on %s (sm_%d, %d SMs, %.2f GHz); dense peaks fp32 %.1f, tf32 %.1f, bf16/fp16 %.1f\n",
              info.name.c_str(), info.compute_capability, info.sms, info.clock_ghz, info.peak_fp32, info.peak_tf32,
              info.peak_bf16);
  // The last two columns: B is a bf16/fp16 weight copy made outside the timing (mixed precision's
  // working copies), so only A (the activations) is cast inside each call.
  std::printf("%-30s %6s %6s %6s  %14s %14s %14s %14s %14s %14s\n", "shape", "M", "N", "K", "fp32 (%peak)",
              "tf32 (%peak)", "bf16 (%peak)", "fp16 (%peak)", "bf16 w-copy", "fp16 w-copy");
  std::vector<Shape3> shapes = layer_shapes();
  for (int64_t s = 4096; s <= 8192; s *= 2) shapes.push_back({"square", s, s, s, false, false});
  Rng rng(1);
  const MathPrecision precs[4] = {MathPrecision::F32, MathPrecision::TF32, MathPrecision::BF16, MathPrecision::F16};
  const double peaks[4] = {info.peak_fp32, info.peak_tf32, info.peak_bf16, info.peak_bf16};
  const Device gpu = Device::cuda(0);
  for (const Shape3& s : shapes) {
    Tensor ha = Tensor::empty({s.m * s.k}), hb = Tensor::empty({s.k * s.n});
    fill_uniform(ha, rng);
    fill_uniform(hb, rng);
    Tensor a = Tensor::empty(ha.shape(), DType::F32, gpu), b = Tensor::empty(hb.shape(), DType::F32, gpu);
    Tensor c = Tensor::empty({s.m * s.n}, DType::F32, gpu);
    e.copy(ha, a);
    e.copy(hb, b);
    Tensor b_bf16 = Tensor::empty(hb.shape(), DType::BF16, gpu), b_f16 = Tensor::empty(hb.shape(), DType::F16, gpu);
    e.cast(b, b_bf16);
    e.cast(b, b_f16);
    double flop = 2.0 * static_cast<double>(s.m) * static_cast<double>(s.n) * static_cast<double>(s.k);
    std::printf("%-30s %6lld %6lld %6lld ", s.what, static_cast<long long>(s.m), static_cast<long long>(s.n),
                static_cast<long long>(s.k));
    for (int p = 0; p < 6; ++p) {
      // Columns 0-3: f32 tensors, cast inside each call under bf16/fp16 math (time included);
      // 4-5: B given as a bf16/fp16 copy. 20 calls per timing, then one sync: launch latency does
      // not hide the GPU's rate.
      e.set_math_precision(p < 4 ? precs[p] : p == 4 ? MathPrecision::BF16 : MathPrecision::F16);
      const Tensor& bp = p < 4 ? b : p == 4 ? b_bf16 : b_f16;
      double t = time_call(
                     [&] {
                       for (int i = 0; i < 20; ++i) e.gemm(s.ta, s.tb, s.m, s.n, s.k, 1.f, a, bp, 0.f, c);
                       e.synchronize();
                     },
                     reps) /
                 20;
      double tf = flop / t * 1e-12;
      const double peak = p < 4 ? peaks[p] : info.peak_bf16;
      std::printf(" %7.1f (%3.0f%%)", tf, peak > 0 ? 100 * tf / peak : 0.0);
    }
    std::printf("\n");
  }
  e.set_math_precision(MathPrecision::F32);
  std::printf("%s\n", cuda::format_stats(cuda::allocator_stats(0)).c_str());
  return 0;
}
#endif
}  // namespace

int cmd_bench_gemm(int argc, char** argv) {
  int threads = 1, reps = 5;
  std::string device = "cpu";
  po::options_description opts("Options");
  opts.add_options()("threads", po::value<int>(&threads)->default_value(1),
                                                  "threads for all three libraries")(
      "reps", po::value<int>(&reps)->default_value(5), "timed repetitions (best is reported)")(
      "device", po::value<std::string>(&device)->default_value("cpu"), "cpu or cuda (GPU 0 of this rank)");
  po::variables_map vm;
  if (!train::parse_options(argc, argv, opts, "usage: dtrain bench gemm [options]", vm)) return 0;
  DT_INPUT_CHECK(threads >= 1, "option --threads must be >= 1");
#if defined(DTRAIN_WITH_CUDA_ENGINE)
  DT_INPUT_CHECK(device == "cpu" || device == "cuda", "option --device: '" << device << "' (expected cpu or cuda)");
#else
  DT_INPUT_CHECK(device == "cpu", "option --device: '" << device << "' is not available in this build (no CUDA)");
#endif
  if (comm::Runtime::get().topology().rank != 0) return 0;
#if defined(DTRAIN_WITH_CUDA_ENGINE)
  if (device == "cuda") return bench_cuda(reps);
#endif
  Engine& e = cpu_engine();
  e.set_threads(threads);
  openblas_set_num_threads(threads);
  std::vector<Shape3> shapes = layer_shapes();
  std::printf("GEMM GFLOP/s, %d thread(s); OPENBLAS_CORETYPE=%s\n", threads,
              std::getenv("OPENBLAS_CORETYPE") ? std::getenv("OPENBLAS_CORETYPE") : "(unset)");
  std::printf("%-30s %6s %6s %6s  %9s %9s %9s  %15s %9s\n", "shape", "M", "N", "K", "dtrain", "dnnl", "openblas",
              "dtrain/openblas", "bf16");
  Rng rng(1);
  for (const Shape3& s : shapes) {
    Tensor a = Tensor::empty({s.m * s.k}), b = Tensor::empty({s.k * s.n}), c = Tensor::zeros({s.m * s.n});
    fill_uniform(a, rng);
    fill_uniform(b, rng);
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
    // The engine's bf16 math: operands rounded to bf16 inside the call (included in the time).
    e.set_math_precision(MathPrecision::BF16);
    double t_bf16 = time_call([&] { e.gemm(s.ta, s.tb, s.m, s.n, s.k, 1.f, a, b, 0.f, c); }, reps);
    e.set_math_precision(MathPrecision::F32);
    std::printf("%-30s %6lld %6lld %6lld  %9.1f %9.1f %9.1f  %14.2fx %9.1f\n", s.what, static_cast<long long>(s.m),
                static_cast<long long>(s.n), static_cast<long long>(s.k), flop / t_engine * 1e-9, flop / t_dnnl * 1e-9,
                flop / t_blas * 1e-9, t_blas / t_engine, flop / t_bf16 * 1e-9);
  }
  bench_convs(e, reps);
  return 0;
}

}  // namespace dtrain::cli
