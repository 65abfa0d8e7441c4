#include "dtrain/train/sweep.h"

#include <algorithm>
#include <boost/property_tree/json_parser.hpp>
#include <boost/property_tree/ptree.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "dtrain/core/error.h"
#include "dtrain/core/rng.h"
#include "dtrain/train/metrics.h"
#include "dtrain/train/trainer.h"

namespace dtrain::train {

namespace fs = std::filesystem;

namespace {

// One --sweep spec "OPTION=V1,V2,...": the option's name (without "--") and its values.
std::pair<std::string, std::vector<std::string>> parse_spec(const std::string& spec, std::set<std::string>& seen) {
  const size_t eq = spec.find('=');
  DT_INPUT_CHECK(eq != std::string::npos && eq > 0 && eq + 1 < spec.size(),
                 "option --sweep '" << spec << "' is not OPTION=V1,V2,...");
  std::string name = spec.substr(0, eq);
  if (name.starts_with("--")) name = name.substr(2);
  DT_INPUT_CHECK(seen.insert(name).second, "option --sweep gives " << name << " twice");
  std::vector<std::string> values;
  std::stringstream list(spec.substr(eq + 1));
  for (std::string v; std::getline(list, v, ',');) {
    DT_INPUT_CHECK(!v.empty(), "option --sweep '" << spec << "' has an empty value");
    values.push_back(v);
  }
  DT_INPUT_CHECK(!spec.ends_with(","), "option --sweep '" << spec << "' has an empty value");
  return {name, values};
}

// "LO:HI" or "LO:HI:log" with LO and HI numbers: a range of --sweep-random (else a plain value).
std::vector<std::string> range_parts(const std::string& v) {
  std::vector<std::string> parts;
  std::stringstream range(v);
  for (std::string part; std::getline(range, part, ':');) parts.push_back(part);
  if (parts.size() < 2 || parts.size() > 3 || (parts.size() == 3 && parts[2] != "log")) return {};
  for (size_t i = 0; i < 2; ++i) {
    size_t used = 0;
    try {
      if (!std::isfinite(std::stod(parts[i], &used)) || used != parts[i].size()) return {};
    } catch (const std::exception&) {
      return {};
    }
  }
  return parts;
}
bool is_range(const std::string& v) { return !range_parts(v).empty(); }

// One value drawn from a --sweep-random spec's values: one of a list (or the one value), or from
// a range "LO:HI" (uniform; integers when both ends are written as integers) or "LO:HI:log"
// (log-uniform).
std::string draw(const std::string& spec, const std::vector<std::string>& values, Rng& rng) {
  const std::vector<std::string> parts = values.size() == 1 ? range_parts(values.front()) : std::vector<std::string>{};
  if (parts.empty()) return values[rng.below(values.size())];
  const double lo = std::stod(parts[0]), hi = std::stod(parts[1]);
  const bool log = parts.size() == 3;
  DT_INPUT_CHECK(lo < hi, "option --sweep '" << spec << "': the range's low end must be below its high end");
  DT_INPUT_CHECK(!log || lo > 0, "option --sweep '" << spec << "': a log range needs a positive low end");
  const double u = rng.uniform();
  const double v = log ? std::exp(std::log(lo) + u * (std::log(hi) - std::log(lo))) : lo + u * (hi - lo);
  auto whole = [](const std::string& t) { return t.find_first_of(".eE") == std::string::npos; };
  if (whole(parts[0]) && whole(parts[1]))
    return std::to_string(std::clamp(std::llround(v), std::llround(lo), std::llround(hi)));
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4g", v);
  return buf;
}

}  // namespace

std::vector<SweepPoint> sweep_grid(const std::vector<std::string>& specs) {
  std::vector<SweepPoint> grid{{}};
  std::set<std::string> seen;
  for (const std::string& spec : specs) {
    const auto [name, values] = parse_spec(spec, seen);
    for (const std::string& v : values)
      DT_INPUT_CHECK(!is_range(v), "option --sweep '" << spec << "': a range (" << v << ") needs --sweep-random N");
    std::vector<SweepPoint> next;
    for (const SweepPoint& p : grid)
      for (const std::string& v : values) {
        next.push_back(p);
        next.back().emplace_back(name, v);
      }
    grid = std::move(next);
  }
  return grid;
}

std::vector<SweepPoint> sweep_random(const std::vector<std::string>& specs, int count, uint64_t seed) {
  DT_INPUT_CHECK(count >= 1, "option --sweep-random " << count << " draws no configuration");
  DT_INPUT_CHECK(!specs.empty(), "option --sweep-random needs --sweep specs to draw from");
  std::vector<std::pair<std::string, std::vector<std::string>>> parsed;
  std::set<std::string> seen;
  for (const std::string& spec : specs) parsed.push_back(parse_spec(spec, seen));
  std::vector<SweepPoint> points(static_cast<size_t>(count));
  for (int i = 0; i < count; ++i) {
    Rng rng(derive_seed(seed, 5000 + static_cast<uint64_t>(i)));  // the same draws on every rank
    for (size_t s = 0; s < parsed.size(); ++s)
      points[static_cast<size_t>(i)].emplace_back(parsed[s].first, draw(specs[s], parsed[s].second, rng));
  }
  return points;
}

std::vector<std::string> without_options(const std::vector<std::string>& args, const std::vector<std::string>& names) {
  std::vector<std::string> out;
  for (size_t i = 0; i < args.size(); ++i) {
    bool dropped = false;
    for (const std::string& n : names) {
      if (args[i] == "--" + n) {  // "--name value" (a switch given alone takes no value)
        dropped = true;
        if (i + 1 < args.size() && !args[i + 1].starts_with("--")) ++i;
      }
      dropped |= args[i].starts_with("--" + n + "=");
      if (dropped) break;
    }
    if (!dropped) out.push_back(args[i]);
  }
  return out;
}

namespace {

constexpr int kFields = 7, kMessage = 240;  // a trainer's record in the gather: figures, then message bytes
enum Status { kNotRun = 0, kOk, kDiverged, kFailed, kPreempted };
const char* const kStatusNames[] = {"not run", "ok", "diverged", "failed", "preempted"};

std::string fixed_text(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", v);
  return buf;
}

std::string point_text(const SweepPoint& p) {
  std::string t;
  for (const auto& [k, v] : p) t += (t.empty() ? "" : " ") + k + "=" + v;
  return t.empty() ? "(base configuration)" : t;
}

class TrainerGroups {
 public:
  TrainerGroups(int argc, char** argv, const TrainConfig& cfg, comm::Runtime& rt)
      : args_(argv, argv + argc),
        cfg_(cfg),
        rt_(rt),
        grid_(cfg.sweep_random > 0 ? sweep_random(cfg.sweep, cfg.sweep_random, cfg.seed) : sweep_grid(cfg.sweep)) {
    comm::Communicator& world = rt.world();
    DT_INPUT_CHECK(world.size() % cfg.trainers == 0,
                   "option --trainers " << cfg.trainers << " does not divide the " << world.size() << " ranks");
    const int size = world.size() / cfg.trainers;
    DT_INPUT_CHECK(cfg.pbt_every == 0 || (cfg.trainers >= 2 && static_cast<size_t>(cfg.trainers) == grid_.size()),
                   "option --pbt-every needs every configuration training at once: --trainers "
                       << grid_.size() << " for the " << grid_.size() << " --sweep configuration(s), at least 2");
    group_size_ = size;
    DT_INPUT_CHECK(cfg.pbt_every == 0 || is_language_model(cfg.model) || !cfg.test_data.empty(),
                   "option --pbt-every ranks the trainers by their validation: it needs --test-data");
    DT_INPUT_CHECK(cfg.pbt_every == 0 || cfg.steps > 0,
                   "option --pbt-every needs --steps (every trainer meets the "
                   "others at the same steps)");
    for (const auto& [k, v] : grid_.front())
      DT_INPUT_CHECK(cfg.pbt_every == 0 || (k != "steps" && k != "epochs" && k != "pbt-every"),
                     "option --pbt-every: the trainers must run the same steps, so --sweep cannot set " << k);
    group_index_ = world.rank() / size;
    group_ = world.split(group_index_, world.rank(), "trainers-" + std::to_string(group_index_));
    // The nodes the group spans: highest index and minus the lowest, by one max.
    Tensor nodes = Tensor::from({2}, std::vector<float>{static_cast<float>(rt.topology().node_index),
                                                        -static_cast<float>(rt.topology().node_index)});
    group_->allreduce(nodes, comm::ReduceOp::Max)->wait();
    const int last = static_cast<int>(nodes.f32()[0]), first = static_cast<int>(-nodes.f32()[1]);
    nodes_ =
        first == last ? "node " + std::to_string(first) : "nodes " + std::to_string(first) + "-" + std::to_string(last);
  }

