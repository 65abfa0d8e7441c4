#include "dtrain/nn/model_file.h"

#include <algorithm>
#include <boost/property_tree/ini_parser.hpp>
#include <boost/property_tree/json_parser.hpp>
#include <boost/property_tree/ptree.hpp>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string_view>

#include "dtrain/core/json.h"
#include "dtrain/nn/models.h"
#include "dtrain/nn/vision.h"

namespace dtrain::nn {

namespace {

namespace pt = boost::property_tree;
using Tree = pt::ptree;
using Args = std::map<std::string, std::string>;

// Boost's JSON parser, write_json and a tree's destructor recurse once per level of nesting, so a
// file of a few thousand brackets would overflow the stack before any check: deeper files are
// refused before they are parsed. A model file is small text; a larger one is refused unread.
constexpr int kMaxNesting = kMaxJsonNesting;
constexpr uintmax_t kMaxModelFileBytes = uintmax_t{16} << 20;
// An integer field (a width, kernel, stride, padding) is at most this, so the shapes computed from
// them stay far from int64's end; the model's size is bounded by ModelBudget.
constexpr int64_t kMaxField = int64_t{1} << 30;

// INI sections are paths in the tree ("layers/3/body/0"); section [model] holds the top-level keys.
// A section met again, or after one below it, adds its keys to the same node.
Tree tree_of_ini(const Tree& ini) {
  Tree tree;
  for (const auto& [section, keys] : ini) {
    Tree* node = &tree;
    if (std::count(section.begin(), section.end(), '/') >= kMaxNesting)
      throw pt::ptree_error("section [" + section.substr(0, 64) + "...] nests deeper than " +
                            std::to_string(kMaxNesting) + " levels");
    if (section != "model") {
      std::stringstream parts(section);
      for (std::string part; std::getline(parts, part, '/');) {
        auto it = node->find(part);
        node = it != node->not_found() ? &it->second : &node->push_back({part, Tree()})->second;
      }
    }
    for (const auto& [key, value] : keys) {
      if (key.empty() || key.find('\0') != std::string::npos)  // put_child asserts on an empty path
        throw pt::ptree_error("section [" + section.substr(0, 64) + "] has a key without a name or with a NUL byte");
      node->put_child(pt::ptree::path_type(key, '\0'), value);
    }
  }
  return tree;
}

Tree parse_definition(const std::string& definition) {
  if (json_shape(definition).nesting > kMaxNesting)
    throw pt::ptree_error("it nests objects and lists deeper than " + std::to_string(kMaxNesting) + " levels");
  Tree tree;
  std::istringstream in(definition);
  pt::read_json(in, tree);
  return tree;
}

// A layer being built: its node in the tree, its path in parameter names, its type, and the
// arguments of the block it is written in ("$width" in a block's fields reads argument width).
struct Layer {
  const Tree& node;
  std::string path, type;
  const Args& args;
};

class DefinitionBuilder {
 public:
  DefinitionBuilder(const Tree& def, const ModelSpec& spec, Rng& rng, ModelBudget& budget)
      : def_(def), spec_(spec), rng_(rng), budget_(budget), dropout_seed_(derive_seed(spec.seed, 99)) {
    where_ = "model " + spec.name + (spec.definition_source.empty() ? "" : " (" + spec.definition_source + ")");
    if (auto blocks = def.get_child_optional("blocks"))
      for (const auto& [name, block] : *blocks) blocks_[name] = &block;
  }

