// Sizes computed from shapes that files and attributes give: overflow-checked, named in the error.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "dtrain/core/tensor.h"

using namespace dtrain;

namespace {

std::string input_error(const Shape& s, const std::string& what = "") {
  try {
    what.empty() ? shape_numel(s) : shape_numel(s, what);
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(ShapeNumel, CountsElements) {
  EXPECT_EQ(shape_numel({2, 3, 4}), 24);
  EXPECT_EQ(shape_numel({}), 1);
  EXPECT_EQ(shape_numel({0, 7}), 0);
  EXPECT_EQ(shape_numel({int64_t{1} << 31, int64_t{1} << 31}), int64_t{1} << 62);
  EXPECT_ANY_THROW(shape_numel({int64_t{1} << 31, int64_t{1} << 31, 2}));  // 2^63
}

TEST(ShapeNumel, RefusesAProductPastInt64NamingTheShape) {
  const int64_t big = int64_t{1} << 32;
  EXPECT_EQ(input_error({big, big}), "shape [4294967296, 4294967296] has more than 2^63 elements");
  // A shape of no rows still has a row's size: the product of the non-zero dimensions must fit.
  EXPECT_EQ(input_error({0, big, big}), "shape [0, 4294967296, 4294967296] has more than 2^63 elements");
  EXPECT_EQ(input_error({3, -2}), "shape [3, -2] has a negative dimension");
  EXPECT_EQ(input_error({big, big}, "'f.h5': attribute sample_shape"),
            "'f.h5': attribute sample_shape: shape [4294967296, 4294967296] has more than 2^63 elements");
}

TEST(TensorEmpty, RefusesMoreThan2To63BytesBeforeAllocating) {
  EXPECT_ANY_THROW(Tensor::empty({int64_t{1} << 62}, DType::F32));
  EXPECT_THROW(Tensor::empty({int64_t{1} << 40, int64_t{1} << 40}), InputError);
}
