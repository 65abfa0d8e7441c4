#pragma once
// Image folders (one subfolder per class, as ImageNet's and torchvision's ImageFolder) to dtrain's
// HDF5 shards: JPEG through libjpeg-turbo, PNG through libpng, each image's shorter side resized to
// the output size (antialiased bilinear, as PIL's) and its centre cropped square.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "dtrain/data/convert.h"

namespace dtrain::data {

// A decoded image: height x width x channels bytes, interleaved (HWC).
struct DecodedImage {
  int height = 0, width = 0, channels = 0;
  std::vector<uint8_t> pixels;
};

// Decodes the JPEG or PNG file at `path` (told apart by its first bytes, not its name) into
// `channels` channels (3: RGB, 1: grey; grey, palette, alpha and CMYK sources are converted). A JPEG
// is decoded at 1/2, 1/4 or 1/8 scale (libjpeg's scaled inverse DCT) when its shorter side stays at
// least `min_shorter_side` pixels. Throws InputError naming the file when it is unreadable, of another
// format, truncated or corrupt.
DecodedImage decode_image(const std::string& path, int channels, int min_shorter_side = 0);

// Resizes `image` so that its shorter side is `size` pixels (the longer side scaled and truncated,
// as torchvision's Resize), with PIL's antialiased bilinear filter, and writes the centred
// size x size crop (offsets rounded as torchvision's CenterCrop) to `chw`, channel-major.
void resize_and_center_crop(const DecodedImage& image, int size, uint8_t* chw);

struct ImageFolderOptions {
  int size = 0;               // output side S: samples are [channels, S, S]
  int channels = 3;           // 3 (RGB) or 1 (grey)
  double val_fraction = 0;    // > 0: that share of each class goes to OUT/val, the rest to OUT/train
  uint64_t seed = 0;          // of the split and of the sample order in the shards
  int threads = 0;            // decoding threads; 0: every core this process may use
  bool strict = false;        // an unreadable image fails the conversion instead of being skipped
  ShardWriterOptions writer;  // shard size, chunk, compression
  // Called from the converting thread now and then with the images done and the total.
  std::function<void(int64_t done, int64_t total)> progress;
};

struct SkippedImage {
  std::string path, reason;
};

struct ImageFolderSummary {
  std::vector<std::string> classes;    // class names: the subfolders, sorted; label i is classes[i]
  std::vector<ConvertSummary> splits;  // OUT alone, or OUT/train then OUT/val
  std::vector<SkippedImage> skipped;   // unreadable images left out
  int64_t ignored_files = 0;           // files that are not .jpg, .jpeg or .png (any case)
};

// Converts the class folders under `root` into shards in `out_dir` (or out_dir/train and
// out_dir/val with a validation fraction). Every class folder is walked recursively. The samples are
// written in an order shuffled by `seed`, so that every shard mixes the classes. Throws InputError
// for a missing root, a root without class folders, a class folder without images, bad options, or
// (with `strict`) the first unreadable image; whatever was half written is removed.
ImageFolderSummary convert_image_folder(const std::string& root, const std::string& out_dir,
                                        const ImageFolderOptions& opt);

}  // namespace dtrain::data