  std::unique_ptr<Sequential> model() {
    only(Layer{def_, "", "model", no_args_}, {"name", "blocks", "layers"});
    auto layers = def_.get_child_optional("layers");
    DT_INPUT_CHECK(layers && !layers->empty(), where_ << ": no \"layers\" list");
    Shape shape = spec_.input;
    auto m = sequence(*layers, "", no_args_, shape, 0);
    DT_INPUT_CHECK(shape.size() == 1 && shape[0] == spec_.classes,
                   where_ << ": the last layer gives " << shape_str(shape) << " per sample, not the " << spec_.classes
                          << " classes' logits (end with a linear layer of out \"classes\")");
    std::set<std::string> names;  // layers named "" or with dots could give two tensors one name
    for (Parameter* p : m->parameters())
      DT_INPUT_CHECK(names.insert(p->name).second, where_ << ": two parameters are named " << p->name);
    for (Buffer* b : m->buffers())
      DT_INPUT_CHECK(names.insert(b->name).second, where_ << ": two tensors are named " << b->name);
    return m;
  }

 private:
  [[noreturn]] void fail(const Layer& l, const std::string& what) const {
    throw InputError(where_ + ": layer " + (l.path.empty() ? "<top>" : l.path) + " (" + l.type + "): " + what);
  }

  // The field's text, "$arg" replaced by the block's argument; nothing when the layer has no such field.
  std::optional<std::string> text(const Layer& l, const std::string& key) const {
    auto v = l.node.get_child_optional(pt::ptree::path_type(key, '\0'));
    if (!v) return std::nullopt;
    if (!v->empty()) fail(l, "field \"" + key + "\" must be a value, not a list or object");
    std::string s = v->data();
    if (s.starts_with("$")) {
      auto a = l.args.find(s.substr(1));
      if (a == l.args.end()) fail(l, "field \"" + key + "\" reads " + s + ", which is not an argument of its block");
      s = a->second;
    }
    return s;
  }

  int64_t integer(const Layer& l, const std::string& key, std::optional<int64_t> fallback, int64_t min = 1) const {
    auto s = text(l, key);
    if (!s) {
      if (!fallback) fail(l, "needs field \"" + key + "\"");
      return *fallback;
    }
    if (*s == "classes") return spec_.classes;
    int64_t v = 0;
    auto [end, ec] = std::from_chars(s->data(), s->data() + s->size(), v);
    if (ec != std::errc() || end != s->data() + s->size() || v < min || v > kMaxField)
      fail(l, "field \"" + key + "\" must be an integer in [" + std::to_string(min) + ", " + std::to_string(kMaxField) +
                  "], got '" + *s + "'");
    return v;
  }

  float real(const Layer& l, const std::string& key, float fallback, float lo, float hi) const {
    auto s = text(l, key);
    if (!s) return fallback;
    char* end = nullptr;
    const float v = std::strtof(s->c_str(), &end);
    if (s->empty() || end != s->c_str() + s->size() || !(v >= lo && v <= hi))
      fail(l, "field \"" + key + "\" must be a number in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                  "], got '" + *s + "'");
    return v;
  }

  bool boolean(const Layer& l, const std::string& key, bool fallback) const {
    auto s = text(l, key);
    if (!s) return fallback;
    if (*s != "true" && *s != "false") fail(l, "field \"" + key + "\" must be true or false, got '" + *s + "'");
    return *s == "true";
  }

  // Refuses fields the type does not read (a misspelt "kernal" would otherwise be a silent default).
  void only(const Layer& l, std::initializer_list<const char*> fields) const {
    for (const auto& [key, value] : l.node) {
      bool known = key == "type" || key == "name";
      for (const char* f : fields) known |= key == f;
      if (!known) fail(l, "has no field \"" + key + "\"");
    }
  }

  void need_image(const Layer& l, const Shape& shape) const {
    if (shape.size() != 3) fail(l, "needs image inputs (C, H, W), got " + shape_str(shape));
  }

