// Builds a model from the installed library and takes one SGD step on a fixed batch.
#include <cstdio>

#include "dtrain/nn/models.h"
#include "dtrain/optim/optimizer.h"

int main() {
  using namespace dtrain;
  auto model = nn::make_model({"mlp", {1, 4, 4}, 3, {8}});
  optim::SGD opt(model->parameters(), {.momentum = 0.9f});
  Tensor x = Tensor::full({2, 1, 4, 4}, 0.5f);
  Tensor y = Tensor::zeros({2}, DType::I32);
  nn::SoftmaxCrossEntropy ce;
  float before = ce.forward(model->forward(x), y);
  for (int i = 0; i < 20; ++i) {
    opt.zero_grad();
    ce.forward(model->forward(x), y);
    model->backward(ce.backward());
    opt.step(0.1f);
  }
  float after = ce.forward(model->forward(x), y);
  std::printf("consumer: loss %.4f -> %.4f\n", before, after);
  return after < before ? 0 : 1;
}
