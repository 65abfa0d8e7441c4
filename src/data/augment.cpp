#include "dtrain/data/augment.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "dtrain/core/rng.h"

namespace dtrain::data {

namespace {
constexpr uint64_t kAugmentStream = 0xa06;  // keeps augmentation draws apart from the sampler's
}

AugmentDraw draw_augment(const AugmentOptions& opt, uint64_t seed, int64_t epoch, int64_t sample_index) {
  uint64_t s = derive_seed(derive_seed(derive_seed(seed, kAugmentStream), static_cast<uint64_t>(epoch)),
                           static_cast<uint64_t>(sample_index));
  Rng rng(s);
  // Always draw in the same order so each choice does not depend on which others are enabled.
  const uint64_t span = 2 * static_cast<uint64_t>(std::max(opt.crop_padding, 0)) + 1;
  AugmentDraw d;
  d.dy = static_cast<int>(rng.below(span)) - opt.crop_padding;
  d.dx = static_cast<int>(rng.below(span)) - opt.crop_padding;
  bool flip = rng.uniform() < 0.5f;
  float angle = rng.uniform(-1.0f, 1.0f) * opt.rotate_deg;
  if (opt.crop_padding <= 0) d.dy = d.dx = 0;
  d.flip = opt.hflip && flip;
  d.angle_deg = opt.rotate_deg > 0 ? angle : 0.0f;
  return d;
}

void apply_augment(const AugmentDraw& d, float* image, int64_t channels, int64_t height, int64_t width,
                   std::vector<float>& scratch) {
  const int64_t plane = height * width;
  scratch.resize(static_cast<size_t>(plane));
  float* tmp = scratch.data();

  if (d.angle_deg != 0.0f) {
    // out(y, x) = in(R(-angle) (p - centre) + centre), bilinear; neighbours outside the image are 0.
    const float rad = d.angle_deg * 3.14159265358979f / 180.0f;
    const float c = std::cos(rad), s = std::sin(rad);
    const float cy = 0.5f * static_cast<float>(height - 1), cx = 0.5f * static_cast<float>(width - 1);
    for (int64_t ch = 0; ch < channels; ++ch) {
      float* img = image + ch * plane;
      auto at = [&](int64_t y, int64_t x) {
        return (y >= 0 && y < height && x >= 0 && x < width) ? img[y * width + x] : 0.0f;
      };
      for (int64_t y = 0; y < height; ++y) {
        for (int64_t x = 0; x < width; ++x) {
          const float ry = static_cast<float>(y) - cy, rx = static_cast<float>(x) - cx;
          const float sy = c * ry - s * rx + cy;
          const float sx = s * ry + c * rx + cx;
          const float fy = std::floor(sy), fx = std::floor(sx);
          const int64_t y0 = static_cast<int64_t>(fy), x0 = static_cast<int64_t>(fx);
          const float wy = sy - fy, wx = sx - fx;
          tmp[y * width + x] = (1 - wy) * ((1 - wx) * at(y0, x0) + wx * at(y0, x0 + 1)) +
                               wy * ((1 - wx) * at(y0 + 1, x0) + wx * at(y0 + 1, x0 + 1));
        }
      }
      std::memcpy(img, tmp, static_cast<size_t>(plane) * sizeof(float));
    }
  }

  if (d.dy != 0 || d.dx != 0 || d.flip) {
    // Crop of the zero-padded image, then mirror: out(y, x) = in(y + dy, x' + dx), x' = W-1-x if flipped.
    for (int64_t ch = 0; ch < channels; ++ch) {
      float* img = image + ch * plane;
      for (int64_t y = 0; y < height; ++y) {
        const int64_t sy = y + d.dy;
        for (int64_t x = 0; x < width; ++x) {
          const int64_t sx = (d.flip ? width - 1 - x : x) + d.dx;
          tmp[y * width + x] = (sy >= 0 && sy < height && sx >= 0 && sx < width) ? img[sy * width + sx] : 0.0f;
        }
      }
      std::memcpy(img, tmp, static_cast<size_t>(plane) * sizeof(float));
    }
  }
}

}  // namespace dtrain::data