  // The layers of `list` as a Sequential, named by their "name" (dots make deeper paths: a flat
  // list of torchvision's "encoder.layers.encoder_layer_0"; "" adds no level) or their index.
  std::unique_ptr<Sequential> sequence(const Tree& list, const std::string& path, const Args& args, Shape& shape,
                                       int depth) {
    auto seq = std::make_unique<Sequential>();
    if (depth == 0) seq->set_unit_sink(spec_.sink);  // the model's own layers are ZeRO-3's units
    std::set<std::string> taken;
    size_t index = 0;
    for (const auto& [key, node] : list) {
      const std::optional<std::string> name = text(Layer{node, path, "?", args}, "name");
      const std::string shown = name ? *name : std::to_string(index);
      const std::string child = shown.empty() ? path : path.empty() ? shown : path + "." + shown;
      const Layer named{node, child.empty() ? "<top>" : child, "?", args};
      if (shown.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.") !=
              std::string::npos ||
          shown.starts_with('.') || shown.ends_with('.') || shown.find("..") != std::string::npos)
        fail(named, "a name holds letters, digits, '_' and single dots between them, not '" + shown + "'");
      if (!shown.empty() && !taken.insert(shown).second) fail(named, "a second layer named " + shown + " here");
      seq->add(layer(node, child, args, shape, depth), name);
      ++index;
    }
    return seq;
  }

  ModulePtr layer(const Tree& node, const std::string& path, const Args& args, Shape& shape, int depth) {
    const Layer probe{node, path, "?", args};
    if (node.empty()) fail(probe, "is not an object of fields");
    const std::string type = text(probe, "type").value_or("");
    if (type.empty()) fail(probe, "needs field \"type\"");
    const Layer l{node, path, type, args};
    if (depth > 32) fail(l, "blocks nest deeper than 32 levels (a block that contains itself?)");
    budget_.add_layer(l.path, type);
    ModulePtr m = leaf_layer(l, shape);
    if (m) {
      budget_.output(l.path, type, shape);
    } else if (type == "sequential") {
      only(l, {"layers"});
      auto list = node.get_child_optional("layers");
      if (!list || list->empty()) fail(l, "needs a \"layers\" list");
      m = sequence(*list, path, args, shape, depth + 1);
    } else {
      m = type == "residual" ? residual(l, shape, depth) : block(l, shape, depth);
    }
    return m;
  }

  ModulePtr leaf_layer(const Layer& l, Shape& shape) {
    if (auto m = image_layer(l, shape)) return m;
    if (auto m = vector_layer(l, shape)) return m;
    return token_layer(l, shape);
  }

  // Layers over images (C, H, W).
  ModulePtr image_layer(const Layer& l, Shape& shape) {
    if (l.type == "conv") {
      only(l, {"out", "kernel", "stride", "padding", "bias"});
      need_image(l, shape);
      const int64_t out = integer(l, "out", {}), k = integer(l, "kernel", {}), s = integer(l, "stride", 1);
      const int64_t pad = integer(l, "padding", 0, 0);
      const Conv2dGeom g{1, shape[0], shape[1], shape[2], out, k, k, s, pad};
      if (shape[1] + 2 * pad < k || shape[2] + 2 * pad < k)
        fail(l, "input " + shape_str(shape) + " is smaller than kernel " + std::to_string(k) + " with padding " +
                    std::to_string(pad));
      budget_.take(l.path, l.type, {{out, shape[0], k, k}, {boolean(l, "bias", true) ? out : 0}});
      auto m = std::make_unique<Conv2d>(shape[0], out, k, s, pad, boolean(l, "bias", true), rng_);
      shape = {out, g.out_h(), g.out_w()};
      return m;
    }
    if (l.type == "maxpool" || l.type == "avgpool") {
      only(l, {"kernel", "stride", "padding"});
      need_image(l, shape);
      const int64_t k = integer(l, "kernel", {}), s = integer(l, "stride", k), pad = integer(l, "padding", 0, 0);
      if (2 * pad > k) fail(l, "padding " + std::to_string(pad) + " is more than half of kernel " + std::to_string(k));
      const Pool2dGeom g{1, shape[0], shape[1], shape[2], k, s, pad};
      // (h + 2 pad - k) / s + 1 truncates towards zero: a window past a smaller input still gives 1.
      if (shape[1] + 2 * pad < k || shape[2] + 2 * pad < k)
        fail(l, "input " + shape_str(shape) + " is smaller than the window " + std::to_string(k) + " with padding " +
                    std::to_string(pad));
      shape = {shape[0], g.out_h(), g.out_w()};
      return l.type == "maxpool" ? MaxPool2d(k, s, pad) : AvgPool2d(k, s, pad);
    }
    if (l.type == "batchnorm") {
      only(l, {"eps", "momentum"});
      need_image(l, shape);
      budget_.take(l.path, l.type, {{shape[0]}, {shape[0]}});
      return std::make_unique<BatchNorm2d>(shape[0], real(l, "eps", 1e-5f, 0.f, 1.f),
                                           real(l, "momentum", 0.1f, 0.f, 1.f));
    }
    if (l.type == "global_avgpool") {
      only(l, {});
      need_image(l, shape);
      shape = {shape[0]};
      return std::make_unique<GlobalAvgPool>();
    }
    return nullptr;
  }