  int run() {
    std::vector<TrainerOutcome> mine;
    for (size_t i = static_cast<size_t>(group_index_); i < grid_.size(); i += static_cast<size_t>(cfg_.trainers)) {
      mine.push_back(train_one(static_cast<int>(i)));
      if (mine.back().status == "preempted") break;  // the job is ending: the rest start after the requeue
    }
    const std::vector<TrainerOutcome> all = gather(mine);
    if (rt_.world().rank() == 0) summarize(all);
    for (const TrainerOutcome& o : all) {
      if (o.status == "failed") return kExitBadInput;
      if (o.status == "diverged") return kExitDiverged;
    }
    for (const TrainerOutcome& o : all)
      if (o.status != "ok") return kExitPreempted;
    return kExitDone;
  }

 private:
  std::string folder(int i) const { return (fs::path(cfg_.sweep_dir) / ("trainer-" + std::to_string(i))).string(); }

  // The trainer's own command line: the shared options, its sweep values, seed and folder.
  std::vector<std::string> trainer_args(int i) const {
    std::vector<std::string> drop = {"trainers", "sweep",   "sweep-random",   "sweep-dir",
                                     "seed",     "metrics", "checkpoint-dir", "resume"};
    if (cfg_.trainers > 1) drop.push_back("progress");  // several groups' bars would overwrite each other
    for (const auto& [k, v] : grid_[static_cast<size_t>(i)]) drop.push_back(k);
    std::vector<std::string> a = without_options(args_, drop);
    const std::string dir = folder(i), checkpoints = dir + "/checkpoints";
    a.insert(a.end(), {"--seed", std::to_string(cfg_.seed + static_cast<uint64_t>(i)), "--metrics",
                       dir + "/metrics.jsonl", "--checkpoint-dir", checkpoints});
    if (cfg_.trainers > 1) a.insert(a.end(), {"--progress", "off"});
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(checkpoints, ec))
      if (e.path().filename().string().starts_with("ckpt-")) {  // a trainer stopped early: it resumes
        a.insert(a.end(), {"--resume", checkpoints});
        break;
      }
    for (const auto& [k, v] : grid_[static_cast<size_t>(i)]) a.insert(a.end(), {"--" + k, v});
    return a;
  }

