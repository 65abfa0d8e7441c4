// dtrain convert idx|cifar10|fashion-mnist|images: image files to a directory of HDF5 shards;
// dtrain convert text: text files to byte-token files for language models.
#include <unistd.h>

#include <boost/program_options.hpp>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include "commands.h"
#include "dtrain/core/error.h"
#include "dtrain/core/timer.h"
#include "dtrain/data/convert.h"
#include "dtrain/data/image_folder.h"
#include "dtrain/data/shard_index.h"
#include "dtrain/data/text.h"

namespace dtrain::cli {

namespace po = boost::program_options;
namespace fs = std::filesystem;

namespace {

constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";

struct ConvertArgs {
  std::string images, labels, out, source = kFashionMnistDir, root;
  std::vector<std::string> inputs;
  int num_classes = 0;
  data::ShardWriterOptions writer;
  data::ImageFolderOptions folder;
};

// Image folders: shards of about this many bytes of pixels unless --shard-size says otherwise.
constexpr int64_t kImageShardBytes = int64_t(256) << 20;

void add_writer_options(po::options_description& d, ConvertArgs& a, const char* shard_size_help = "samples per shard") {
  d.add_options()                                                                                           //
      ("out", po::value(&a.out)->required(), "output directory for the shards (created if missing)")        //
      ("shard-size", po::value(&a.writer.shard_size)->default_value(a.writer.shard_size), shard_size_help)  //
      ("chunk", po::value(&a.writer.chunk_rows)->default_value(a.writer.chunk_rows),
       "HDF5 chunk size along the sample dimension, in samples")  //
      ("compress", po::value(&a.writer.compress_level)->default_value(a.writer.compress_level),
       "deflate level 0..9 for the chunks (0: uncompressed, fastest to read)")  //
      ("help,h", "show this help");
}

po::options_description idx_options(ConvertArgs& a) {
  po::options_description d("dtrain convert idx (MNIST / Fashion-MNIST idx files, gzip or raw)");
  d.add_options()                                                                                        //
      ("images", po::value(&a.images)->required(), "idx3 image file (e.g. train-images-idx3-ubyte.gz)")  //
      ("labels", po::value(&a.labels)->required(), "idx1 label file (e.g. train-labels-idx1-ubyte.gz)")  //
      ("num-classes", po::value(&a.num_classes)->default_value(0), "class count (0: largest label + 1)");
  add_writer_options(d, a);
  return d;
}

po::options_description cifar10_options(ConvertArgs& a) {
  po::options_description d("dtrain convert cifar10 (CIFAR-10 binary batches)");
  d.add_options()  //
      ("inputs", po::value(&a.inputs)->multitoken()->required(),
       "batch files in order (data_batch_1.bin ... or test_batch.bin)");
  add_writer_options(d, a);
  return d;
}

po::options_description fashion_options(ConvertArgs& a) {
  po::options_description d("dtrain convert fashion-mnist (both splits into OUT/train and OUT/test)");
  d.add_options()  //
      ("source", po::value(&a.source)->default_value(a.source),
       "directory holding {train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]");
  add_writer_options(d, a);
  return d;
}

po::options_description images_options(ConvertArgs& a) {
  po::options_description d("dtrain convert images (a folder of class folders of JPEG and PNG images)");
  a.writer.shard_size = 0;
  // clang-format off
  d.add_options()
    ("root", po::value(&a.root)->required(), "folder holding one subfolder of images per class (ROOT/CLASS/*.jpg)")
    ("size", po::value(&a.folder.size)->required(), "output side S: the shorter side is resized to S, the centre S x S kept")
    ("channels", po::value(&a.folder.channels)->default_value(a.folder.channels), "3 (RGB) or 1 (grey)")
    ("val-fraction", po::value(&a.folder.val_fraction)->default_value(a.folder.val_fraction),
     "share of each class held out: OUT/train and OUT/val (0: all in OUT)")
    ("seed", po::value(&a.folder.seed)->default_value(a.folder.seed), "seed of the split and of the sample order")
    ("threads", po::value(&a.folder.threads)->default_value(0), "decoding threads (0: every core this process may use)")
    ("strict", po::bool_switch(&a.folder.strict), "fail on the first unreadable image instead of skipping it");
  // clang-format on
  add_writer_options(d, a, "samples per shard (0: about 256 MiB of pixels per shard)");
  return d;
}

// A progress bar on stderr: redrawn in place on a terminal, a line per tenth elsewhere (job logs).
class ProgressBar {
 public:
  void operator()(int64_t done, int64_t total) {
    const double now = now_s();
    const int tenth = total > 0 ? static_cast<int>(10 * done / total) : 10;
    if (!terminal_ && tenth == last_tenth_ && done < total) return;
    last_tenth_ = tenth;
    const int width = 30, filled = total > 0 ? static_cast<int>(width * done / total) : width;
    std::fprintf(stderr, "%s[%s%s] %3d %% %lld/%lld images, %.0f images/s%s", terminal_ ? "\r" : "",
                 std::string(filled, '#').c_str(), std::string(width - filled, '.').c_str(),
                 total > 0 ? static_cast<int>(100 * done / total) : 100, static_cast<long long>(done),
                 static_cast<long long>(total), done / std::max(now - start_, 1e-9),
                 terminal_ && done < total ? "" : "\n");
    std::fflush(stderr);
  }