  // Layers over the last dimension, and shape-keeping ones.
  ModulePtr vector_layer(const Layer& l, Shape& shape) {
    if (l.type == "linear") {
      only(l, {"out", "bias"});
      const int64_t out = integer(l, "out", {});
      budget_.take(l.path, l.type, {{out, shape.back()}, {boolean(l, "bias", true) ? out : 0}});
      auto m = std::make_unique<Linear>(shape.back(), out, boolean(l, "bias", true), rng_);
      shape.back() = out;
      return m;
    }
    if (l.type == "layernorm") {
      only(l, {"eps"});
      budget_.take(l.path, l.type, {{shape.back()}, {shape.back()}});
      return std::make_unique<LayerNorm>(shape.back(), real(l, "eps", 1e-5f, 0.f, 1.f));
    }
    if (l.type == "flatten") {
      only(l, {});
      shape = {shape_numel(shape)};
      return std::make_unique<Flatten>();
    }
    if (l.type == "dropout") {
      only(l, {"p"});
      return std::make_unique<Dropout>(real(l, "p", 0.5f, 0.f, 0.999f), dropout_seed_++);
    }
    if (l.type == "relu" || l.type == "gelu" || l.type == "gelu_exact") {
      only(l, {});
      return l.type == "relu" ? ReLU() : l.type == "gelu" ? GELU() : GELUExact();
    }
    return nullptr;
  }

  // Layers over tokens (T, D): a vision transformer's.
  ModulePtr token_layer(const Layer& l, Shape& shape) {
    if (l.type == "tokens") {
      only(l, {"class_token"});
      need_image(l, shape);
      const bool cls = boolean(l, "class_token", true);
      budget_.take(l.path, l.type, {{cls ? shape[0] : 0}});
      auto m = std::make_unique<PatchTokens>(shape[0], cls);
      shape = {shape[1] * shape[2] + (cls ? 1 : 0), shape[0]};
      return m;
    }
    if (l.type != "position_embedding" && l.type != "transformer_block" && l.type != "first_token") return nullptr;
    if (shape.size() != 2) fail(l, "needs tokens (T, D), got " + shape_str(shape) + " (a \"tokens\" layer makes them)");
    const int64_t width = shape[1];
    if (l.type == "position_embedding") {
      only(l, {});
      budget_.take(l.path, l.type, {{shape[0], width}});
      return std::make_unique<PositionEmbedding>(shape[0], width, rng_);
    }
    if (l.type == "first_token") {
      only(l, {});
      shape = {width};
      return std::make_unique<FirstToken>();
    }
    only(l, {"heads", "mlp", "eps"});
    const int64_t heads = integer(l, "heads", {});
    if (width % heads != 0)
      fail(l, "width " + std::to_string(width) + " is not a multiple of heads " + std::to_string(heads));
    const int64_t mlp = integer(l, "mlp", 4 * width);
    // Two LayerNorms, the attention's in_proj [3D, D] and out_proj [D, D], the MLP's two Linears.
    budget_.take(l.path, l.type,
                 {{4, width}, {3 * width, width + 1}, {width, width + 1}, {mlp, width + 1}, {width, mlp + 1}});
    return make_vit_block(width, heads, mlp, real(l, "eps", 1e-6f, 0.f, 1.f), rng_);
  }

