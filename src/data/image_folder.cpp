#include "dtrain/data/image_folder.h"

#include <png.h>
// jpeglib.h needs size_t and FILE declared before it.
#include <cstdio>
#include <jerror.h>
#include <jpeglib.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <csetjmp>
#include <exception>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <thread>

#include "dtrain/core/cores.h"
#include "dtrain/core/error.h"
#include "dtrain/core/rng.h"
#include "dtrain/core/timer.h"

namespace fs = std::filesystem;

namespace dtrain::data {

namespace {

// Larger images are refused before anything is allocated for them (PIL's own bomb limit is 179 M).
constexpr uint64_t kMaxPixels = uint64_t(1) << 28;
// libjpeg's own memory for one image (a progressive JPEG's coefficients: 2 bytes per pixel and
// component at 4:4:4, allocated from the declared size before any scan is read): past it, libjpeg
// fails with "Backing store not supported" instead of allocating what a header asks for.
constexpr long kMaxJpegMemory = 1L << 30;
// A PNG's pixels are deflated rows of at least one bit per pixel, and deflate expands at most 1032
// times: a file declaring more pixels than 8 x 1032 per byte of it cannot hold them.
constexpr uint64_t kMaxPngPixelsPerByte = 8 * 1032;

std::vector<uint8_t> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  DT_INPUT_CHECK(in, "cannot open '" << path << "'");
  const std::streamoff size = in.tellg();
  DT_INPUT_CHECK(size > 0, "'" << path << "' is empty");
  std::vector<uint8_t> bytes(static_cast<size_t>(size));
  in.seekg(0);
  DT_INPUT_CHECK(in.read(reinterpret_cast<char*>(bytes.data()), size), "cannot read '" << path << "'");
  return bytes;
}

void check_pixels(uint64_t width, uint64_t height, const std::string& path, uint64_t max = kMaxPixels) {
  DT_INPUT_CHECK(width > 0 && height > 0, "'" << path << "' declares an empty image");
  DT_INPUT_CHECK(width * height <= max, "'" << path << "' declares " << width << " x " << height
                                            << " pixels, more than the " << max << " accepted"
                                            << (max < kMaxPixels ? " for a file of its size" : ""));
}

// ---- JPEG (libjpeg's API: errors leave through longjmp) ----

struct JpegJob {
  jpeg_decompress_struct cinfo{};
  jpeg_error_mgr errors{};
  std::jmp_buf jump{};
  char message[JMSG_LENGTH_MAX] = {};
  DecodedImage image;
  bool adobe_cmyk = false;
};

[[noreturn]] void jpeg_fail(j_common_ptr cinfo) {
  auto* job = reinterpret_cast<JpegJob*>(cinfo->client_data);
  cinfo->err->format_message(cinfo, job->message);
  std::longjmp(job->jump, 1);
}

// A stream that ends early, or a data segment that ends before the image does, is corrupt
// (libjpeg would pad it with grey and warn: a file of a few hundred bytes would decode to the
// largest image its header may declare); other warnings, such as extraneous bytes before a marker,
// are common in photographs and harmless.
void jpeg_message(j_common_ptr cinfo, int level) {
  if (level < 0 && (cinfo->err->msg_code == JWRN_JPEG_EOF || cinfo->err->msg_code == JWRN_HIT_MARKER))
    jpeg_fail(cinfo);
}

// Runs between setjmp and a possible longjmp: no C++ object with a destructor may live here.
void jpeg_decode_steps(JpegJob& job, const std::vector<uint8_t>& bytes, int channels, int min_shorter_side,
                       const std::string& path) {
  jpeg_decompress_struct& c = job.cinfo;
  jpeg_mem_src(&c, bytes.data(), static_cast<unsigned long>(bytes.size()));
  jpeg_read_header(&c, TRUE);
  check_pixels(c.image_width, c.image_height, path);
  const bool cmyk = c.jpeg_color_space == JCS_CMYK || c.jpeg_color_space == JCS_YCCK;
  c.out_color_space = cmyk ? JCS_CMYK : channels == 1 ? JCS_GRAYSCALE : JCS_RGB;
  const unsigned shorter = std::min(c.image_width, c.image_height);
  unsigned denom = 1;
  // As PIL's draft: the largest 1/d with d <= shorter / min_shorter_side (rounded down).
  while (min_shorter_side > 0 && denom < 8 && shorter / (2 * denom) >= static_cast<unsigned>(min_shorter_side))
    denom *= 2;
  c.scale_num = 1;
  c.scale_denom = denom;
  jpeg_start_decompress(&c);
  job.adobe_cmyk = cmyk && c.saw_Adobe_marker;
  DecodedImage& img = job.image;
  img.width = static_cast<int>(c.output_width);
  img.height = static_cast<int>(c.output_height);
  img.channels = c.output_components;
  // Reserved (address space only) and filled row by row as rows are decoded: a file that declares
  // more rows than it holds fails at its end (JWRN_JPEG_EOF) before the memory of the rows it lacks
  // is touched.
  const size_t row_bytes = static_cast<size_t>(img.width) * img.channels;
  img.pixels.reserve(row_bytes * img.height);
  while (c.output_scanline < c.output_height) {
    img.pixels.resize(img.pixels.size() + row_bytes);
    JSAMPROW row = img.pixels.data() + img.pixels.size() - row_bytes;
    jpeg_read_scanlines(&c, &row, 1);
  }
  jpeg_finish_decompress(&c);
}

// CMYK (inverted, as Adobe writes it, or not) to RGB or grey, as PIL converts it.
DecodedImage from_cmyk(const DecodedImage& cmyk, bool inverted, int channels) {
  DecodedImage out{cmyk.height, cmyk.width, channels, {}};
  out.pixels.resize(static_cast<size_t>(cmyk.height) * cmyk.width * channels);
  for (size_t i = 0, n = static_cast<size_t>(cmyk.height) * cmyk.width; i < n; ++i) {
    const uint8_t* p = &cmyk.pixels[4 * i];
    const int k = inverted ? p[3] : 255 - p[3];
    int rgb[3];
    for (int j = 0; j < 3; ++j) rgb[j] = (inverted ? p[j] : 255 - p[j]) * k / 255;
    if (channels == 3) {
      for (int j = 0; j < 3; ++j) out.pixels[3 * i + j] = static_cast<uint8_t>(rgb[j]);
    } else {
      out.pixels[i] = static_cast<uint8_t>((rgb[0] * 299 + rgb[1] * 587 + rgb[2] * 114) / 1000);
    }
  }
  return out;
}

// False, with libjpeg's message in job.message, when libjpeg gave up (through longjmp).
bool jpeg_run(JpegJob& job, const std::vector<uint8_t>& bytes, int channels, int min_shorter_side,
              const std::string& path) {
  if (setjmp(job.jump)) return false;
  jpeg_decode_steps(job, bytes, channels, min_shorter_side, path);
  return true;
}

DecodedImage decode_jpeg(const std::vector<uint8_t>& bytes, int channels, int min_shorter_side,
                         const std::string& path) {
  auto job = std::make_unique<JpegJob>();
  job->cinfo.err = jpeg_std_error(&job->errors);
  job->errors.error_exit = jpeg_fail;
  job->errors.emit_message = jpeg_message;
  job->cinfo.client_data = job.get();
  jpeg_create_decompress(&job->cinfo);
  job->cinfo.mem->max_memory_to_use = kMaxJpegMemory;
  bool decoded = false;
  try {
    decoded = jpeg_run(*job, bytes, channels, min_shorter_side, path);
  } catch (...) {
    jpeg_destroy_decompress(&job->cinfo);
    throw;
  }
  jpeg_destroy_decompress(&job->cinfo);
  DT_INPUT_CHECK(decoded, "'" << path << "' is not a readable JPEG: " << job->message);
  if (job->image.channels == 4) return from_cmyk(job->image, job->adobe_cmyk, channels);
  return std::move(job->image);
}

// ---- PNG (libpng's simplified API: errors come back as a flag and a message) ----

DecodedImage decode_png(const std::vector<uint8_t>& bytes, int channels, const std::string& path) {
  png_image png{};
  png.version = PNG_IMAGE_VERSION;
  DT_INPUT_CHECK(png_image_begin_read_from_memory(&png, bytes.data(), bytes.size()),
                 "'" << path << "' is not a readable PNG: " << png.message);
  const uint64_t max = std::min<uint64_t>(kMaxPixels, bytes.size() * kMaxPngPixelsPerByte);
  if (static_cast<uint64_t>(png.width) * png.height > max) {
    png_image_free(&png);
    check_pixels(png.width, png.height, path, max);
  }
  png.format = channels == 1 ? PNG_FORMAT_GRAY : PNG_FORMAT_RGB;
  DecodedImage img{static_cast<int>(png.height), static_cast<int>(png.width), channels, {}};
  img.pixels.resize(PNG_IMAGE_SIZE(png));
  DT_INPUT_CHECK(png_image_finish_read(&png, nullptr, img.pixels.data(), 0, nullptr),
                 "'" << path << "' is not a readable PNG: " << png.message);
  return img;
}

// ---- resampling ----

// One axis of a resize from `in` to `resized` pixels, for the `out` outputs from `offset` on:
// output o reads inputs [first[o], first[o] + taps[o]) with weights w[o * max_taps + k]. PIL's
// bilinear filter, widened by the reduction factor so that a downscale averages (antialiasing).
struct AxisFilter {
  std::vector<int> first, taps;
  std::vector<float> w;
  int max_taps = 0;
};

AxisFilter axis_filter(int in, int resized, int offset, int out) {
  const double scale = static_cast<double>(in) / resized;
  const double widen = std::max(scale, 1.0);
  const double support = widen;  // the triangle's radius, in input pixels
  AxisFilter f;
  f.max_taps = static_cast<int>(std::ceil(support)) * 2 + 1;
  f.first.resize(out);
  f.taps.resize(out);
  f.w.assign(static_cast<size_t>(out) * f.max_taps, 0.0f);
  for (int o = 0; o < out; ++o) {
    const double center = (o + offset + 0.5) * scale;
    const int lo = std::max(static_cast<int>(center - support + 0.5), 0);
    const int hi = std::min(static_cast<int>(center + support + 0.5), in);
    double total = 0;
    float* w = &f.w[static_cast<size_t>(o) * f.max_taps];
    for (int j = lo; j < hi; ++j) {
      const double t = std::max(0.0, 1.0 - std::abs((j - center + 0.5) / widen));
      w[j - lo] = static_cast<float>(t);
      total += t;
    }
    for (int j = lo; j < hi; ++j) w[j - lo] = total > 0 ? static_cast<float>(w[j - lo] / total) : 0.0f;
    f.first[o] = lo;
    f.taps[o] = hi - lo;
  }
  return f;
}

uint8_t clamp_round(float v) { return static_cast<uint8_t>(std::clamp(v + 0.5f, 0.0f, 255.0f)); }

}  // namespace

