// Writes the seed corpus of every fuzz target: small valid inputs made by dtrain's own writers.
//   fuzz_make_seeds <tests/fuzz/corpus> <repository root>
// Run by hand after a change of a file format; the corpus is kept in the repository. With a third
// argument, <tests/fuzz/regressions>, it writes the hand-made regression inputs there instead.
#include <png.h>
#include <zlib.h>
// jpeglib.h needs size_t and FILE declared before it.
#include <jpeglib.h>
#include <cstdio>

#include <string>
#include <utility>
#include <vector>

#include "dtrain/data/convert.h"
#include "dtrain/data/hdf5_util.h"
#include "dtrain/data/shard_index.h"
#include "dtrain/data/text.h"
#include "dtrain/train/checkpoint.h"
#include "dtrain/train/config.h"
#include "fuzz_util.h"
#include "local_dp.h"

using namespace dtrain;
namespace fs = std::filesystem;

namespace {

fs::path out_root;

void seed(const std::string& target, const std::string& name, const std::string& bytes) {
  fuzz::write_file(out_root / target / name, {reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()});
  std::printf("%-10s %-22s %6zu bytes\n", target.c_str(), name.c_str(), bytes.size());
}

std::string gzip(const std::string& bytes) {
  const fs::path tmp = fuzz::scratch() / "gz";
  gzFile f = gzopen(tmp.c_str(), "wb9");
  gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size()));
  gzclose(f);
  return fuzz::read_file(tmp);
}

std::string be32(uint32_t x) {
  return {static_cast<char>(x >> 24), static_cast<char>(x >> 16), static_cast<char>(x >> 8), static_cast<char>(x)};
}

data::ImageSet image_set(int64_t n, Shape sample) {
  data::ImageSet set;
  set.sample_shape = sample;
  set.num_classes = 3;
  set.source = "fuzz seed";
  for (int64_t i = 0; i < n; ++i) {
    set.labels.push_back(static_cast<int32_t>(i % 3));
    for (int64_t k = 0; k < shape_numel(sample); ++k) set.inputs.push_back(static_cast<uint8_t>(i * 40 + k * 7));
  }
  return set;
}

// The shard files of `set` written with `opt`, as one input of parts.
std::string shards(const data::ImageSet& set, data::ShardWriterOptions opt) {
  const fs::path dir = fuzz::fresh_scratch() / "shards";
  const data::ConvertSummary sum = data::write_shards(set, dir.string(), opt);
  std::vector<std::pair<std::string, std::string>> parts;
  for (const std::string& f : sum.files) parts.emplace_back("shard", fuzz::read_file(f));
  return fuzz::join_parts(parts);
}

train::CheckpointState image_checkpoint() {
  train::CheckpointState s;
  s.tensors["param/1.weight"] = Tensor::from({2, 3}, {0.5f, -1.f, 0.25f, 2.f, 0.f, -0.125f});
  s.tensors["param/1.bias"] = Tensor::from({2}, {0.1f, -0.1f});
  s.tensors["buffer/2.running_mean"] = Tensor::zeros({2}, DType::BF16);
  s.tensors["buffer/3.rng"] = Tensor::zeros({4}, DType::I64);
  s.tensors["optim/1.weight.momentum"] = Tensor::zeros({2, 3});
  s.tensors["meta/mean"] = Tensor::from({1}, {0.28f});
  s.strings["model"] = "mlp";
  s.strings["optimizer"] = "sgd";
  s.ints["step"] = 7;
  s.ints["epoch"] = 1;
  s.ints["batch_in_epoch"] = 3;
  s.ints["world_size"] = 1;
  s.int_lists["input_shape"] = {1, 2, 2};
  s.int_lists["hidden"] = {3};
  return s;
}

