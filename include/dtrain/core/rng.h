#pragma once
// A small counter-friendly RNG (xoshiro256**, seeded by splitmix64). Its whole state is four
// 64-bit words, saved in checkpoints so that a resumed run draws the same numbers.
#include <array>
#include <cstddef>
#include <cstdint>
#include <utility>

namespace dtrain {

class Rng {
 public:
  explicit Rng(uint64_t seed = 0x5eed);
  uint64_t next();
  float uniform();                  // [0, 1)
  float uniform(float lo, float hi);
  float normal();                   // N(0, 1), Box-Muller
  uint64_t below(uint64_t n);       // [0, n), unbiased
  std::array<uint64_t, 4> state() const { return s_; }
  void set_state(const std::array<uint64_t, 4>& s) { s_ = s; }

 private:
  std::array<uint64_t, 4> s_{};
};

// Fisher-Yates: a uniform permutation of `items` drawn from `rng`.
template <typename Vector>
void shuffle(Vector& items, Rng& rng) {
  for (std::size_t i = items.size(); i > 1; --i) std::swap(items[i - 1], items[rng.below(i)]);
}

// Seeds derived from one seed: distinct, reproducible streams per (seed, stream) pair.
uint64_t derive_seed(uint64_t seed, uint64_t stream);

}  // namespace dtrain
