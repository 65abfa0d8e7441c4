// dtrain bench allreduce: nccl-tests-style bandwidth table for dtrain's allreduce, one dtype and
// size at a time, one row per --allreduce algorithm (the impl column names the one that ran:
// auto resolves per size) and raw MPI_Allreduce on the same buffers as the baseline row, and a
// table for each gradient compressor (bytes sent, encode/decode cost per MiB). Run under mpirun.
//
//   algBw = bytes / time;  busBw = algBw * 2 (n - 1) / n   (nccl-tests' definitions)
// time: per iteration the slowest rank's, then the median over the iterations.
#include <mpi.h>

#include <algorithm>
#include <boost/program_options.hpp>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "commands.h"
#include "dtrain/comm/communicator.h"
#include "dtrain/comm/compression.h"
#include "dtrain/comm/nccl.h"
#include "dtrain/comm/runtime.h"
#include "dtrain/core/dtype.h"
#include "dtrain/core/error.h"
#include "dtrain/core/tensor.h"
#include "dtrain/core/timer.h"
#include "dtrain/kernels/engine.h"

namespace po = boost::program_options;

namespace dtrain::cli {
namespace {

using comm::Communicator;
using comm::ReduceOp;

int64_t parse_bytes(const std::string& s) {
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  std::string unit = end ? std::string(end) : "";
  double mult = 1;
  if (unit == "K" || unit == "KiB" || unit == "k")
    mult = 1024.0;
  else if (unit == "M" || unit == "MiB")
    mult = 1024.0 * 1024;
  else if (unit == "G" || unit == "GiB")
    mult = 1024.0 * 1024 * 1024;
  else
    DT_INPUT_CHECK(unit.empty() || unit == "B", "size '" << s << "' (expected e.g. 4, 64K, 256M, 1G)");
  DT_INPUT_CHECK(v > 0, "size '" << s << "' must be positive");
  return static_cast<int64_t>(v * mult);
}

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) out.push_back(item);
  return out;
}

// Verifiable input: small integers whose sum over ranks every dtype holds exactly.
double pattern(DType dt, int rank, int64_t i) {
  if (dt == DType::U8) return static_cast<double>((i + rank) % 5);
  return static_cast<double>((i * 7 + rank * 3) % 13) - 6;
}

void fill(Tensor& host, int rank) {
  for (int64_t i = 0; i < host.numel(); ++i) host.set_item(i, pattern(host.dtype(), rank, i));
}

int64_t count_wrong(const Tensor& host, int ranks) {
  int64_t wrong = 0;
  for (int64_t i = 0; i < host.numel(); ++i) {
    double want = 0;
    for (int r = 0; r < ranks; ++r) want += pattern(host.dtype(), r, i);
    if (host.item(i) != want) ++wrong;
  }
  return wrong;
}

// Per iteration the slowest rank's time (as nccl-tests), then the median over iterations: on a
// shared node one descheduled iteration would otherwise dominate a mean.
double slowest_rank_median(std::vector<double> t, MPI_Comm c) {
  MPI_Allreduce(MPI_IN_PLACE, t.data(), static_cast<int>(t.size()), MPI_DOUBLE, MPI_MAX, c);
  std::sort(t.begin(), t.end());
  size_t n = t.size();
  return n % 2 ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2]);
}

double max_over_ranks(double t, MPI_Comm c) {
  double m = t;
  MPI_Allreduce(&t, &m, 1, MPI_DOUBLE, MPI_MAX, c);
  return m;
}

struct Options {
  int64_t min_bytes, max_bytes;
  int factor, iters, warmup, compressor_iters;
  std::vector<DType> dtypes;
  std::vector<std::string> compressors;
  ReduceOp op;
  bool check, baseline;
  std::string backend;
  std::vector<comm::AllreduceAlgorithm> algorithms;
};

}  // namespace