// A checkpoint set in `dir` as one input: the main file, then the parts that belong to it.
std::string checkpoint_set(const fs::path& dir, const std::string& main_file) {
  std::vector<std::pair<std::string, std::string>> parts{{"", fuzz::read_file(main_file)}};
  for (int s = 1; s < 8; ++s)
    if (fs::exists(train::stage_part_file(main_file, s)))
      parts.emplace_back("stage" + std::to_string(s), fuzz::read_file(train::stage_part_file(main_file, s)));
  for (int r = 0; r < 4; ++r)
    if (fs::exists(train::rank_part_file(main_file, r)))
      parts.emplace_back("rank" + std::to_string(r), fuzz::read_file(train::rank_part_file(main_file, r)));
  for (int r = 0; r < 4; ++r)
    if (fs::exists(train::shard_part_file(main_file, r)))
      parts.emplace_back("shard" + std::to_string(r), fuzz::read_file(train::shard_part_file(main_file, r)));
  (void)dir;
  return fuzz::join_parts(parts);
}

void checkpoint_seeds() {
  {
    const fs::path dir = fuzz::fresh_scratch();
    const std::string main_file = train::checkpoint_file(dir.string(), 7);
    train::save_checkpoint(main_file, image_checkpoint());
    seed("checkpoint", "image", checkpoint_set(dir, main_file));
  }
  {  // a GPT cut into two pipeline stages: stage 1's blocks in their own file
    const fs::path dir = fuzz::fresh_scratch();
    const std::string main_file = train::checkpoint_file(dir.string(), 7);
    train::CheckpointState s0, s1;
    s0.tensors["param/wte"] = Tensor::from({4, 2}, {1, 2, 3, 4, 5, 6, 7, 8});
    s0.tensors["param/h.0.ln1.weight"] = Tensor::from({2}, {1, 1});
    s1.tensors["param/h.1.ln1.weight"] = Tensor::from({2}, {1, 1});
    s1.tensors["param/lnf.bias"] = Tensor::zeros({2}, DType::F16);
    s0.strings["model"] = s1.strings["model"] = "gpt";
    s0.ints["step"] = s1.ints["step"] = 7;
    s0.ints["pp_stages"] = 2;
    s0.ints["stage"] = 0;
    s1.ints["stage"] = 1;
    s0.int_lists["stage_blocks"] = {0, 1, 2};
    train::save_checkpoint(train::stage_part_file(main_file, 1), s1);
    train::save_checkpoint(main_file, s0);
    seed("checkpoint", "gpt-stages", checkpoint_set(dir, main_file));
  }
  // A ZeRO set of 2 ranks: each rank's pieces of the tensors with their ranges, listed in the
  // manifest; then the same with the weight cut by columns as under tp, each rank's piece two runs
  // of it ("runs/<key>").
  for (bool by_columns : {false, true}) {
    const fs::path dir = fuzz::fresh_scratch();
    const std::string main_file = train::checkpoint_file(dir.string(), 7);
    const train::CheckpointState whole = image_checkpoint();
    // [key, rank 0's elements [0, cut), rank 1's the rest]
    const std::vector<std::pair<std::string, int64_t>> cuts = {
        {"param/1.weight", 4}, {"param/1.bias", 0}, {"optim/1.weight.momentum", 4}};
    std::vector<train::SetPart> listed;
    for (int r : {0, 1}) {
      train::CheckpointState part;
      for (const auto& [key, cut] : cuts) {
        const Tensor& t = whole.tensors.at(key);
        const int64_t from = r == 0 ? 0 : cut, to = r == 0 ? cut : t.numel();
        if (from == to) continue;
        std::vector<int64_t> range = {from, to - from};
        range.insert(range.end(), t.shape().begin(), t.shape().end());
        part.tensors[key] = t.reshape({t.numel()}).slice0(from, to).clone();
        if (by_columns && key == "param/1.weight") {  // [2, 3]: rank 0 columns 0-1, rank 1 column 2
          const std::vector<int64_t> runs =
              r == 0 ? std::vector<int64_t>{0, 2, 3, 2} : std::vector<int64_t>{2, 1, 5, 1};
          Tensor values = Tensor::empty({runs[1] + runs[3]}), pairs = Tensor::empty({4}, DType::I64);
          std::copy(t.f32() + runs[0], t.f32() + runs[0] + runs[1], values.f32());
          std::copy(t.f32() + runs[2], t.f32() + runs[2] + runs[3], values.f32() + runs[1]);
          std::copy(runs.begin(), runs.end(), pairs.data<int64_t>());
          part.tensors[key] = values;
          part.tensors["runs/" + key] = pairs;
          range[0] = runs[0];
          range[1] = values.numel();
        }
        Tensor& r64 = part.tensors["range/" + key] = Tensor::empty({static_cast<int64_t>(range.size())}, DType::I64);
        std::copy(range.begin(), range.end(), r64.data<int64_t>());
      }
      part.ints["step"] = 7;
      part.ints["rank"] = r;
      part.ints["world_size"] = 2;
      part.ints["run_id"] = 5;
      const train::SavedFile saved = train::save_checkpoint(train::shard_part_file(main_file, r), part);
      listed.push_back({train::SetPart::kShard, r, 0, saved.bytes, saved.checksum});
    }
    train::CheckpointState s = whole;
    for (const auto& [key, cut] : cuts) s.tensors.erase(key);
    s.ints["zero_shard_ranks"] = 2;
    s.ints["world_size"] = 2;
    s.ints["run_id"] = 5;
    train::add_manifest(s, listed, 2);
    train::save_checkpoint(main_file, s);
    seed("checkpoint", by_columns ? "zero-shards-runs" : "zero-shards", checkpoint_set(dir, main_file));
  }
  for (const char* c : {"topk:0.5", "powersgd:1", "qsgd:4"}) {  // a rank's compression state beside the main file
    const fs::path dir = fuzz::fresh_scratch();
    const std::string main_file = train::checkpoint_file(dir.string(), 7);
    bool kept = false;
    for (int rank : {0, 1}) {
      fuzz::LocalDataParallel run(c, rank);
      run.step();
      kept = train::write_compression_parts(main_file, run.dp.get(), &run.comm, 7, c);
    }
    train::CheckpointState s = image_checkpoint();
    s.strings["compression"] = c;
    s.ints["compression_ranks"] = kept ? 2 : 0;
    s.ints["world_size"] = 2;
    train::save_checkpoint(main_file, s);
    std::string name = std::string("compression-") + c;
    name = name.substr(0, name.find(':'));
    seed("checkpoint", name, checkpoint_set(dir, main_file));
  }
}

