#pragma once
// Writers of small PNG (libpng's simplified API) and JPEG (libjpeg) files for the image folder tests.
#include <gtest/gtest.h>
#include <png.h>
// jpeglib.h needs size_t and FILE declared before it.
#include <cstdio>
#include <jpeglib.h>

#include <cstdint>
#include <string>
#include <vector>

namespace dtrain::data::testing {

// `pixels`: height x width x channels bytes (1: grey, 3: RGB, 4: RGBA).
inline void write_png(const std::string& path, int width, int height, int channels, const std::vector<uint8_t>& pixels) {
  png_image img{};
  img.version = PNG_IMAGE_VERSION;
  img.width = static_cast<png_uint_32>(width);
  img.height = static_cast<png_uint_32>(height);
  img.format = channels == 1 ? PNG_FORMAT_GRAY : channels == 3 ? PNG_FORMAT_RGB : PNG_FORMAT_RGBA;
  ASSERT_TRUE(png_image_write_to_file(&img, path.c_str(), 0, pixels.data(), 0, nullptr)) << img.message;
}

// `pixels`: height x width x channels bytes (1: grey, 3: RGB).
inline void write_jpeg(const std::string& path, int width, int height, int channels, const std::vector<uint8_t>& pixels,
                       int quality = 95) {
  FILE* f = std::fopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr) << path;
  jpeg_compress_struct c{};
  jpeg_error_mgr err{};
  c.err = jpeg_std_error(&err);
  jpeg_create_compress(&c);
  jpeg_stdio_dest(&c, f);
  c.image_width = static_cast<JDIMENSION>(width);
  c.image_height = static_cast<JDIMENSION>(height);
  c.input_components = channels;
  c.in_color_space = channels == 1 ? JCS_GRAYSCALE : JCS_RGB;
  jpeg_set_defaults(&c);
  jpeg_set_quality(&c, quality, TRUE);
  jpeg_start_compress(&c, TRUE);
  while (c.next_scanline < c.image_height) {
    JSAMPROW row = const_cast<uint8_t*>(pixels.data()) + static_cast<size_t>(c.next_scanline) * width * channels;
    jpeg_write_scanlines(&c, &row, 1);
  }
  jpeg_finish_compress(&c);
  jpeg_destroy_compress(&c);
  std::fclose(f);
}

// A width x height image of one colour.
inline std::vector<uint8_t> solid(int width, int height, std::vector<uint8_t> colour) {
  std::vector<uint8_t> px;
  for (int i = 0; i < width * height; ++i) px.insert(px.end(), colour.begin(), colour.end());
  return px;
}

}  // namespace dtrain::data::testing
