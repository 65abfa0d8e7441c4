// Int8 checkpoint fields and calibration batches (include/dtrain/train/quantize.h).
#include "dtrain/train/quantize.h"

#include <algorithm>

#include "dtrain/data/loader.h"

namespace dtrain::train {

// Format 2: 7-bit weights, each step's buffers (src, dst) and the residual flag. Format 1 files
// hold 8-bit weights, which overflow oneDNN's kernels without VNNI: they are refused.
static const char* kInt8Format = "dtrain-int8-2";

static Tensor f32_tensor(const std::vector<float>& v) { return Tensor::from({static_cast<int64_t>(v.size())}, v); }

void write_int8_fields(const nn::Int8Spec& spec, CheckpointState& s) {
  s.strings["int8"] = kInt8Format;
  s.tensors["int8/input_range"] = f32_tensor({spec.input_range});
  s.ints["int8_layers"] = static_cast<int64_t>(spec.layers.size());
  for (size_t j = 0; j < spec.layers.size(); ++j) {
    const nn::Int8Layer& l = spec.layers[j];
    const std::string k = "int8/" + std::to_string(j) + "/";
    const bool conv = l.kind == nn::Int8Layer::Kind::Conv;
    std::vector<int64_t> geom = conv ? std::vector<int64_t>{0, l.conv.c, l.conv.h, l.conv.w, l.conv.k, l.conv.r,
                                                            l.conv.s, l.conv.stride, l.conv.pad, l.relu}
                                     : std::vector<int64_t>{1, l.pool_c, l.pool_h, l.pool_w, l.pool_kernel,
                                                            l.pool_stride};
    geom.insert(geom.end(), {l.src, l.dst, l.residual});
    Tensor g = Tensor::empty({static_cast<int64_t>(geom.size())}, DType::I64);
    std::copy(geom.begin(), geom.end(), g.data<int64_t>());
    s.tensors[k + "geometry"] = g;
    s.tensors[k + "out_range"] = f32_tensor({l.out_range});
    if (!conv) continue;
    Tensor w = Tensor::empty({l.conv.k, l.conv.c, l.conv.r, l.conv.s}, DType::U8);
    std::copy(l.weights.begin(), l.weights.end(), w.data<int8_t>());
    s.tensors[k + "weight_s8"] = w;
    s.tensors[k + "weight_scale"] = f32_tensor(l.weight_scales);
    s.tensors[k + "bias"] = f32_tensor(l.bias);
  }
}

bool is_int8_checkpoint(const CheckpointState& s) { return s.strings.count("int8") > 0; }

static const Tensor& entry(const CheckpointState& s, const std::string& path, const std::string& name, DType t,
                           int64_t numel) {
  auto it = s.tensors.find(name);
  DT_INPUT_CHECK(it != s.tensors.end(), "int8 checkpoint '" << path << "' has no " << name);
  DT_INPUT_CHECK(it->second.dtype() == t && (numel < 0 || it->second.numel() == numel),
                 "int8 checkpoint '" << path << "': " << name << " is " << it->second.str());
  return it->second;
}

static std::vector<float> floats(const Tensor& t) { return std::vector<float>(t.f32(), t.f32() + t.numel()); }

static nn::Int8Layer read_layer(const CheckpointState& s, const std::string& path, size_t j) {
  const std::string k = "int8/" + std::to_string(j) + "/";
  const Tensor& g = entry(s, path, k + "geometry", DType::I64, -1);
  const int64_t* v = g.data<int64_t>();
  nn::Int8Layer l;
  l.name = "int8 step " + std::to_string(j);
  l.out_range = entry(s, path, k + "out_range", DType::F32, 1).f32()[0];
  const int64_t own = g.numel() > 0 && v[0] == 0 ? 10 : 6;  // values before the buffers
  DT_INPUT_CHECK(g.numel() == own + 3, "int8 checkpoint '" << path << "': " << k << "geometry is " << g.str());
  const int64_t* b = v + own;  // src, dst, residual (Int8Model checks that the steps chain)
  l.src = static_cast<int>(std::clamp<int64_t>(b[0], -1, 1 << 10));
  l.dst = static_cast<int>(std::clamp<int64_t>(b[1], -1, 1 << 10));
  l.residual = b[2] != 0;
  if (v[0] == 1) {
    l.kind = nn::Int8Layer::Kind::MaxPool;
    l.pool_c = v[1], l.pool_h = v[2], l.pool_w = v[3], l.pool_kernel = v[4], l.pool_stride = v[5];
    return l;
  }
  l.conv = {v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8]};
  l.relu = v[9] != 0;
  const Tensor& w = entry(s, path, k + "weight_s8", DType::U8, l.conv.k * l.conv.c * l.conv.r * l.conv.s);
  l.weights.assign(w.data<int8_t>(), w.data<int8_t>() + w.numel());
  for (int8_t q : l.weights)
    DT_INPUT_CHECK(q >= -int8::kWeightMax && q <= int8::kWeightMax,
                   "int8 checkpoint '" << path << "': " << k << "weight_s8 holds " << int{q} << ", outside [-63, 63]");
  l.weight_scales = floats(entry(s, path, k + "weight_scale", DType::F32, l.conv.k));
  l.bias = floats(entry(s, path, k + "bias", DType::F32, l.conv.k));
  return l;
}