// Inputs made by hand for a finding the fuzzer had not reached: kept under regressions/.
void crafted_inputs(const fs::path& root) {
  // A PowerSGD rank part whose Q (factor) has another size than its bucket's, under a valid
  // checksum: the loader let it through and the resumed run's first step wrote past it.
  const fs::path dir = fuzz::fresh_scratch();
  const std::string main_file = train::checkpoint_file(dir.string(), 7);
  for (int rank : {0, 1}) {
    fuzz::LocalDataParallel run("powersgd:1", rank);
    run.step();
    train::write_compression_parts(main_file, run.dp.get(), &run.comm, 7, "powersgd:1");
  }
  const std::string part_file = train::rank_part_file(main_file, 0);
  train::CheckpointState part = train::load_checkpoint(part_file);
  for (auto& [name, t] : part.tensors)
    if (name.ends_with(".factor")) t = Tensor::zeros({1});
  train::save_checkpoint(part_file, part);
  train::CheckpointState s = image_checkpoint();
  s.strings["compression"] = "powersgd:1";
  s.ints["compression_ranks"] = 2;
  train::save_checkpoint(main_file, s);
  const std::string bytes = checkpoint_set(dir, main_file);
  fuzz::write_file(root / "checkpoint" / "powersgd-factor-of-another-size",
                   {reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()});

  // A shard without num_classes whose largest label is INT32_MAX: the class count, largest label
  // + 1, overflowed.
  data::ShardWriterOptions opt;
  const fs::path shard_dir = fuzz::fresh_scratch() / "shards";
  data::write_shards(image_set(2, {1, 2, 2}), shard_dir.string(), opt);
  const std::string shard_file = (shard_dir / "shard-00000.h5").string();
  {
    auto lock = data::h5::lock();
    data::h5::Handle file = data::h5::file(H5Fopen(shard_file.c_str(), H5F_ACC_RDWR, H5P_DEFAULT));
    H5Adelete(file.get(), "num_classes");
    data::h5::Handle labels = data::h5::dataset(H5Dopen2(file.get(), "labels", H5P_DEFAULT));
    const int32_t values[2] = {0, INT32_MAX};
    H5Dwrite(labels.get(), H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, values);
  }
  const std::string shard_bytes = fuzz::read_file(shard_file);
  fuzz::write_file(root / "shard" / "largest-label-int32-max",
                   {reinterpret_cast<const uint8_t*>(shard_bytes.data()), shard_bytes.size()});
}

