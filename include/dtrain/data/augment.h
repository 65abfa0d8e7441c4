#pragma once
// Image augmentation for the data loader, on float images [C, H, W] in pixel/255 units (before
// normalisation, so padding and the corners a rotation uncovers are black, as in torchvision).
// Every random choice is drawn from (seed, epoch, sample index) alone, so a sample is augmented the
// same way whichever loader thread builds it and however many threads there are.
#include <cstdint>
#include <vector>

namespace dtrain::data {

struct AugmentOptions {
  int crop_padding = 0;  // random crop of the image zero-padded by this many pixels per side; 0: off
  bool hflip = false;    // horizontal flip with probability 0.5
  float rotate_deg = 0;  // rotation by a uniform angle in [-rotate_deg, rotate_deg], bilinear; 0: off

  bool enabled() const { return crop_padding > 0 || hflip || rotate_deg > 0; }
};

// The random choices for one sample.
struct AugmentDraw {
  int dy = 0, dx = 0;  // crop offset in [-crop_padding, crop_padding]: out(y, x) = in(y + dy, x + dx)
  bool flip = false;
  float angle_deg = 0;
};

AugmentDraw draw_augment(const AugmentOptions& opt, uint64_t seed, int64_t epoch, int64_t sample_index);

// Applies `d` to `image` [C, H, W] in place: rotation about the centre, then the crop shift, then the
// flip. `scratch` is resized as needed (one per thread avoids reallocating).
void apply_augment(const AugmentDraw& d, float* image, int64_t channels, int64_t height, int64_t width,
                   std::vector<float>& scratch);

}  // namespace dtrain::data