nn::Int8Spec read_int8_fields(const CheckpointState& s, const std::string& path) {
  auto f = s.strings.find("int8");
  DT_INPUT_CHECK(f != s.strings.end(), "checkpoint '" << path << "' is not an int8 checkpoint (make one with dtrain "
                                                     << "quantize)");
  DT_INPUT_CHECK(f->second == kInt8Format, "int8 checkpoint '" << path << "' is of format " << f->second << ", not "
                                                               << kInt8Format << ": quantize its fp32 checkpoint again");
  nn::Int8Spec spec;
  auto shape = s.int_lists.find("input_shape");
  auto count = s.ints.find("int8_layers");
  DT_INPUT_CHECK(shape != s.int_lists.end() && count != s.ints.end() && count->second > 0,
                 "int8 checkpoint '" << path << "' has no input_shape or int8_layers");
  spec.input = Shape(shape->second.begin(), shape->second.end());
  spec.input_range = entry(s, path, "int8/input_range", DType::F32, 1).f32()[0];
  for (int64_t j = 0; j < count->second; ++j) spec.layers.push_back(read_layer(s, path, static_cast<size_t>(j)));
  return spec;
}

std::vector<Tensor> calibration_batches(std::shared_ptr<const data::ShardedHdf5Dataset> ds, int64_t batch,
                                        int64_t count, const std::vector<float>& mean, const std::vector<float>& std) {
  DT_INPUT_CHECK(count > 0, "option --calibration-batches must be > 0, got " << count);
  data::LoaderOptions lo;
  lo.batch_size = batch;
  lo.shuffle = false;
  lo.normalize = true;
  lo.mean = mean;
  lo.std = std;
  data::DataLoader loader(ds, lo);
  loader.start_epoch(0);
  std::vector<Tensor> out;
  data::Batch b;
  while (static_cast<int64_t>(out.size()) < count && loader.next(b)) out.push_back(b.inputs.clone());
  return out;
}

nn::Int8Spec quantize_image_model(ImageCheckpoint& fp32, std::shared_ptr<const data::ShardedHdf5Dataset> calib,
                                  int64_t batch, int64_t count) {
  std::vector<Tensor> batches = calibration_batches(calib, batch, count, fp32.mean, fp32.std);
  return nn::quantize_model(*fp32.model, fp32.spec.input, nn::calibrate_ranges(*fp32.model, batches));
}

CheckpointState int8_checkpoint(const CheckpointState& fp32, const nn::Int8Spec& spec) {
  CheckpointState s;
  for (const char* k : {"model"}) s.strings[k] = fp32.strings.at(k);
  s.ints["classes"] = fp32.ints.at("classes");
  for (const char* k : {"input_shape", "hidden", "channels"})
    if (fp32.int_lists.count(k)) s.int_lists[k] = fp32.int_lists.at(k);
  for (const char* k : {"meta/norm_mean", "meta/norm_std"})
    if (fp32.tensors.count(k)) s.tensors[k] = fp32.tensors.at(k);
  write_int8_fields(spec, s);
  return s;
}

}  // namespace dtrain::train