  // body(x) + shortcut(x), then `after`. "shortcut": a list of layers, "projection" (a 1x1
  // convolution without bias and a BatchNorm, named 0 and 1, whose stride makes the body's size),
  // or absent: the identity.
  ModulePtr residual(const Layer& l, Shape& shape, int depth) {
    only(l, {"body", "shortcut", "after", "names", "shortcut_name"});
    auto body_list = l.node.get_child_optional("body");
    if (!body_list || body_list->empty()) fail(l, "needs a \"body\" list");
    const std::string names = text(l, "names").value_or("nested");
    if (names != "nested" && names != "flat") fail(l, "field \"names\" must be nested or flat, got '" + names + "'");
    const bool flat = names == "flat";
    const std::string shortcut_name = text(l, "shortcut_name").value_or("shortcut");
    Shape body_shape = shape;
    auto body = sequence(*body_list, flat ? l.path : l.path + ".body", l.args, body_shape, depth + 1);
    if (flat)
      for (const auto& [name, m] : body->children())
        if (name == shortcut_name || name == "after") fail(l, "a layer of its body is named " + name + " too");
    ModulePtr shortcut;
    Shape short_shape = shape;
    const std::string short_path = l.path + "." + (flat ? shortcut_name : "shortcut");
    if (auto sc = l.node.get_child_optional("shortcut")) {
      if (!sc->empty()) {
        shortcut = sequence(*sc, short_path, l.args, short_shape, depth + 1);
      } else if (text(l, "shortcut") == "projection") {
        if (body_shape != shape) shortcut = projection(l, shape, body_shape, short_shape);
      } else {
        fail(l, "field \"shortcut\" must be a list of layers or \"projection\"");
      }
    }
    if (short_shape != body_shape)
      fail(l, "its body gives " + shape_str(body_shape) + " but its shortcut gives " + shape_str(short_shape) +
                  (l.node.count("shortcut") ? "" : " (the identity; \"shortcut\": \"projection\" fits them)"));
    ModulePtr after;
    if (auto a = text(l, "after")) {
      if (*a != "relu" && *a != "gelu") fail(l, "field \"after\" must be relu or gelu, got '" + *a + "'");
      after = *a == "relu" ? ReLU() : GELU();
    }
    shape = body_shape;
    return std::make_unique<Residual>(std::move(body), std::move(shortcut), ResidualNames{flat, shortcut_name},
                                      std::move(after));
  }

  ModulePtr projection(const Layer& l, const Shape& in, const Shape& out, Shape& shape) {
    if (in.size() != 3 || out.size() != 3)
      fail(l, "a projection shortcut needs images, its body gives " + shape_str(out));
    const int64_t stride = (in[1] + out[1] - 1) / out[1];
    const Conv2dGeom g{1, in[0], in[1], in[2], out[0], 1, 1, stride, 0};
    budget_.take(l.path + ".shortcut", "projection", {{out[0], in[0]}, {2, out[0]}});
    auto p = std::make_unique<Sequential>();
    p->add(std::make_unique<Conv2d>(in[0], out[0], 1, stride, 0, false, rng_));
    p->add(std::make_unique<BatchNorm2d>(out[0]));
    shape = {out[0], g.out_h(), g.out_w()};
    return p;
  }