  TrainerOutcome train_one(int i) {
    TrainerOutcome o;
    o.index = i;
    o.point = grid_[static_cast<size_t>(i)];
    const bool speaker = group_->rank() == 0;
    const std::string result_file = folder(i) + "/result.json";
    if (fs::exists(result_file)) {  // finished before a requeue: its figures stand
      read_result(result_file, o);
      if (speaker)
        std::printf("trainer %d (%s): finished before, %s\n", i, point_text(o.point).c_str(), o.status.c_str());
      return o;
    }
    if (speaker)
      std::printf("trainer %d/%zu (%s) on ranks %d-%d, %s\n", i, grid_.size(), point_text(o.point).c_str(),
                  rt_.world().rank(), rt_.world().rank() + group_->size() - 1, nodes_.c_str());
    std::vector<std::string> a = trainer_args(i);
    std::vector<char*> argv;
    for (auto& s : a) argv.push_back(s.data());
    const auto t0 = std::chrono::steady_clock::now();
    try {
      TrainConfig c;
      parse_train_config(static_cast<int>(argv.size()), argv.data(), c);
      Trainer trainer(c, rt_, group_.get());
      if (cfg_.pbt_every > 0)
        trainer.set_step_hook(cfg_.pbt_every, [&](int64_t step) { tournament(trainer, i, step); });
      const TrainResult r = trainer.run();
      o.status = r.preempted_by != 0 ? "preempted" : "ok";
      o.accuracy = r.last_eval.accuracy;
      o.val_loss = r.last_eval.loss;
      o.units_per_s = r.units_per_s;
      o.steps = r.steps;
      if (cfg_.target_accuracy > 0 && group_->rank() == 0) o.time_to_target_s = time_to_target(c.metrics);
    } catch (const DivergenceError& e) {
      o.status = "diverged";
      o.message = e.what();
    } catch (const InputError& e) {
      o.status = "failed";
      o.message = e.what();
    }
    if (cfg_.pbt_every > 0 && !o.message.empty()) sit_out_tournaments(i);
    o.time_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (speaker) {
      if (!o.message.empty()) std::printf("trainer %d stopped (%s): %s\n", i, o.status.c_str(), o.message.c_str());
      if (o.status != "preempted") write_result(result_file, o);
      std::fflush(stdout);
    }
    return o;
  }