 private:
  bool terminal_ = ::isatty(STDERR_FILENO) == 1;
  double start_ = now_s();
  int last_tenth_ = -1;
};

int convert_images(const ConvertArgs& a) {
  data::ImageFolderOptions opt = a.folder;
  opt.writer = a.writer;
  const int64_t sample_bytes = static_cast<int64_t>(opt.channels) * opt.size * opt.size;
  if (opt.writer.shard_size == 0)
    opt.writer.shard_size = std::max<int64_t>(1, kImageShardBytes / std::max<int64_t>(sample_bytes, 1));
  ProgressBar bar;
  opt.progress = std::ref(bar);
  const data::ImageFolderSummary s = data::convert_image_folder(a.root, a.out, opt);
  for (const data::SkippedImage& skip : s.skipped)
    std::cerr << "dtrain convert images: skipped: " << skip.reason << "\n";
  for (const data::ConvertSummary& split : s.splits) std::cout << split.str() << "\n";
  std::cout << s.classes.size() << " classes (" << s.classes.front() << " ... " << s.classes.back() << "); "
            << s.skipped.size() << " unreadable image(s) skipped; " << s.ignored_files << " other file(s) ignored\n";
  return 0;
}

// Parses argv (argv[0] is the kind); false when --help was given (and printed).
bool parse(int argc, char** argv, const po::options_description& d, const std::string& kind) {
  po::variables_map vm;
  try {
    po::store(po::command_line_parser(argc, argv).options(d).run(), vm);
    if (vm.count("help")) {
      std::cout << d << "\n";
      return false;
    }
    po::notify(vm);
  } catch (const po::error& e) {
    throw InputError("dtrain convert " + kind + ": " + e.what() + " (see dtrain convert " + kind + " --help)");
  }
  return true;
}

std::string idx_file(const std::string& dir, const std::string& stem) {
  fs::path gz = fs::path(dir) / (stem + ".gz");
  if (fs::exists(gz)) return gz.string();
  fs::path raw = fs::path(dir) / stem;
  DT_INPUT_CHECK(fs::exists(raw),
                 "fashion-mnist: neither '" << gz.string() << "' nor '" << raw.string() << "' exists (set --source)");
  return raw.string();
}

void print_help(std::ostream& os) {
  ConvertArgs a;
  os << "usage: dtrain convert KIND [options]\n"
        "  KIND is idx, cifar10, fashion-mnist (writes OUT/shard-00000.h5, ..., format: docs/data.md),\n"
        "  images (a folder of class folders of JPEG/PNG images), or text (writes OUT/train.h5 and\n"
        "  OUT/val.h5 of byte tokens; see dtrain convert text --help), sft (prompt/completion JSON lines\n"
        "  into OUT/train.h5 and OUT/val.h5 with a loss mask; see dtrain convert sft --help), or index "
        "(DIR/shards.index for\n"
        "  shards written another way; the image kinds write it themselves).\n\n"
     << idx_options(a) << "\n"
     << cifar10_options(a) << "\n"
     << fashion_options(a) << "\n"
     << images_options(a) << "\n";
}

}  // namespace

namespace {

// The options of `dtrain convert KIND`; false after --help. Errors name the command.
bool parse_kind_options(int argc, char** argv, const po::options_description& o, const std::string& kind) {
  po::variables_map vm;
  try {
    po::store(po::command_line_parser(argc, argv).options(o).run(), vm);
    if (vm.count("help")) {
      std::cout << o << "\n";
      return false;
    }
    po::notify(vm);
  } catch (const po::error& e) {
    throw InputError("dtrain convert " + kind + ": " + std::string(e.what()) + " (see dtrain convert " + kind +
                     " --help)");
  }
  return true;
}

}  // namespace

// dtrain convert text: byte tokens (vocabulary 256) or BPE pieces in <out>/train.h5 and <out>/val.h5.
int cmd_convert_text(int argc, char** argv) {
  std::vector<std::string> inputs;
  std::string out;
  data::TextConvertOptions opt;
  po::options_description o("dtrain convert text (any text files; byte tokens, vocabulary 256, or BPE pieces)");
  // clang-format off
  o.add_options()
    ("help,h", "show this help")
    ("inputs", po::value(&inputs)->multitoken()->required(), "text files or directories (walked recursively)")
    ("out", po::value(&out)->required(), "output directory: train.h5 and val.h5")
    ("val-fraction", po::value(&opt.val_fraction)->default_value(opt.val_fraction), "share of text held out for validation")
    ("block-bytes", po::value(&opt.block_bytes)->default_value(opt.block_bytes), "the held-out split is by blocks of this size")
    ("seed", po::value(&opt.seed)->default_value(opt.seed), "seed of the split")
    ("tokenizer", po::value(&opt.tokenizer)->default_value(opt.tokenizer),
     "bytes (vocabulary 256), bpe (SentencePiece BPE trained on the training text), or a model's own tokenizer: a SentencePiece tokenizer.model (the Llama family), GPT-2's vocab.json (merges.txt beside it), or a folder holding either; the tokenizer is stored in the token files and travels into checkpoints")
    ("vocab-size", po::value(&opt.vocab_size)->default_value(opt.vocab_size), "pieces of the BPE vocabulary")
    ("threads", po::value(&opt.threads)->default_value(opt.threads), "BPE training threads (0: every core this process may use)");
  // clang-format on
  if (!parse_kind_options(argc, argv, o, "text")) return 0;
  data::TextConvertSummary s = data::convert_text(inputs, out, opt);
  std::printf(
      "%lld file(s): %lld train tokens (%lld bytes), %lld validation tokens (%lld bytes), tokenizer %s, "
      "vocabulary %lld -> %s/{train,val}.h5\n",
      static_cast<long long>(s.files), static_cast<long long>(s.train_tokens), static_cast<long long>(s.train_bytes),
      static_cast<long long>(s.val_tokens), static_cast<long long>(s.val_bytes), s.tokenizer.c_str(),
      static_cast<long long>(s.vocab), out.c_str());
  return 0;
}

// dtrain convert sft: prompt/completion records (JSON lines) into token files with a loss mask.
int cmd_convert_sft(int argc, char** argv) {
  std::vector<std::string> inputs;
  std::string out;
  data::SftConvertOptions opt;
  po::options_description o(
      "dtrain convert sft (JSON lines of {\"prompt\", \"completion\"} or {\"messages\": [{\"role\", \"content\"}]})");
  // clang-format off
  o.add_options()
    ("help,h", "show this help")
    ("inputs", po::value(&inputs)->multitoken()->required(), "JSON-lines files, one record per line")
    ("out", po::value(&out)->required(), "output directory: train.h5 and val.h5, each sample with its loss mask")
    ("val-fraction", po::value(&opt.val_fraction)->default_value(opt.val_fraction), "share of records held out for validation (0: validate on the training samples)")
    ("seed", po::value(&opt.seed)->default_value(opt.seed), "seed of the split")
    ("tokenizer", po::value(&opt.tokenizer)->default_value(opt.tokenizer), "bytes, or a model's own tokenizer (a SentencePiece tokenizer.model, GPT-2's vocab.json with merges.txt, or their folder)");
  // clang-format on
  if (!parse_kind_options(argc, argv, o, "sft")) return 0;
  const data::SftConvertSummary s = data::convert_sft(inputs, out, opt);
  std::printf(
      "%lld record(s): %lld train samples (%lld tokens, %lld of them completions), %lld validation samples, "
      "tokenizer %s, vocabulary %lld -> %s/{train,val}.h5 (one sample per window, padded)\n",
      static_cast<long long>(s.records), static_cast<long long>(s.train_samples),
      static_cast<long long>(s.train_tokens), static_cast<long long>(s.completion_tokens),
      static_cast<long long>(s.val_samples), s.tokenizer.c_str(), static_cast<long long>(s.vocab), out.c_str());
  return 0;
}

// dtrain convert index DIR...: (re)writes DIR/shards.index for shards written some other way, or
// after shards were replaced; a run then opens one file at start instead of every shard.
int cmd_convert_index(int argc, char** argv) {
  std::vector<std::string> dirs;
  po::options_description o("dtrain convert index (the shard index of folders of shards, see docs/data.md)");
  o.add_options()("help,h", "show this help")  //
      ("dirs", po::value(&dirs)->multitoken()->required(), "folders of .h5 shards");
  po::positional_options_description pos;
  pos.add("dirs", -1);
  po::variables_map vm;
  try {
    po::store(po::command_line_parser(argc, argv).options(o).positional(pos).run(), vm);
    if (vm.count("help")) {
      std::cout << "usage: dtrain convert index DIR...\n" << o << "\n";
      return 0;
    }
    po::notify(vm);
  } catch (const po::error& e) {
    throw InputError("dtrain convert index: " + std::string(e.what()) + " (see dtrain convert index --help)");
  }
  for (const std::string& dir : dirs) {
    const double t0 = now_s();
    const int64_t shards = data::write_shard_index(dir);
    std::printf("%s/%s: %lld shard(s) indexed in %.2f s\n", dir.c_str(), data::kShardIndexName,
                static_cast<long long>(shards), now_s() - t0);
  }
  return 0;
}

int cmd_convert(int argc, char** argv) {
  DT_INPUT_CHECK(
      argc >= 2,
      "dtrain convert: missing KIND (idx, cifar10, fashion-mnist, images, text or index); see dtrain convert --help");
  if (std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h") {
    print_help(std::cout);
    return 0;
  }
  const std::string kind = argv[1];
  ConvertArgs a;
  std::vector<data::ConvertSummary> done;
  double t0 = now_s();
  // Each summary's time covers reading the source too, not only writing the shards.
  auto finish = [&](data::ConvertSummary s) {
    s.seconds = now_s() - t0;
    t0 = now_s();
    done.push_back(std::move(s));
  };
  if (kind == "text") return cmd_convert_text(argc - 1, argv + 1);
  if (kind == "sft") return cmd_convert_sft(argc - 1, argv + 1);
  if (kind == "index") return cmd_convert_index(argc - 1, argv + 1);
  if (kind == "images") {
    const po::options_description d = images_options(a);
    return parse(argc - 1, argv + 1, d, kind) ? convert_images(a) : 0;
  }
  if (kind == "idx") {
    if (!parse(argc - 1, argv + 1, idx_options(a), kind)) return 0;
    data::ImageSet set = data::read_idx(a.images, a.labels);
    set.num_classes = a.num_classes;
    finish(data::write_shards(set, a.out, a.writer));
  } else if (kind == "cifar10") {
    if (!parse(argc - 1, argv + 1, cifar10_options(a), kind)) return 0;
    finish(data::write_shards(data::read_cifar10(a.inputs), a.out, a.writer));
  } else if (kind == "fashion-mnist") {
    if (!parse(argc - 1, argv + 1, fashion_options(a), kind)) return 0;
    DT_INPUT_CHECK(fs::is_directory(a.source),
                   "fashion-mnist: source directory '" << a.source << "' does not exist (set --source)");
    const struct {
      const char* split;
      const char* prefix;
    } splits[] = {{"train", "train"}, {"test", "t10k"}};
    for (const auto& s : splits) {
      std::string prefix = s.prefix;
      data::ImageSet set = data::read_idx(idx_file(a.source, prefix + "-images-idx3-ubyte"),
                                          idx_file(a.source, prefix + "-labels-idx1-ubyte"));
      set.num_classes = 10;
      set.source = std::string("fashion-mnist/") + s.split + " " + set.source;
      finish(data::write_shards(set, (fs::path(a.out) / s.split).string(), a.writer));
    }
  } else {
    DT_INPUT_CHECK(false, "dtrain convert: unknown kind '"
                              << kind << "' (expected idx, cifar10, fashion-mnist, images, text or index)");
  }
  for (const data::ConvertSummary& s : done) std::cout << s.str() << "\n";
  return 0;
}

}  // namespace dtrain::cli