void config_seeds(const fs::path& repo) {
  seed("config", "fashion_cnn.ini", fuzz::read_file(repo / "examples" / "fashion_cnn.ini"));
  train::TrainConfig gpt = train::model_defaults("gpt");
  gpt.data = "data/fortunes";
  gpt.pp = 2;
  gpt.micro_batches = 4;
  seed("config", "gpt.ini", train::config_ini(gpt));
  train::TrainConfig mlp = train::model_defaults("mlp");
  mlp.synthetic = true;
  mlp.synthetic_shape = {4};
  mlp.hidden = {8, 4};
  mlp.compression = "powersgd:2";
  mlp.optimizer = "lamb";
  mlp.lr_schedule = "step";
  seed("config", "mlp.ini", train::config_ini(mlp));
}

void idx_seeds() {
  std::string images = be32(0x803) + be32(2) + be32(3) + be32(3), labels = be32(0x801) + be32(2);
  for (int i = 0; i < 18; ++i) images += static_cast<char>(i * 13);
  labels += std::string("\x01\x07", 2);
  seed("idx", "raw", fuzz::join_parts({{"", images}, {"labels", labels}}));
  seed("idx", "gzip", fuzz::join_parts({{"", gzip(images)}, {"labels", gzip(labels)}}));
}

void cifar_seeds() {
  std::string rec1(3073, '\0'), rec2(3073, '\0');
  rec1[0] = 3;
  rec2[0] = 9;
  for (size_t i = 1; i < rec1.size(); ++i) {
    rec1[i] = static_cast<char>(i * 31);
    rec2[i] = static_cast<char>(i / 97);
  }
  seed("cifar", "one-record", rec1);
  seed("cifar", "two-batches-gzip", fuzz::join_parts({{"", gzip(rec1)}, {"batch", gzip(rec2)}}));
}

void text_seeds() {
  const std::string a = "Q: What is a fortune?\nA: A short text, %\nread at random.\n";
  const std::string b = "The second file\twith\ttabs and UTF-8: \xc3\xa9t\xc3\xa9.\n";
  seed("text", "two-files", fuzz::join_parts({{"", a}, {"file", b}}));
  seed("text", "with-binary", fuzz::join_parts({{"", a + a + a}, {"file", std::string("dat\0idx", 7)}}));
  const fs::path dir = fuzz::fresh_scratch();
  fuzz::write_file(dir / "in" / "a.txt", {reinterpret_cast<const uint8_t*>(a.data()), a.size()});
  data::TextConvertOptions opt;
  opt.val_fraction = 0.3;
  opt.block_bytes = 16;
  data::convert_text({(dir / "in").string()}, (dir / "out").string(), opt);
  seed("tokens", "train.h5", fuzz::read_file(dir / "out" / "train.h5"));
  seed("tokens", "val.h5", fuzz::read_file(dir / "out" / "val.h5"));
}

// Fine-tuning records of both forms, a blank line, UTF-8, escapes; a second file; a broken record.
void sft_seeds() {
  const std::string a = R"({"prompt": "What is 2+2?", "completion": " 4"})" "\n\n"
                        R"({"messages": [{"role": "user", "content": "hi \u00e9"}, {"role": "assistant", "content": "yo\n"}]})" "\n";
  const std::string b = R"({"prompt": "a\tb", "completion": "c\"d"})" "\n";
  seed("sft", "two-forms", a);
  seed("sft", "two-files", fuzz::join_parts({{"", a}, {"file", b}}));
  seed("sft", "no-completion", R"({"prompt": "x"})" "\n");
}

// A SentencePiece BPE model trained by dtrain (the format of a Llama's tokenizer.model), with a text.
void sentencepiece_seeds() {
  std::string text;
  for (int i = 0; i < 200; ++i) text += "the quick brown fox " + std::to_string(i % 13) + " jumps, over the lazy dog.\n";
  const data::Tokenizer tok = data::Tokenizer::train_bpe(text, 300, 1);
  seed("sentencepiece", "bpe-300", fuzz::join_parts({{"", tok.model()}, {"text", "the fox, \xc3\xa9t\xc3\xa9 42\n"}}));
}