DecodedImage decode_image(const std::string& path, int channels, int min_shorter_side) {
  DT_CHECK(channels == 1 || channels == 3, "decode_image: channels must be 1 or 3, got " << channels);
  const std::vector<uint8_t> bytes = read_file(path);
  static const uint8_t kJpeg[] = {0xFF, 0xD8, 0xFF};
  static const uint8_t kPng[] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
  auto starts_with = [&](const uint8_t* magic, size_t n) {
    return bytes.size() >= n && std::equal(magic, magic + n, bytes.begin());
  };
  if (starts_with(kJpeg, sizeof kJpeg)) return decode_jpeg(bytes, channels, min_shorter_side, path);
  if (starts_with(kPng, sizeof kPng)) return decode_png(bytes, channels, path);
  throw InputError("'" + path + "' is neither a JPEG nor a PNG file (by its first bytes)");
}

void resize_and_center_crop(const DecodedImage& image, int size, uint8_t* chw) {
  const int h = image.height, w = image.width, c = image.channels;
  DT_CHECK(size > 0 && h > 0 && w > 0, "resize_and_center_crop of " << w << "x" << h << " to " << size);
  const bool tall = h > w;
  const int shorter = tall ? w : h, longer = tall ? h : w;
  const int resized_longer = static_cast<int>(static_cast<int64_t>(size) * longer / shorter);
  const int resized_h = tall ? resized_longer : size, resized_w = tall ? size : resized_longer;
  const int top = static_cast<int>(std::nearbyint((resized_h - size) / 2.0));
  const int left = static_cast<int>(std::nearbyint((resized_w - size) / 2.0));
  const AxisFilter fx = axis_filter(w, resized_w, left, size);
  const AxisFilter fy = axis_filter(h, resized_h, top, size);

  // Horizontal pass over the input rows the vertical one reads, rounded to bytes in between as PIL.
  const int row_lo = fy.first.front(), row_hi = fy.first.back() + fy.taps.back();
  std::vector<uint8_t> across(static_cast<size_t>(row_hi - row_lo) * size * c);
  for (int y = row_lo; y < row_hi; ++y) {
    const uint8_t* in = image.pixels.data() + static_cast<size_t>(y) * w * c;
    uint8_t* out = across.data() + static_cast<size_t>(y - row_lo) * size * c;
    for (int x = 0; x < size; ++x) {
      const float* wt = &fx.w[static_cast<size_t>(x) * fx.max_taps];
      for (int ch = 0; ch < c; ++ch) {
        float v = 0;
        for (int k = 0; k < fx.taps[x]; ++k) v += wt[k] * in[(fx.first[x] + k) * c + ch];
        out[x * c + ch] = clamp_round(v);
      }
    }
  }
  const size_t plane = static_cast<size_t>(size) * size;
  for (int y = 0; y < size; ++y) {
    const float* wt = &fy.w[static_cast<size_t>(y) * fy.max_taps];
    for (int x = 0; x < size; ++x)
      for (int ch = 0; ch < c; ++ch) {
        float v = 0;
        for (int k = 0; k < fy.taps[y]; ++k)
          v += wt[k] * across[(static_cast<size_t>(fy.first[y] + k - row_lo) * size + x) * c + ch];
        chw[ch * plane + static_cast<size_t>(y) * size + x] = clamp_round(v);
      }
  }
}

