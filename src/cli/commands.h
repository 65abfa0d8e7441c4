#pragma once
// The dtrain executable's subcommands. Each takes the arguments after its own name
// (argv[0] is the subcommand) and returns the process exit code; errors are thrown as
// dtrain::InputError / dtrain::Error and reported by main().

namespace dtrain::cli {

int cmd_train(int argc, char** argv);            // src/cli/cmd_train.cpp
int cmd_eval(int argc, char** argv);             // src/cli/cmd_eval.cpp
int cmd_quantize(int argc, char** argv);         // src/cli/cmd_quantize.cpp (int8 checkpoint)
int cmd_prune_export(int argc, char** argv);     // src/cli/cmd_prune_export.cpp (pruned channels cut out)
int cmd_info(int argc, char** argv);             // src/cli/cmd_info.cpp
int cmd_convert(int argc, char** argv);          // src/cli/cmd_convert.cpp   (dtrain convert idx|cifar10 ...)
int cmd_bench(int argc, char** argv);            // src/cli/cmd_bench.cpp     (dispatches the bench kinds)
int cmd_bench_gemm(int argc, char** argv);       // src/cli/cmd_bench_gemm.cpp
int cmd_bench_allreduce(int argc, char** argv);  // src/cli/cmd_bench_allreduce.cpp
int cmd_bench_lm_gemm(int argc, char** argv);    // src/cli/cmd_bench_lm_gemm.cpp
int cmd_bench_attention(int argc, char** argv);  // src/cli/cmd_bench_attention.cpp
int cmd_generate(int argc, char** argv);         // src/cli/cmd_generate.cpp (samples from a GPT checkpoint)
int cmd_export(int argc, char** argv);           // src/cli/cmd_export.cpp (weights as safetensors / HDF5)
int cmd_convert_text(int argc, char** argv);  // src/cli/cmd_convert.cpp (dtrain convert text)

}  // namespace dtrain::cli