// Model files: the examples (built-in and standard models, JSON and INI) and small ones that build
// for the target's [3, 8, 8] samples: every type, blocks with arguments, residuals of both names.
void model_file_seeds(const fs::path& repo) {
  for (const char* name : {"mlp.json", "simple_cnn.json", "simple_cnn.ini", "resnet20.json", "vit_mini.json"})
    seed("model_file", name, fuzz::read_file(repo / "examples" / "models" / name));
  seed("model_file", "small_resnet.json", R"({"name": "small_resnet", "blocks": {"basic": {"args": {"width": null,
  "stride": 1}, "layer": {"type": "residual", "shortcut": "projection", "after": "relu", "body": [
  {"type": "conv", "out": "$width", "kernel": 3, "stride": "$stride", "padding": 1, "bias": false},
  {"type": "batchnorm"}, {"type": "relu"}, {"type": "conv", "out": "$width", "kernel": 3, "padding": 1,
  "bias": false}, {"type": "batchnorm", "eps": 0.001, "momentum": 0.2}]}}}, "layers": [{"name": "stem", "type": "conv",
  "out": 4, "kernel": 3, "padding": 1}, {"type": "basic", "width": 4}, {"type": "basic", "width": 8, "stride": 2},
  {"type": "maxpool", "kernel": 2, "padding": 1}, {"type": "avgpool", "kernel": 2, "stride": 1}, {"type": "global_avgpool"},
  {"name": "fc", "type": "linear", "out": "classes"}]})");
  seed("model_file", "vit.json", R"({"name": "vit", "layers": [{"name": "conv_proj", "type": "conv", "out": 8,
  "kernel": 4, "stride": 4}, {"name": "", "type": "tokens"}, {"name": "encoder", "type": "position_embedding"},
  {"name": "encoder.layers.encoder_layer_0", "type": "transformer_block", "heads": 2, "mlp": 16},
  {"name": "encoder.ln", "type": "layernorm", "eps": 1e-6}, {"type": "first_token"}, {"type": "dropout", "p": 0.1},
  {"type": "gelu"}, {"name": "heads.head", "type": "linear", "out": "classes", "bias": false}]})");
  seed("model_file", "flat.json", R"({"layers": [{"type": "residual", "names": "flat", "shortcut_name": "downsample",
  "shortcut": [{"type": "conv", "out": 2, "kernel": 1}], "body": [{"name": "conv1", "type": "conv", "out": 2,
  "kernel": 3, "padding": 1}, {"type": "gelu_exact"}]}, {"type": "flatten"}, {"type": "layernorm"},
  {"type": "sequential", "layers": [{"type": "linear", "out": 6}, {"type": "relu"}]},
  {"type": "linear", "out": "classes"}]})");
  seed("model_file", "blocks.ini",
       "[model]\nname = blocks\n\n[blocks/b/args]\nw = 3\n\n[blocks/b/layer]\n"
       "type = conv\nout = $w\nkernel = 1\n\n[layers/0]\ntype = b\nw = 2\n\n[layers/1]\ntype = flatten\n\n"
       "[layers/2]\ntype = linear\nout = classes\n");
}

// shards.index (its first byte picks the target's set of shards): indexes of sets like the target's.
void shard_index_seeds() {
  for (int k = 0; k < 3; ++k) {
    data::ShardWriterOptions opt;
    opt.shard_size = 2 + k;
    opt.chunk_rows = 1 + k % 2;
    opt.compress_level = k == 2 ? 1 : 0;
    const fs::path dir = fuzz::fresh_scratch() / "shards";
    data::ImageSet set = image_set(5 + 2 * k, {1 + k % 2, 2, 2 + k});
    if (k == 1) set.class_names = {"a", "b", "c"};
    data::write_shards(set, dir.string(), opt);
    seed("shard_index", "set" + std::to_string(k),
         std::string(1, static_cast<char>(k)) + fuzz::read_file(dir / data::kShardIndexName));
  }
}