namespace {

struct LabelledFile {
  std::string path;
  int32_t label;
};

bool is_hidden(const fs::path& p) { return p.filename().string().starts_with("."); }

bool has_image_extension(const fs::path& p) {
  std::string ext = p.extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char ch) { return std::tolower(ch); });
  return ext == ".jpg" || ext == ".jpeg" || ext == ".png";
}

// The class folders (sorted) and their image files (sorted), labelled by class index.
std::vector<LabelledFile> list_images(const std::string& root, ImageFolderSummary& summary) {
  DT_INPUT_CHECK(fs::is_directory(root), "image folder '" << root << "' does not exist or is not a directory");
  for (const auto& entry : fs::directory_iterator(root))
    if (entry.is_directory() && !is_hidden(entry.path())) summary.classes.push_back(entry.path().filename().string());
  std::sort(summary.classes.begin(), summary.classes.end());
  DT_INPUT_CHECK(!summary.classes.empty(),
                 "image folder '" << root << "' holds no class folders (expected ROOT/CLASS/IMAGE.jpg)");
  std::vector<LabelledFile> files;
  for (size_t label = 0; label < summary.classes.size(); ++label) {
    const fs::path dir = fs::path(root) / summary.classes[label];
    std::vector<std::string> found;
    for (auto it = fs::recursive_directory_iterator(dir, fs::directory_options::follow_directory_symlink);
         it != fs::recursive_directory_iterator(); ++it) {
      if (is_hidden(it->path())) {
        if (it->is_directory()) it.disable_recursion_pending();
        continue;
      }
      if (!it->is_regular_file()) continue;
      if (has_image_extension(it->path()))
        found.push_back(it->path().string());
      else
        ++summary.ignored_files;
    }
    DT_INPUT_CHECK(!found.empty(), "class folder '" << dir.string() << "' holds no .jpg, .jpeg or .png images");
    std::sort(found.begin(), found.end());
    for (std::string& f : found) files.push_back({std::move(f), static_cast<int32_t>(label)});
  }
  return files;
}