  // A block of the definition's "blocks": {"args": {name: default, ...}, "layer": {...}}; a default
  // of null (or "") makes the argument required. The call's fields are its arguments.
  ModulePtr block(const Layer& l, Shape& shape, int depth) {
    auto it = blocks_.find(l.type);
    if (it == blocks_.end()) {
      std::string known =
          "conv, linear, batchnorm, layernorm, relu, gelu, gelu_exact, maxpool, avgpool, "
          "global_avgpool, flatten, dropout, tokens, position_embedding, transformer_block, "
          "first_token, sequential, residual";
      for (const auto& [name, b] : blocks_) known += ", " + name;
      fail(l, "unknown type (types: " + known + ")");
    }
    const Tree& def = *it->second;
    auto inner = def.get_child_optional("layer");
    if (!inner) fail(l, "its block \"" + l.type + "\" in \"blocks\" has no \"layer\"");
    Args args;
    if (auto declared = def.get_child_optional("args"))
      for (const auto& [name, value] : *declared) {
        auto given = text(l, name);
        if (!given && (value.data().empty() || value.data() == "null")) fail(l, "needs argument \"" + name + "\"");
        args[name] = given ? *given : value.data();
      }
    for (const auto& [key, value] : l.node)
      if (key != "type" && key != "name" && !args.count(key))
        fail(l, "block \"" + l.type + "\" has no argument \"" + key + "\"");
    return layer(*inner, l.path, args, shape, depth + 1);
  }