  // Population-based training's exploit and explore (LBANN's tournament): every trainer's validation
  // metric and hyperparameters go to every rank; the trainers pair up by a permutation drawn from
  // the seed and the round; in each pair the worse one's ranks receive the better one's parameters,
  // buffers and optimizer state from the ranks at the same place in its group (point to point),
  // take its learning rate and momentum and multiply the learning rate and 1 - momentum each by 0.8
  // or 1.25. Rank 0 logs each exchange
  // and appends it to <sweep-dir>/pbt.jsonl.
  void tournament(Trainer& t, int me, int64_t step) {
    const EvalResult e = t.evaluate();
    play_round(&t, me, step, static_cast<float>(is_language_model(cfg_.model) ? -e.loss : e.accuracy));
  }

  // A trainer that stopped still meets the others at every remaining round (they wait for its
  // score), always losing and taking nothing.
  void sit_out_tournaments(int me) {
    for (int64_t step = (rounds_played_ + 1) * cfg_.pbt_every; step < cfg_.steps; step += cfg_.pbt_every)
      play_round(nullptr, me, step, kStopped);
  }

  static constexpr float kStopped = -1e30f;

  void play_round(Trainer* t, int me, int64_t step, float metric) {
    ++rounds_played_;
    const int k = cfg_.trainers;
    const bool by_loss = is_language_model(cfg_.model);
    Tensor scores = Tensor::zeros({3 * k});  // per trainer: metric (higher is better), lr, momentum
    if (group_->rank() == 0) {
      scores.f32()[3 * me] = metric;
      scores.f32()[3 * me + 1] = t ? t->base_lr() : 0.f;
      scores.f32()[3 * me + 2] = t ? t->momentum() : 0.f;
    }
    comm::Communicator& world = rt_.world();
    world.allreduce(scores)->wait(0);
    const float* f = scores.f32();
    Rng pairing(derive_seed(cfg_.seed, 7000 + static_cast<uint64_t>(step)));
    std::vector<int> order(static_cast<size_t>(k));
    for (int i = 0; i < k; ++i) order[static_cast<size_t>(i)] = i;
    shuffle(order, pairing);
    for (size_t p = 0; p + 1 < order.size(); p += 2) {
      const int a = order[p], b = order[p + 1];
      const int winner = f[3 * a] >= f[3 * b] ? a : b, loser = winner == a ? b : a;
      Rng explore(derive_seed(cfg_.seed, 9000 + static_cast<uint64_t>(step) * 1000 + static_cast<uint64_t>(loser)));
      const float lr = f[3 * winner + 1] * (explore.uniform() < 0.5f ? 0.8f : 1.25f);
      // Momentum moves by its distance from 1 (0.9 -> 0.875 or 0.92), as its time constant does.
      const float momentum =
          std::clamp(1.f - (1.f - f[3 * winner + 2]) * (explore.uniform() < 0.5f ? 0.8f : 1.25f), 0.f, 0.999f);
      if (f[3 * loser] <= kStopped) continue;  // nothing to take for a stopped trainer
      if (me == winner || me == loser) exchange_state(*t, me == winner, (me == winner ? loser : winner) - me);
      if (me == loser) {
        t->set_base_lr(lr);
        t->set_momentum(momentum);
      }
      if (world.rank() == 0) log_exchange(step, winner, loser, f, lr, momentum, by_loss);
    }
  }

  // Sends (the winner) or receives (the loser) this rank's state tensors to or from the rank at the
  // same place of the group `offset` groups away.
  void exchange_state(Trainer& t, bool send, int offset) {
    const int peer = rt_.world().rank() + offset * group_size_;
    std::vector<std::shared_ptr<comm::Work>> works;
    int tag = 0;
    for (Tensor* x : t.state_tensors())
      works.push_back(send ? rt_.world().send(*x, peer, tag++) : rt_.world().recv(*x, peer, tag++));
    for (auto& w : works) w->wait(0);
    if (!send) t.state_received();
  }