// Splits `files` into train and validation, `fraction` of each class (rounded) to validation, and
// shuffles both.
void split_and_shuffle(const std::vector<LabelledFile>& files, double fraction, uint64_t seed, size_t classes,
                       std::vector<LabelledFile>& train, std::vector<LabelledFile>& val) {
  std::vector<std::vector<LabelledFile>> by_class(classes);
  for (const LabelledFile& f : files) by_class[f.label].push_back(f);
  for (size_t c = 0; c < classes; ++c) {
    Rng rng(derive_seed(seed, c));
    shuffle(by_class[c], rng);
    const size_t n_val = static_cast<size_t>(std::llround(fraction * static_cast<double>(by_class[c].size())));
    val.insert(val.end(), by_class[c].begin(), by_class[c].begin() + n_val);
    train.insert(train.end(), by_class[c].begin() + n_val, by_class[c].end());
  }
  Rng order(derive_seed(seed, classes));
  shuffle(train, order);
  shuffle(val, order);
}

// Decodes `files` on `threads` threads (the calling one among them) into rows of `sample_bytes`
// bytes; ok[i] says whether file i was read, reason[i] why not. Other exceptions are rethrown.
void decode_all(const std::vector<LabelledFile>& files, const ImageFolderOptions& opt, int threads,
                std::vector<uint8_t>& rows, std::vector<char>& ok, std::vector<std::string>& reason,
                const std::function<void(int64_t)>& report) {
  const size_t sample_bytes = static_cast<size_t>(opt.channels) * opt.size * opt.size;
  rows.resize(files.size() * sample_bytes);
  ok.assign(files.size(), 0);
  reason.assign(files.size(), {});
  std::atomic<size_t> next{0};
  std::atomic<int64_t> done{0};
  std::exception_ptr failure;
  std::mutex failure_mutex;
  auto work = [&](bool reporting) {
    for (size_t i; (i = next.fetch_add(1)) < files.size();) {
      try {
        const DecodedImage img = decode_image(files[i].path, opt.channels, opt.size);
        resize_and_center_crop(img, opt.size, rows.data() + i * sample_bytes);
        ok[i] = 1;
      } catch (const InputError& e) {
        reason[i] = e.what();
      } catch (...) {
        std::lock_guard<std::mutex> lock(failure_mutex);
        if (!failure) failure = std::current_exception();
        next = files.size();
      }
      const int64_t d = done.fetch_add(1) + 1;
      if (reporting) report(d);
    }
  };
  std::vector<std::thread> helpers;
  for (int t = 1; t < threads; ++t) helpers.emplace_back(work, false);
  work(true);
  for (std::thread& t : helpers) t.join();
  if (failure) std::rethrow_exception(failure);
}

}  // namespace