  const Tree& def_;
  const ModelSpec& spec_;
  Rng& rng_;
  ModelBudget& budget_;
  uint64_t dropout_seed_;
  std::string where_;
  std::map<std::string, const Tree*> blocks_;
  const Args no_args_;
};

}  // namespace

std::string read_model_file(const std::string& path) {
  DT_INPUT_CHECK(std::filesystem::is_regular_file(path), "model file '" << path << "' does not exist");
  std::error_code ec;
  const uintmax_t bytes = std::filesystem::file_size(path, ec);
  DT_INPUT_CHECK(!ec && bytes <= kMaxModelFileBytes, "model file '" << path << "' holds " << bytes
                                                                    << " bytes, more than a model file's "
                                                                    << kMaxModelFileBytes);
  std::ifstream file(path, std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  DT_INPUT_CHECK(file, "cannot read model file '" << path << "'");
  const std::string ext = std::filesystem::path(path).extension().string();
  const bool ini = ext == ".ini" || ext == ".cfg";
  DT_INPUT_CHECK(ini || json_shape(text).nesting <= kMaxNesting,
                 "model file '" << path << "' nests objects and lists deeper than " << kMaxNesting << " levels");
  Tree tree;
  try {
    std::istringstream in(text);
    if (ini) {
      Tree sections;
      pt::read_ini(in, sections);
      tree = tree_of_ini(sections);
    } else {
      pt::read_json(in, tree);
    }
  } catch (const pt::file_parser_error& e) {
    throw InputError("model file '" + path + "'" + (e.line() ? " line " + std::to_string(e.line()) : "") + ": " +
                     e.message());
  } catch (const pt::ptree_error& e) {
    throw InputError("model file '" + path + "': " + e.what());
  }
  if (tree.get<std::string>("name", "").empty()) tree.put("name", std::filesystem::path(path).stem().string());
  DT_INPUT_CHECK(tree.get<std::string>("name") != "gpt", "model file '" << path << "': the name gpt is the built-in "
                                                                        << "language model's (--model gpt)");
  std::ostringstream out;
  pt::write_json(out, tree, false);
  // The definition a checkpoint keeps must read back: write_json passes bytes that are not UTF-8
  // (an INI file's) through unchecked, and read_json refuses them.
  try {
    parse_definition(out.str());
  } catch (const pt::ptree_error& e) {
    throw InputError("model file '" + path + "' does not give a definition that reads back (" + e.what() +
                     "; text that is not UTF-8?)");
  }
  return out.str();
}

std::string model_definition_name(const std::string& definition) {
  try {
    return parse_definition(definition).get<std::string>("name", "");
  } catch (const pt::ptree_error& e) {
    throw InputError(std::string("a model definition does not parse: ") + e.what());
  }
}

std::optional<GptConfig> language_model_shape(const std::string& definition, const std::string& source) {
  Tree tree;
  try {
    tree = parse_definition(definition);
  } catch (const pt::ptree_error& e) {
    throw InputError("model file '" + source + "' does not parse: " + e.what());
  }
  const auto lm = tree.get_child_optional("language_model");
  if (!lm) return std::nullopt;
  const std::string where = "model file '" + source + "', language_model.";
  std::set<std::string> seen;
  auto text = [&](const char* key) -> std::optional<std::string> {
    seen.insert(key);
    const auto v = lm->get_child_optional(pt::ptree::path_type(key, '\0'));
    if (!v) return std::nullopt;
    DT_INPUT_CHECK(v->empty(), where << key << " must be a value, not a section");
    return v->data();
  };
  auto integer = [&](const char* key, int64_t fallback, int64_t low) {
    const auto v = text(key);
    if (!v) return fallback;
    int64_t n = 0;
    const auto [end, ec] = std::from_chars(v->data(), v->data() + v->size(), n);
    DT_INPUT_CHECK(ec == std::errc() && end == v->data() + v->size() && n >= low && n <= (int64_t{1} << 32),
                   where << key << " is '" << *v << "', not an integer from " << low << " to 2^32");
    return n;
  };
  auto number = [&](const char* key, float fallback) {
    const auto v = text(key);
    if (!v) return fallback;
    char* end = nullptr;
    const float f = std::strtof(v->c_str(), &end);
    DT_INPUT_CHECK(!v->empty() && end == v->c_str() + v->size() && std::isfinite(f) && f > 0.f,
                   where << key << " is '" << *v << "', not a positive number");
    return f;
  };
  auto choice = [&](const char* key, const char* no, const char* yes, bool fallback) {
    const auto v = text(key);
    if (!v) return fallback;
    DT_INPUT_CHECK(*v == no || *v == yes, where << key << " is '" << *v << "', not " << no << " or " << yes);
    return *v == yes;
  };
  GptConfig g;
  g.layers = integer("layers", 0, 1);
  g.width = integer("width", 0, 1);
  g.heads = integer("heads", 0, 1);
  DT_INPUT_CHECK(g.layers > 0 && g.width > 0 && g.heads > 0, where << "layers, width and heads are required");
  g.context = integer("context", 128, 1);
  g.kv_heads = integer("kv_heads", 0, 0);
  g.mlp_width = integer("mlp_width", 0, 0);
  g.rms_norm = choice("norm", "layer", "rms", false);
  g.rotary = choice("positions", "learned", "rotary", false);
  g.swiglu = choice("mlp", "gelu", "swiglu", false);
  g.bias = choice("bias", "false", "true", true);
  g.tied = choice("tied", "false", "true", true);
  g.rope_base = number("rope_base", g.rope_base);
  g.norm_eps = number("norm_eps", g.norm_eps);
  DT_INPUT_CHECK(g.width % g.heads == 0 && g.heads % g.kv() == 0,
                 where << "heads (" << g.heads << ") must divide width (" << g.width
                       << ") and be a multiple of kv_heads (" << g.kv() << ")");
  DT_INPUT_CHECK(!g.rotary || (g.width / g.heads) % 2 == 0, where << "positions rotary needs an even head width");
  if (g.swiglu && g.mlp_width == 0) g.mlp_width = (8 * g.width / 3 + 31) / 32 * 32;  // Llama's
  for (const auto& [key, value] : *lm)
    DT_INPUT_CHECK(seen.count(key), where << key << " is not a field of a language model");
  return g;
}

std::unique_ptr<Sequential> build_model_definition(const ModelSpec& spec, Rng& rng, ModelBudget& budget) {
  Tree def;
  try {
    def = parse_definition(spec.definition);
  } catch (const pt::ptree_error& e) {
    throw InputError("model " + spec.name + ": its stored definition does not parse: " + e.what());
  }
  return DefinitionBuilder(def, spec, rng, budget).model();
}

}  // namespace dtrain::nn