int cmd_bench_allreduce(int argc, char** argv) {
  std::string min_s, max_s, dtypes_s, comps_s, op_s, backend, comp_max_s, algorithms_s, device_s;
  Options o{};
  po::options_description desc("dtrain bench allreduce [options]   (run under mpirun / srun)");
  desc.add_options()("help,h", "this help")("min-bytes,b", po::value(&min_s)->default_value("4"),
                                            "smallest message per rank (4, 64K, 1M, ...)")(
      "max-bytes,e", po::value(&max_s)->default_value("256M"), "largest message per rank")(
      "step-factor,f", po::value(&o.factor)->default_value(2), "size multiplier between rows")(
      "iters,n", po::value(&o.iters)->default_value(10), "timed iterations per size")(
      "warmup,w", po::value(&o.warmup)->default_value(2), "untimed iterations per size")(
      "dtype,d", po::value(&dtypes_s)->default_value("f32"), "comma list of f32,bf16,f16,i32,i64,u8, or all")(
      "op,o", po::value(&op_s)->default_value("sum"), "sum, avg, max or min")(
      "compressor,c", po::value(&comps_s)->default_value(""),
      "comma list of gradient compressors to time on f32 buckets (none,fp16,bf16,topk:0.01,powersgd:4,sign,"
      "qsgd:16), or all")("compressor-max-bytes", po::value(&comp_max_s)->default_value("64M"),
                          "largest bucket for the compressor table")(
      "compressor-iters", po::value(&o.compressor_iters)->default_value(3), "timed iterations per compressor row")(
      "backend", po::value(&backend)->default_value("mpi"), "mpi or nccl (device buffers)")(
      "device", po::value(&device_s)->default_value("cpu"),
      "where the MPI backend's buffers live: cpu, cuda or sim (device buffers go through its host staging; no "
      "raw MPI baseline then)")(
      "allreduce", po::value(&algorithms_s)->default_value(""),
      "comma list of the MPI backend's allreduce algorithms to time side by side: auto, mpi, shm, hier (default: "
      "DTRAIN_ALLREDUCE, mpi)")("check", po::bool_switch(&o.check),
                                "verify one extra allreduce per row; #wrong counts bad elements")(
      "no-baseline", po::bool_switch(), "skip the raw MPI_Allreduce rows");
  po::variables_map vm;
  try {
    po::store(po::command_line_parser(argc, argv).options(desc).run(), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    throw InputError(std::string("dtrain bench allreduce: ") + e.what());
  }
  comm::Runtime& rt = comm::Runtime::initialized() ? comm::Runtime::get() : comm::Runtime::init(nullptr, nullptr);
  const int rank = rt.topology().rank, ranks = rt.topology().size;
  if (vm.count("help")) {
    if (rank == 0) std::cout << desc << "\n";
    return 0;
  }
  o.min_bytes = parse_bytes(min_s);
  o.max_bytes = parse_bytes(max_s);
  int64_t comp_max = std::min(parse_bytes(comp_max_s), o.max_bytes);
  DT_INPUT_CHECK(o.min_bytes <= o.max_bytes, "--min-bytes " << min_s << " is above --max-bytes " << max_s);
  DT_INPUT_CHECK(o.factor >= 2, "--step-factor must be >= 2");
  DT_INPUT_CHECK(o.iters >= 1 && o.warmup >= 0 && o.compressor_iters >= 1, "--iters must be >= 1, --warmup >= 0");
  o.op = comm::reduce_op_from_name(op_s);
  o.baseline = !vm["no-baseline"].as<bool>();
  o.backend = backend;
  for (const std::string& d : split_list(dtypes_s == "all" ? "f32,bf16,f16,i32,i64,u8" : dtypes_s))
    o.dtypes.push_back(dtype_from_name(d));
  o.compressors = split_list(comps_s == "all" ? "none,fp16,bf16,topk:0.01,powersgd:4,sign,qsgd:16" : comps_s);
  if (o.check) DT_INPUT_CHECK(o.op == ReduceOp::Sum, "--check verifies op sum only");
  for (const std::string& a : split_list(algorithms_s)) {
    try {
      o.algorithms.push_back(comm::allreduce_algorithm_from_name(a));
    } catch (const InputError& e) {
      throw InputError(std::string("option --allreduce: ") + e.what());
    }
  }

  std::unique_ptr<Communicator> nccl;
  Communicator* c = &rt.world();
  Device dev = Device::cpu();
  DT_INPUT_CHECK(device_s == "cpu" || device_s == "cuda" || device_s == "sim",
                 "option --device must be cpu, cuda or sim, got '" << device_s << "'");
  if (backend == "nccl") {
    DT_INPUT_CHECK(comm::nccl_compiled(), "--backend nccl: this dtrain was built without NCCL");
    DT_INPUT_CHECK(rt.topology().cuda_device >= 0, "--backend nccl: no CUDA device on " << rt.topology().host);
    nccl = comm::make_nccl_communicator(rt.world(), rt.topology().cuda_device);
    c = nccl.get();
    dev = Device::cuda(rt.topology().cuda_device);
    o.baseline = false;
    DT_INPUT_CHECK(o.algorithms.empty(), "--allreduce chooses among the MPI backend's algorithms (NCCL has its own)");
  } else {
    DT_INPUT_CHECK(backend == "mpi", "--backend '" << backend << "' (expected mpi or nccl)");
    if (device_s == "cuda") {
      DT_INPUT_CHECK(enable_cuda() > 0, "--device cuda: no GPU is visible on " << rt.topology().host);
      dev = Device::cuda(std::max(0, rt.topology().cuda_device));
    } else if (device_s == "sim") {
      dev = Device::sim();
    }
    if (!dev.is_cpu()) o.baseline = false;  // raw MPI_Allreduce cannot read device memory
  }
  if (o.algorithms.empty()) o.algorithms.push_back(c->allreduce_algorithm());
  MPI_Comm raw = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_WORLD, &raw);
  const double bus = comm::bus_bandwidth_factor("allreduce", ranks);

  if (rank == 0) {
    std::printf("# dtrain bench allreduce: %d ranks on %d node(s), backend %s, op %s, iters %d, warmup %d\n", ranks,
                rt.topology().node_count, backend.c_str(), comm::reduce_op_name(o.op), o.iters, o.warmup);
    std::printf("# %s\n#\n", rt.topology().mpi_library.c_str());
    std::printf("# %12s %12s %6s %6s %12s %12s %12s %12s %8s\n", "size", "count", "type", "redop", "impl", "time(us)",
                "algbw(GB/s)", "busbw(GB/s)", "#wrong");
  }
  // busBw summed over the f32 rows of >= 64 MiB, per algorithm and of the raw baseline
  std::vector<double> best_bw(o.algorithms.size(), 0.0);
  double sum_raw_bw = 0;
  int64_t total_wrong = 0;
  for (DType dt : o.dtypes) {
    const size_t esize = dtype_size(dt);
    for (int64_t bytes = o.min_bytes; bytes <= o.max_bytes; bytes *= o.factor) {
      int64_t count = std::max<int64_t>(1, bytes / static_cast<int64_t>(esize));
      int64_t nbytes = count * static_cast<int64_t>(esize);
      Tensor host = Tensor::empty({count}, dt);
      fill(host, rank);
      Tensor buf = dev.is_cpu() ? host : Tensor::empty({count}, dt, dev);
      if (!dev.is_cpu()) copy_any(host, buf);
      // dtrain's allreduce by each algorithm (launch + wait per iteration, as a training step uses
      // it) and the baseline, raw MPI_Allreduce into the same buffer from this thread (bf16/f16
      // with the same user-defined op; avg as sum, without dtrain's division). They take turns
      // iteration by iteration so that all see the same machine: on a shared node the load drifts.
      // The baseline reads a separate input: Open MPI 4.1.4's hierarchical component (HAN)
      // crashes on MPI_IN_PLACE past its first segment.
      MPI_Datatype mt = comm::mpi_datatype_of(dt);
      MPI_Op mop = comm::mpi_op_of(o.op, dt);
      const Tensor raw_input = o.baseline ? host.clone() : Tensor();
      auto raw_once = [&] { MPI_Allreduce(raw_input.raw(), buf.raw(), static_cast<int>(count), mt, mop, raw); };
      const size_t impls = o.algorithms.size() + (o.baseline ? 1 : 0);
      auto run = [&](size_t impl) {
        if (impl == o.algorithms.size()) return raw_once();
        c->set_allreduce_algorithm(o.algorithms[impl]);
        c->allreduce(buf, o.op)->wait();
      };
      for (int i = 0; i < o.warmup; ++i)
        for (size_t k = 0; k < impls; ++k) run(k);
      std::vector<std::vector<double>> times(impls, std::vector<double>(static_cast<size_t>(o.iters)));
      for (int i = 0; i < o.iters; ++i)
        for (size_t k = 0; k < impls; ++k) {
          MPI_Barrier(raw);
          double t0 = now_s();
          run(k);
          times[k][static_cast<size_t>(i)] = now_s() - t0;
        }
      for (size_t k = 0; k < impls; ++k) {
        const bool is_raw = k == o.algorithms.size();
        const double t = slowest_rank_median(times[k], raw);
        std::string impl = "mpi-raw";
        int64_t wrong = -1;
        if (!is_raw) {
          c->set_allreduce_algorithm(o.algorithms[k]);
          impl = std::string("dtrain:") + comm::allreduce_algorithm_name(c->allreduce_plan(buf, o.op));
          if (o.check) {
            fill(host, rank);
            if (!dev.is_cpu()) copy_any(host, buf);
            c->allreduce(buf, o.op)->wait();
            if (!dev.is_cpu()) copy_any(buf, host);
            wrong = count_wrong(host, ranks);
            MPI_Allreduce(MPI_IN_PLACE, &wrong, 1, MPI_INT64_T, MPI_SUM, raw);
            total_wrong += wrong;
          }
        }
        const double alg = comm::alg_bandwidth(static_cast<double>(nbytes), t) / 1e9;
        if (rank == 0)
          std::printf("  %12lld %12lld %6s %6s %12s %12.1f %12.3f %12.3f %8s\n", static_cast<long long>(nbytes),
                      static_cast<long long>(count), dtype_name(dt), comm::reduce_op_name(o.op), impl.c_str(), t * 1e6,
                      alg, alg * bus, o.check && !is_raw ? std::to_string(wrong).c_str() : "-");
        if (dt == DType::F32 && nbytes >= (int64_t{64} << 20) && o.baseline)
          (is_raw ? sum_raw_bw : best_bw[k]) += alg * bus;
      }
      if (bytes > o.max_bytes / o.factor) break;  // no overflow past the last row
    }
  }
  if (rank == 0 && sum_raw_bw > 0)
    for (size_t k = 0; k < o.algorithms.size(); ++k)
      std::printf("# f32 busBw at >= 64 MiB: dtrain --allreduce %s / raw MPI_Allreduce = %.2fx\n",
                  comm::allreduce_algorithm_name(o.algorithms[k]), best_bw[k] / sum_raw_bw);

  if (!o.compressors.empty()) {
    if (rank == 0) {
      std::printf(
          "#\n# gradient compressors on f32 buckets, op avg, %d iterations; algBw/busBw from the "
          "uncompressed size\n",
          o.compressor_iters);
      std::printf("# %12s %14s %12s %12s %12s %14s %8s %14s %14s\n", "size", "compressor", "time(us)", "algbw(GB/s)",
                  "busbw(GB/s)", "sent/rank(B)", "ratio", "encode(ms/MiB)", "decode(ms/MiB)");
    }
    for (const std::string& spec : o.compressors) {
      for (int64_t bytes = std::max<int64_t>(o.min_bytes, 4); bytes <= comp_max; bytes *= o.factor) {
        int64_t count = std::max<int64_t>(1, bytes / 4);
        auto comp = comm::make_compressor(spec);
        Tensor h = Tensor::empty({count}), g = zeros_on({count}, dev);  // the bucket where the engine is
        comp->reduce(g, *c, ReduceOp::Avg)->wait();                     // warm-up: allocates state
        comp = comm::make_compressor(spec);
        Engine& e = engine_for(dev);
        double t = 0;
        for (int i = 0; i < o.compressor_iters; ++i) {
          for (int64_t j = 0; j < count; ++j) h.f32()[j] = static_cast<float>(pattern(DType::F32, rank, j + i));
          copy_any(h, g);
          e.synchronize();
          MPI_Barrier(raw);
          double t0 = now_s();
          comp->reduce(g, *c, ReduceOp::Avg)->wait();
          e.synchronize();  // the decoding queued on a GPU belongs to the time
          t += now_s() - t0;
        }
        t = max_over_ranks(t / o.compressor_iters, raw);
        const comm::CompressionStats& s = comp->stats();
        double mib = static_cast<double>(s.bytes_in) / (1 << 20);
        double enc = max_over_ranks(s.compress_s, raw) / mib * 1e3,
               dec = max_over_ranks(s.decompress_s, raw) / mib * 1e3;
        double alg = comm::alg_bandwidth(static_cast<double>(count * 4), t) / 1e9;
        if (rank == 0)
          std::printf(
              "  %12lld %14s %12.1f %12.3f %12.3f %14lld %8.1f %14.3f %14.3f\n", static_cast<long long>(count * 4),
              comp->name().c_str(), t * 1e6, alg, alg * bus, static_cast<long long>(s.last_bytes_sent),
              static_cast<double>(count * 4) / static_cast<double>(std::max<int64_t>(1, s.last_bytes_sent)), enc, dec);
        if (bytes > comp_max / o.factor) break;
      }
    }
  }
  MPI_Comm_free(&raw);
  if (total_wrong > 0) {
    if (rank == 0)
      std::printf("# FAILED: %lld elements differ from the expected sums\n", static_cast<long long>(total_wrong));
    return 1;
  }
  return 0;
}

}  // namespace dtrain::cli