// A width x height image of a gradient with `channels` channels (1, 3, or 4: CMYK), as a JPEG.
std::string jpeg(int width, int height, int channels, bool progressive, int quality) {
  std::vector<uint8_t> px(static_cast<size_t>(width) * height * channels);
  for (size_t i = 0; i < px.size(); ++i) px[i] = static_cast<uint8_t>(i * 37 / 5);
  unsigned char* out = nullptr;
  unsigned long size = 0;
  jpeg_compress_struct c{};
  jpeg_error_mgr err{};
  c.err = jpeg_std_error(&err);
  jpeg_create_compress(&c);
  jpeg_mem_dest(&c, &out, &size);
  c.image_width = static_cast<JDIMENSION>(width);
  c.image_height = static_cast<JDIMENSION>(height);
  c.input_components = channels;
  c.in_color_space = channels == 1 ? JCS_GRAYSCALE : channels == 3 ? JCS_RGB : JCS_CMYK;
  jpeg_set_defaults(&c);
  jpeg_set_quality(&c, quality, TRUE);
  if (progressive) jpeg_simple_progression(&c);
  jpeg_start_compress(&c, TRUE);
  while (c.next_scanline < c.image_height) {
    JSAMPROW row = px.data() + static_cast<size_t>(c.next_scanline) * width * channels;
    jpeg_write_scanlines(&c, &row, 1);
  }
  jpeg_finish_compress(&c);
  jpeg_destroy_compress(&c);
  std::string bytes(reinterpret_cast<char*>(out), size);
  std::free(out);
  return bytes;
}

std::string png(int width, int height, png_uint_32 format) {
  png_image img{};
  img.version = PNG_IMAGE_VERSION;
  img.width = static_cast<png_uint_32>(width);
  img.height = static_cast<png_uint_32>(height);
  img.format = format;
  std::vector<uint8_t> px(PNG_IMAGE_SIZE(img));
  for (size_t i = 0; i < px.size(); ++i) px[i] = static_cast<uint8_t>(i * 13 / 3);
  png_alloc_size_t size = 0;
  png_image_write_to_memory(&img, nullptr, &size, 0, px.data(), 0, nullptr);
  std::string bytes(size, '\0');
  png_image_write_to_memory(&img, bytes.data(), &size, 0, px.data(), 0, nullptr);
  bytes.resize(size);
  return bytes;
}

// Images (the input's length picks grey or RGB and the JPEG scale: the seeds cover both).
void image_seeds() {
  seed("image", "rgb.jpg", jpeg(12, 9, 3, false, 90));
  seed("image", "grey.jpg", jpeg(17, 16, 1, false, 50) + "\x00");
  seed("image", "progressive.jpg", jpeg(20, 18, 3, true, 75));
  seed("image", "cmyk.jpg", jpeg(9, 10, 4, false, 80));
  seed("image", "rgb.png", png(10, 7, PNG_FORMAT_RGB));
  seed("image", "grey-alpha.png", png(5, 12, PNG_FORMAT_GA) + "\x00");
  seed("image", "rgba16.png", png(6, 6, PNG_FORMAT_LINEAR_RGB_ALPHA));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3 && argc != 4) {
    std::fprintf(stderr, "usage: fuzz_make_seeds <tests/fuzz/corpus> <repository root> [<tests/fuzz/regressions>]\n");
    return 2;
  }
  if (argc == 4) {
    crafted_inputs(argv[3]);
    return 0;
  }
  out_root = argv[1];
  data::ShardWriterOptions opt;
  opt.chunk_rows = 2;
  seed("shard", "one-shard", shards(image_set(3, {1, 2, 2}), opt));
  opt.shard_size = 2;
  seed("shard", "two-shards", shards(image_set(3, {1, 2, 2}), opt));
  opt.shard_size = 4;
  opt.compress_level = 1;
  seed("shard", "deflate-rgb", shards(image_set(2, {3, 2, 2}), opt));
  checkpoint_seeds();
  config_seeds(argv[2]);
  idx_seeds();
  cifar_seeds();
  text_seeds();
  sft_seeds();
  sentencepiece_seeds();
  model_file_seeds(argv[2]);
  shard_index_seeds();
  image_seeds();
  return 0;
}