  void log_exchange(int64_t step, int winner, int loser, const float* f, float lr, float momentum, bool by_loss) const {
    auto metric = [&](int i) { return by_loss ? -f[3 * i] : 100 * f[3 * i]; };
    const char* unit = by_loss ? " val_loss" : " %";
    std::printf(
        "pbt step %lld: trainer %d (%.4g%s) takes trainer %d's state (%.4g%s): lr %.4g -> %.4g, momentum %.4g -> "
        "%.4g\n",
        static_cast<long long>(step), loser, metric(loser), unit, winner, metric(winner), unit, f[3 * loser + 1], lr,
        f[3 * loser + 2], momentum);
    std::fflush(stdout);
    fs::create_directories(cfg_.sweep_dir);
    std::ofstream log(cfg_.sweep_dir + "/pbt.jsonl", std::ios::app);
    log << to_json({{"step", step},
                    {"winner", static_cast<int64_t>(winner)},
                    {"loser", static_cast<int64_t>(loser)},
                    {by_loss ? "winner_val_loss" : "winner_accuracy", static_cast<double>(metric(winner))},
                    {by_loss ? "loser_val_loss" : "loser_accuracy", static_cast<double>(metric(loser))},
                    {"lr", static_cast<double>(lr)},
                    {"momentum", static_cast<double>(momentum)}})
        << "\n";
  }

  // The training time (evaluation excluded) of the first validation at --target-accuracy in a
  // trainer's metrics file, or -1.
  double time_to_target(const std::string& metrics) const {
    std::ifstream in(metrics);
    for (std::string line; std::getline(in, line);) {
      if (line.find("\"test_accuracy\"") == std::string::npos) continue;
      boost::property_tree::ptree t;
      std::istringstream json(line);
      boost::property_tree::read_json(json, t);
      if (100 * t.get<double>("test_accuracy") >= cfg_.target_accuracy) return t.get<double>("train_time_s");
    }
    return -1;
  }

  // A trainer's ending as JSON fields: its result.json, and its entry in summary.json.
  static void put_outcome(boost::property_tree::ptree& t, const TrainerOutcome& o) {
    t.put("status", o.status);
    t.put("message", o.message);
    t.put("accuracy", o.accuracy);
    t.put("val_loss", o.val_loss);
    t.put("time_s", o.time_s);
    t.put("units_per_s", o.units_per_s);
    t.put("steps", o.steps);
    t.put("time_to_target_s", o.time_to_target_s);
  }

  static void write_result(const std::string& path, const TrainerOutcome& o) {
    boost::property_tree::ptree t;
    put_outcome(t, o);
    fs::create_directories(fs::path(path).parent_path());
    boost::property_tree::write_json(path, t);
  }

  static void read_result(const std::string& path, TrainerOutcome& o) {
    boost::property_tree::ptree t;
    try {
      boost::property_tree::read_json(path, t);
      o.status = t.get<std::string>("status");
      o.message = t.get<std::string>("message", "");
      o.accuracy = t.get<double>("accuracy");
      o.val_loss = t.get<double>("val_loss");
      o.time_s = t.get<double>("time_s");
      o.units_per_s = t.get<double>("units_per_s");
      o.steps = t.get<int64_t>("steps");
      o.time_to_target_s = t.get<double>("time_to_target_s", -1);
    } catch (const boost::property_tree::ptree_error& e) {
      throw InputError("trainer result '" + path + "' is broken (" + e.what() + "): remove it to train again");
    }
  }

