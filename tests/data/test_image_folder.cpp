// Image folders: decoding (JPEG, PNG), resize and centre crop, and the conversion into shards.
#include <filesystem>
#include <fstream>
#include <set>
#include <string>

#include <zlib.h>

#include "data_test_util.h"
#include "dtrain/data/dataset.h"
#include "dtrain/data/image_folder.h"
#include "image_test_util.h"

namespace dtrain::data {
namespace {

using testing::expect_input_error;
using testing::solid;
using testing::TempDir;

TEST(ImageDecode, PngIsLosslessInEveryLayout) {
  TempDir tmp;
  std::vector<uint8_t> rgb(5 * 3 * 3);
  for (size_t i = 0; i < rgb.size(); ++i) rgb[i] = static_cast<uint8_t>(i * 7);
  testing::write_png(tmp / "rgb.png", 5, 3, 3, rgb);
  DecodedImage img = decode_image(tmp / "rgb.png", 3);
  EXPECT_EQ(img.width, 5);
  EXPECT_EQ(img.height, 3);
  EXPECT_EQ(img.pixels, rgb);

  // Grey to RGB repeats the value; RGBA drops alpha that is opaque.
  testing::write_png(tmp / "grey.png", 2, 2, 1, {0, 50, 100, 250});
  EXPECT_EQ(decode_image(tmp / "grey.png", 3).pixels,
            (std::vector<uint8_t>{0, 0, 0, 50, 50, 50, 100, 100, 100, 250, 250, 250}));
  testing::write_png(tmp / "rgba.png", 1, 1, 4, {10, 20, 30, 255});
  EXPECT_EQ(decode_image(tmp / "rgba.png", 3).pixels, (std::vector<uint8_t>{10, 20, 30}));
}

TEST(ImageDecode, JpegCloseToItsSourceAndScaledByTheDct) {
  TempDir tmp;
  testing::write_jpeg(tmp / "c.jpg", 64, 48, 3, solid(64, 48, {200, 100, 50}), 100);
  DecodedImage img = decode_image(tmp / "c.jpg", 3);
  ASSERT_EQ(img.pixels.size(), 64u * 48 * 3);
  for (size_t i = 0; i < img.pixels.size(); ++i) EXPECT_NEAR(img.pixels[i], (std::vector<int>{200, 100, 50})[i % 3], 3);
  // Shorter side 48: 1/2 keeps 24 >= 20, 1/4 would give 12.
  DecodedImage half = decode_image(tmp / "c.jpg", 3, 20);
  EXPECT_EQ(half.width, 32);
  EXPECT_EQ(half.height, 24);
  DecodedImage grey = decode_image(tmp / "c.jpg", 1);
  EXPECT_EQ(grey.channels, 1);
  EXPECT_NEAR(grey.pixels[0], (200 * 299 + 100 * 587 + 50 * 114) / 1000, 3);
}

TEST(ImageDecode, BrokenFilesNameThemselves) {
  TempDir tmp;
  std::ofstream(tmp / "text.jpg") << "not an image at all";
  expect_input_error([&] { decode_image(tmp / "text.jpg", 3); }, {"text.jpg", "neither a JPEG nor a PNG"});
  expect_input_error([&] { decode_image(tmp / "missing.png", 3); }, {"missing.png", "cannot open"});

  std::vector<uint8_t> px(40 * 40 * 3);
  for (size_t i = 0; i < px.size(); ++i) px[i] = static_cast<uint8_t>(i * 31);
  testing::write_jpeg(tmp / "cut.jpg", 40, 40, 3, px);
  fs::resize_file(tmp / "cut.jpg", fs::file_size(tmp / "cut.jpg") / 2);
  expect_input_error([&] { decode_image(tmp / "cut.jpg", 3); }, {"cut.jpg", "not a readable JPEG"});
  // Its data segment ended by the end marker: libjpeg would fill the rest with grey (a file of a few
  // hundred bytes could decode to the largest image its header declares).
  testing::write_jpeg(tmp / "ended.jpg", 40, 40, 3, px);
  fs::resize_file(tmp / "ended.jpg", fs::file_size(tmp / "ended.jpg") / 2);
  std::ofstream(tmp / "ended.jpg", std::ios::binary | std::ios::app) << "\xff\xd9";
  expect_input_error([&] { decode_image(tmp / "ended.jpg", 3); },
                     {"ended.jpg", "not a readable JPEG", "premature end of data segment"});
  testing::write_png(tmp / "cut.png", 40, 40, 3, px);
  fs::resize_file(tmp / "cut.png", fs::file_size(tmp / "cut.png") / 2);
  expect_input_error([&] { decode_image(tmp / "cut.png", 3); }, {"cut.png", "not a readable PNG"});
}

// A PNG chunk: length, type, data, CRC-32 of type and data.
std::string png_chunk(const std::string& type, const std::string& data) {
  auto be32 = [](uint32_t x) {
    return std::string{static_cast<char>(x >> 24), static_cast<char>(x >> 16), static_cast<char>(x >> 8),
                       static_cast<char>(x)};
  };
  const std::string body = type + data;
  return be32(static_cast<uint32_t>(data.size())) + body +
         be32(static_cast<uint32_t>(crc32(0, reinterpret_cast<const Bytef*>(body.data()), body.size())));
}

// A PNG header may declare any size; pixels the file cannot hold (deflate expands at most 1032
// times, a pixel takes at least a bit) are refused before the image is allocated.
TEST(ImageDecode, APngDeclaringMorePixelsThanItsBytesCanHoldIsRefused) {
  TempDir tmp;
  const std::string ihdr = std::string("\x00\x00\x3a\x98\x00\x00\x3a\x98\x08\x02\x00\x00\x00", 13);  // 15000^2 RGB
  std::ofstream(tmp / "bomb.png", std::ios::binary) << std::string("\x89PNG\r\n\x1a\n", 8) << png_chunk("IHDR", ihdr)
                                                    << png_chunk("IDAT", std::string(12, 'x')) << png_chunk("IEND", "");
  expect_input_error([&] { decode_image(tmp / "bomb.png", 3); },
                     {"bomb.png' declares 15000 x 15000 pixels, more than the ", " accepted for a file of its size"});
}

TEST(ImageResize, CropsTheCentreOfTheShorterSideResize) {
  // 8 wide, 4 high, 1 channel, pixel = 10 * column: already 4 on the shorter side, so no
  // resampling; the crop keeps columns 2..5.
  DecodedImage img{4, 8, 1, {}};
  for (int y = 0; y < 4; ++y)
    for (int x = 0; x < 8; ++x) img.pixels.push_back(static_cast<uint8_t>(10 * x));
  std::vector<uint8_t> out(16);
  resize_and_center_crop(img, 4, out.data());
  for (int y = 0; y < 4; ++y)
    for (int x = 0; x < 4; ++x) EXPECT_EQ(out[y * 4 + x], 10 * (x + 2)) << y << "," << x;

  // Halving: the triangle filter, widened to 2 pixels, is symmetric about each output's centre, so
  // a ramp (pixel = 10 * column) gives the ramp's value there: centres at input columns 5, 7, 9, 11
  // of the 2x-reduced crop, minus half a pixel.
  DecodedImage ramp{8, 16, 3, {}};
  for (int y = 0; y < 8; ++y)
    for (int x = 0; x < 16; ++x)
      for (int c = 0; c < 3; ++c) ramp.pixels.push_back(static_cast<uint8_t>(10 * x));
  std::vector<uint8_t> half(3 * 16);
  resize_and_center_crop(ramp, 4, half.data());
  for (int c = 0; c < 3; ++c)
    for (int y = 0; y < 4; ++y)
      for (int x = 0; x < 4; ++x) EXPECT_EQ(half[c * 16 + y * 4 + x], 45 + 20 * x) << c << "," << y << "," << x;

  // Channel-major output; a constant image stays constant when enlarged.
  DecodedImage tiny{1, 2, 3, {1, 2, 3, 1, 2, 3}};
  std::vector<uint8_t> big(3 * 5 * 5);
  resize_and_center_crop(tiny, 5, big.data());
  for (size_t i = 0; i < big.size(); ++i) EXPECT_EQ(big[i], 1 + i / 25) << i;
}

// root/{blue,green,red}: solid images of each colour, JPEG and PNG, of several sizes, with a
// README, a hidden file, a truncated JPEG and a text file named .png.
void make_folder(const TempDir& tmp) {
  const std::vector<std::pair<std::string, std::vector<uint8_t>>> classes = {
      {"red", {220, 20, 20}}, {"green", {20, 220, 20}}, {"blue", {20, 20, 220}}};
  for (const auto& [name, colour] : classes) {
    fs::create_directories(tmp / ("root/" + name + "/nested"));
    for (int i = 0; i < 4; ++i) {
      const int w = 20 + 7 * i, h = 30 - 3 * i;
      testing::write_png(tmp / ("root/" + name + "/p" + std::to_string(i) + ".png"), w, h, 3, solid(w, h, colour));
      testing::write_jpeg(tmp / ("root/" + name + "/nested/j" + std::to_string(i) + ".JPG"), h, w, 3,
                          solid(h, w, colour));
    }
  }
  std::ofstream(tmp / "root/red/README.txt") << "about the red class";
  std::ofstream(tmp / "root/green/.hidden.png") << "ignored: hidden";
  std::ofstream(tmp / "root/blue/text.png") << "not an image";
  testing::write_jpeg(tmp / "root/blue/cut.jpg", 64, 64, 3, solid(64, 64, {20, 20, 220}));
  fs::resize_file(tmp / "root/blue/cut.jpg", fs::file_size(tmp / "root/blue/cut.jpg") / 2);
}

ImageFolderOptions small_options() {
  ImageFolderOptions opt;
  opt.size = 8;
  opt.threads = 3;
  opt.writer.shard_size = 5;
  opt.writer.chunk_rows = 2;
  return opt;
}

TEST(ImageFolder, ConvertsClassFoldersAndSkipsWhatItCannotRead) {
  TempDir tmp;
  make_folder(tmp);
  int64_t last_done = -1, reported_total = -1;
  ImageFolderOptions opt = small_options();
  opt.progress = [&](int64_t done, int64_t total) {
    EXPECT_GE(done, last_done);
    last_done = done;
    reported_total = total;
  };
  const ImageFolderSummary s = convert_image_folder(tmp / "root", tmp / "out", opt);
  EXPECT_EQ(s.classes, (std::vector<std::string>{"blue", "green", "red"}));
  EXPECT_EQ(s.ignored_files, 1);
  ASSERT_EQ(s.skipped.size(), 2u);
  std::set<std::string> skipped;
  for (const SkippedImage& k : s.skipped) skipped.insert(fs::path(k.path).filename().string());
  EXPECT_EQ(skipped, (std::set<std::string>{"cut.jpg", "text.png"}));
  EXPECT_EQ(last_done, 26);
  EXPECT_EQ(reported_total, 26);
  ASSERT_EQ(s.splits.size(), 1u);
  EXPECT_EQ(s.splits[0].num_samples, 24);
  EXPECT_EQ(s.splits[0].num_shards, 5);

  ShardedHdf5Dataset ds(tmp / "out");
  ASSERT_EQ(ds.size(), 24);
  EXPECT_EQ(ds.info().sample_shape, (Shape{3, 8, 8}));
  EXPECT_EQ(ds.info().num_classes, 3);
  EXPECT_EQ(ds.info().class_names, s.classes);
  std::vector<uint8_t> px(3 * 64);
  std::vector<int> per_class(3, 0);
  bool classes_mixed = false;
  for (int64_t i = 0; i < ds.size(); ++i) {
    int32_t label = -1;
    std::vector<int64_t> idx = {i};
    ds.read(idx, px.data(), &label);
    ASSERT_GE(label, 0);
    ++per_class[label];
    classes_mixed = classes_mixed || (i > 0 && i < 8 && label != ds.label(0));
    const int bright = 2 - label;  // blue, green, red: the bright channel of label l is 2 - l
    for (int c = 0; c < 3; ++c)
      for (int k = 0; k < 64; ++k) EXPECT_NEAR(px[c * 64 + k], c == bright ? 220 : 20, 4) << i << " " << c;
  }
  EXPECT_EQ(per_class, (std::vector<int>{8, 8, 8}));
  EXPECT_TRUE(classes_mixed) << "the shards hold the classes in folder order";
}

TEST(ImageFolder, ValidationSplitPerClassAndDeterministic) {
  TempDir tmp;
  make_folder(tmp);
  ImageFolderOptions opt = small_options();
  opt.val_fraction = 0.25;
  opt.channels = 1;
  const ImageFolderSummary a = convert_image_folder(tmp / "root", tmp / "a", opt);
  opt.threads = 1;
  convert_image_folder(tmp / "root", tmp / "b", opt);
  ASSERT_EQ(a.splits.size(), 2u);
  // A quarter of each class's files, rounded, goes to validation; blue's two broken ones may fall on either side.
  EXPECT_EQ(a.splits[0].num_samples + a.splits[1].num_samples, 24);
  EXPECT_EQ(ShardedHdf5Dataset(tmp / "a/val").info().sample_shape, (Shape{1, 8, 8}));
  for (const char* split : {"train", "val"}) {
    ShardedHdf5Dataset x(tmp / ("a/" + std::string(split))), y(tmp / ("b/" + std::string(split)));
    ASSERT_EQ(x.size(), y.size());
    std::vector<uint8_t> px(64), py(64);
    for (int64_t i = 0; i < x.size(); ++i) {
      int32_t lx = -1, ly = -2;
      std::vector<int64_t> idx = {i};
      x.read(idx, px.data(), &lx);
      y.read(idx, py.data(), &ly);
      EXPECT_EQ(lx, ly);
      EXPECT_EQ(px, py) << "the thread count changed sample " << i << " of " << split;
    }
  }
}

TEST(ImageFolder, StrictStopsAtTheFirstBrokenImageAndLeavesNothing) {
  TempDir tmp;
  make_folder(tmp);
  ImageFolderOptions opt = small_options();
  opt.strict = true;
  expect_input_error([&] { convert_image_folder(tmp / "root", tmp / "out", opt); }, {"root/blue/", "--strict"});
  ASSERT_TRUE(fs::is_directory(tmp / "out"));
  EXPECT_TRUE(fs::is_empty(tmp / "out")) << "a shard or a temporary was left behind";
}

TEST(ImageFolder, BadFoldersAndOptions) {
  TempDir tmp;
  ImageFolderOptions opt = small_options();
  expect_input_error([&] { convert_image_folder(tmp / "none", tmp / "out", opt); }, {"none", "does not exist"});
  fs::create_directories(tmp / "flat");
  testing::write_png(tmp / "flat/a.png", 2, 2, 1, {1, 2, 3, 4});
  expect_input_error([&] { convert_image_folder(tmp / "flat", tmp / "out", opt); }, {"flat", "no class folders"});
  fs::create_directories(tmp / "flat/cats");
  fs::create_directories(tmp / "flat/dogs");
  testing::write_png(tmp / "flat/dogs/d.png", 2, 2, 1, {1, 2, 3, 4});
  expect_input_error([&] { convert_image_folder(tmp / "flat", tmp / "out", opt); }, {"flat/cats", "no .jpg"});
  fs::create_directories(tmp / "one/cats");
  std::ofstream(tmp / "one/cats/c.jpg") << "broken";
  expect_input_error([&] { convert_image_folder(tmp / "one", tmp / "out", opt); }, {"holds no samples"});
  opt.size = 0;
  expect_input_error([&] { convert_image_folder(tmp / "flat", tmp / "out", opt); }, {"--size"});
  opt.size = 8;
  opt.val_fraction = 1;
  expect_input_error([&] { convert_image_folder(tmp / "flat", tmp / "out", opt); }, {"--val-fraction"});
}

}  // namespace
}  // namespace dtrain::data