ImageFolderSummary convert_image_folder(const std::string& root, const std::string& out_dir,
                                        const ImageFolderOptions& opt) {
  DT_INPUT_CHECK(opt.size > 0 && opt.size <= 4096, "--size must be in [1, 4096], got " << opt.size);
  DT_INPUT_CHECK(opt.channels == 1 || opt.channels == 3, "--channels must be 1 or 3, got " << opt.channels);
  DT_INPUT_CHECK(opt.val_fraction >= 0 && opt.val_fraction < 1,
                 "--val-fraction must be in [0, 1), got " << opt.val_fraction);
  DT_INPUT_CHECK(opt.threads >= 0, "--threads must be >= 0, got " << opt.threads);
  DT_INPUT_CHECK(opt.writer.shard_size > 0, "--shard-size must be positive, got " << opt.writer.shard_size);
  ImageFolderSummary summary;
  const std::vector<LabelledFile> files = list_images(root, summary);
  std::vector<LabelledFile> train, val;
  split_and_shuffle(files, opt.val_fraction, opt.seed, summary.classes.size(), train, val);
  const int threads = opt.threads > 0 ? opt.threads : affinity_cores();
  const bool two_splits = opt.val_fraction > 0;

  ImageSet split;
  split.sample_shape = {opt.channels, opt.size, opt.size};
  split.num_classes = static_cast<int>(summary.classes.size());
  split.class_names = summary.classes;
  int64_t before = 0;
  double last_report = 0;
  auto report = [&](int64_t done) {
    if (!opt.progress || now_s() - last_report < 0.2) return;
    last_report = now_s();
    opt.progress(before + done, static_cast<int64_t>(files.size()));
  };
  const struct {
    const std::vector<LabelledFile>& files;
    const char* name;
  } parts[] = {{train, "train"}, {val, "val"}};
  for (const auto& part : parts) {
    if (part.name == std::string("val") && !two_splits) break;
    split.source = "images:" + root + (two_splits ? std::string(" (") + part.name + ")" : "");
    ShardWriter writer(two_splits ? (fs::path(out_dir) / part.name).string() : out_dir, split, opt.writer);
    const size_t chunk = static_cast<size_t>(opt.writer.shard_size);
    std::vector<uint8_t> rows;
    std::vector<char> ok;
    std::vector<std::string> reason;
    for (size_t begin = 0; begin < part.files.size(); begin += chunk) {
      const std::vector<LabelledFile> batch(part.files.begin() + begin,
                                            part.files.begin() + std::min(part.files.size(), begin + chunk));
      decode_all(batch, opt, threads, rows, ok, reason, report);
      before += static_cast<int64_t>(batch.size());
      const size_t sample_bytes = rows.size() / batch.size();
      for (size_t i = 0; i < batch.size(); ++i) {
        if (ok[i]) {
          writer.add(rows.data() + i * sample_bytes, &batch[i].label, 1);
          continue;
        }
        DT_INPUT_CHECK(!opt.strict, reason[i] << " (--strict: the conversion stops at an unreadable image)");
        summary.skipped.push_back({batch[i].path, reason[i]});
      }
    }
    summary.splits.push_back(writer.finish());
  }
  if (opt.progress) opt.progress(static_cast<int64_t>(files.size()), static_cast<int64_t>(files.size()));
  return summary;
}

}  // namespace dtrain::data