  // Every trainer's outcome on every rank: the rank 0 of the group that ran it fills its row, a sum
  // over the world (waiting without the communicator's timeout: groups end at their own times).
  std::vector<TrainerOutcome> gather(const std::vector<TrainerOutcome>& mine) {
    const int64_t n = static_cast<int64_t>(grid_.size()), width = kFields + kMessage;
    Tensor rows = Tensor::zeros({n, width});
    if (group_->rank() == 0)
      for (const TrainerOutcome& o : mine) {
        float* r = rows.f32() + o.index * width;
        const int status = static_cast<int>(std::find(std::begin(kStatusNames), std::end(kStatusNames), o.status) -
                                            std::begin(kStatusNames));
        const double fields[kFields] = {
            static_cast<double>(status),  o.accuracy,        o.val_loss, o.time_s, o.units_per_s,
            static_cast<double>(o.steps), o.time_to_target_s};
        for (int f = 0; f < kFields; ++f) r[f] = static_cast<float>(fields[f]);
        for (size_t c = 0; c < o.message.size() && c < kMessage; ++c)
          r[kFields + static_cast<int64_t>(c)] = static_cast<unsigned char>(o.message[c]);
      }
    rt_.world().allreduce(rows)->wait(0);
    std::vector<TrainerOutcome> all(grid_.size());
    for (int64_t i = 0; i < n; ++i) {
      const float* r = rows.f32() + i * width;
      TrainerOutcome& o = all[static_cast<size_t>(i)];
      o.index = static_cast<int>(i);
      o.point = grid_[static_cast<size_t>(i)];
      o.status = kStatusNames[std::clamp(static_cast<int>(r[0]), 0, 4)];
      o.accuracy = r[1];
      o.val_loss = r[2];
      o.time_s = r[3];
      o.units_per_s = r[4];
      o.steps = static_cast<int64_t>(r[5]);
      o.time_to_target_s = r[6];
      for (int c = 0; c < kMessage && r[kFields + c] != 0.f; ++c) o.message += static_cast<char>(r[kFields + c]);
    }
    return all;
  }

  // The table, best first by the validation metric (accuracy; the GPT: validation loss), the
  // trainers that did not finish last; and summary.json.
  void summarize(std::vector<TrainerOutcome> all) const {
    const bool by_loss = is_language_model(cfg_.model);
    std::stable_sort(all.begin(), all.end(), [&](const TrainerOutcome& a, const TrainerOutcome& b) {
      if ((a.status == "ok") != (b.status == "ok")) return a.status == "ok";
      return by_loss ? a.val_loss < b.val_loss : a.accuracy > b.accuracy;
    });
    std::printf("\nsweep: %zu configuration(s) on %d trainer group(s) of %d rank(s)\n", all.size(), cfg_.trainers,
                rt_.world().size() / cfg_.trainers);
    std::printf("%4s  %-9s  %9s  %9s  %9s  %12s  %9s  %s\n", "rank", "status", "accuracy", "val_loss", "time_s",
                "units/s", "to_target", "configuration (trainer)");
    boost::property_tree::ptree json, list;
    for (size_t r = 0; r < all.size(); ++r) {
      const TrainerOutcome& o = all[r];
      const std::string to_target = o.time_to_target_s < 0 ? "-" : fixed_text(o.time_to_target_s);
      std::printf("%4zu  %-9s  %8.2f%%  %9.4f  %9.1f  %12.0f  %9s  %s (%d)\n", r + 1, o.status.c_str(),
                  100 * o.accuracy, o.val_loss, o.time_s, o.units_per_s, to_target.c_str(), point_text(o.point).c_str(),
                  o.index);
      boost::property_tree::ptree e;
      e.put("trainer", o.index);
      e.put("folder", folder(o.index));
      for (const auto& [k, v] : o.point) e.put("config." + k, v);
      put_outcome(e, o);
      list.push_back({"", e});
    }
    json.put("ranked_by", by_loss ? "val_loss" : "accuracy");
    if (cfg_.target_accuracy > 0) json.put("target_accuracy", cfg_.target_accuracy);
    json.add_child("trainers", list);
    fs::create_directories(cfg_.sweep_dir);
    boost::property_tree::write_json(cfg_.sweep_dir + "/summary.json", json);
    std::printf("summary: %s/summary.json\n", cfg_.sweep_dir.c_str());
    std::fflush(stdout);
  }

  std::vector<std::string> args_;
  const TrainConfig& cfg_;
  comm::Runtime& rt_;
  std::vector<SweepPoint> grid_;
  int group_index_ = 0, group_size_ = 1;
  int64_t rounds_played_ = 0;
  std::string nodes_;  // "node 1" or "nodes 0-1": where this group's ranks are
  std::unique_ptr<comm::Communicator> group_;
};

}  // namespace

int run_trainer_groups(int argc, char** argv, const TrainConfig& cfg, comm::Runtime& rt) {
  return TrainerGroups(argc, argv, cfg, rt).run();
}

}  // namespace dtrain::train
