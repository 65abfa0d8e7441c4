#pragma once
// Int8 checkpoints and calibration data for `dtrain quantize` and `dtrain eval --int8`.
//
// An int8 checkpoint is a dtrain checkpoint file whose attribute "int8" is "dtrain-int8-2"; it
// keeps the fp32 model's "model", "classes" and "input_shape" fields and its input normalisation
// ("meta/norm_mean", "meta/norm_std"), and per int8 step j (nn::Int8Layer) the tensors
// "int8/<j>/geometry" (i64: kind, then c h w k r s stride pad relu for a conv, c h w kernel stride
// for a max pool, then the buffers src dst and the residual flag), "int8/<j>/weight_s8" (the s8
// weights (K, C, R, S) in [-63, 63], stored as their bytes in a u8 dataset: HDF5 checkpoints have
// no s8 dtype), "int8/<j>/weight_scale" (K), "int8/<j>/bias" (K) and "int8/<j>/out_range" (1);
// "int8/input_range" (1) is the input's calibrated max |x|. Format 1 (8-bit weights, two buffers
// in turn) is refused: such weights overflow oneDNN's kernels on processors without VNNI.
#include <memory>
#include <string>
#include <vector>

#include "dtrain/data/dataset.h"
#include "dtrain/nn/quantized.h"
#include "dtrain/train/checkpoint.h"
#include "dtrain/train/trainer.h"

namespace dtrain::train {

void write_int8_fields(const nn::Int8Spec& spec, CheckpointState& s);
bool is_int8_checkpoint(const CheckpointState& s);
// Throws InputError naming `path` and the missing or malformed entry.
nn::Int8Spec read_int8_fields(const CheckpointState& s, const std::string& path);

// The first `count` batches of `ds` in order (no shuffling, no augmentation), normalised with
// `mean`/`std`: the same batches every time, so calibration is reproducible.
std::vector<Tensor> calibration_batches(std::shared_ptr<const data::ShardedHdf5Dataset> ds, int64_t batch,
                                        int64_t count, const std::vector<float>& mean, const std::vector<float>& std);

// The int8 form of an fp32 checkpoint's model, calibrated on the first `count` batches of `calib`.
nn::Int8Spec quantize_image_model(ImageCheckpoint& fp32, std::shared_ptr<const data::ShardedHdf5Dataset> calib,
                                  int64_t batch, int64_t count);
// The int8 checkpoint of `spec`: the fp32 checkpoint's model fields and normalisation, and the int8 fields.
CheckpointState int8_checkpoint(const CheckpointState& fp32, const nn::Int8Spec& spec);

}  // namespace dtrain::train
