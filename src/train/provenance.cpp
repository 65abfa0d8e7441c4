#include "dtrain/train/provenance.h"


#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "dtrain/comm/nccl.h"
#include "dtrain/comm/runtime.h"
#include "dtrain/data/hdf5_util.h"
#include "dtrain/kernels/engine.h"
#if defined(DTRAIN_WITH_CUDA_ENGINE)
#include "dtrain/kernels/cuda.h"
#endif

namespace dtrain::train {

namespace {

// "AMD EPYC (avx512f avx512_bf16)": the model name and the vector extensions that decide the CPU
// engine's kernels (figures from processors with and without AVX512-BF16 are not comparable).
std::string processor_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line, name = "unknown", flags;
  while (std::getline(in, line) && (name == "unknown" || flags.empty())) {
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    if (line.rfind("model name", 0) == 0) name = line.substr(colon + 2);
    if (line.rfind("flags", 0) == 0) flags.assign(line, colon + 1).push_back(' ');  // " fpu ... avx2 ... "
  }
  std::string isa;
  for (const char* f : {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})
    if (flags.find(std::string(1, ' ').append(f).append(" ")) != std::string::npos) {
      if (!isa.empty()) isa += ' ';
      isa += f;
    }
  return isa.empty() ? name : name + " (" + isa + ")";
}

// key = value lines of an INI text (comments and blank lines skipped).
std::map<std::string, std::string> ini_values(const std::string& ini) {
  std::map<std::string, std::string> out;
  std::istringstream in(ini);
  std::string line;
  while (std::getline(in, line)) {
    const size_t eq = line.find(" = ");
    if (line.empty() || line[0] == '#' || eq == std::string::npos) continue;
    out[line.substr(0, eq)] = line.substr(eq + 3);
  }
  return out;
}

// The "config" field of a provenance line written by to_json (escaped newlines and quotes).
std::string config_of(const std::string& provenance_json) {
  const std::string key = "\"config\": \"";
  const size_t at = provenance_json.find(key);
  if (at == std::string::npos) return "";
  std::string out;
  for (size_t i = at + key.size(); i < provenance_json.size() && provenance_json[i] != '"'; ++i) {
    if (provenance_json[i] == '\\' && i + 1 < provenance_json.size()) {
      ++i;
      out += provenance_json[i] == 'n' ? '\n' : provenance_json[i];
    } else {
      out += provenance_json[i];
    }
  }
  return out;
}

}  // namespace

JsonFields run_provenance(const std::string& layout, const std::string& config_ini) {
  comm::Topology topo;  // a library caller without the MPI bootstrap: no MPI library, this host unnamed
  if (comm::Runtime::initialized()) topo = comm::Runtime::get().topology();
  JsonFields f{{"provenance", std::string("dtrain ") + DTRAIN_VERSION},
               {"git_commit", std::string(DTRAIN_GIT_COMMIT)},
               {"onednn", onednn_version()},
               {"mpi", topo.mpi_library},
               {"hdf5", data::h5::library_version()}};
#if defined(DTRAIN_WITH_CUDA_ENGINE)
  f.push_back({"cuda", cuda::library_versions()});
#endif
  if (comm::nccl_compiled()) f.push_back({"nccl", comm::nccl_version()});
  f.push_back({"host", topo.host});
  f.push_back({"processor", processor_name()});
  f.push_back({"world", layout});
  f.push_back({"config", config_ini});
  return f;
}

std::string resume_changes(const std::string& checkpoint_provenance, const std::string& config_ini) {
  const std::string then_ini = config_of(checkpoint_provenance);
  if (then_ini.empty()) return "";  // a checkpoint from before provenance
  std::map<std::string, std::string> then = ini_values(then_ini), now = ini_values(config_ini);
  for (auto* values : {&then, &now}) values->erase("resume");  // how this launch starts, not the run
  std::set<std::string> keys;
  for (const auto* values : {&then, &now})
    for (const auto& [key, value] : *values) keys.insert(key);
  std::string changed;
  for (const std::string& key : keys) {
    const auto a = then.find(key), b = now.find(key);
    const std::string was = a == then.end() ? "(none)" : a->second, is = b == now.end() ? "(none)" : b->second;
    if (was == is) continue;
    if (!changed.empty()) changed += ", ";
    changed.append("--").append(key).append(" ").append(was).append(" -> ").append(is);
  }
  return changed.empty() ? "" : "resume: changed since the checkpoint: " + changed;
}

}  // namespace dtrain::train
