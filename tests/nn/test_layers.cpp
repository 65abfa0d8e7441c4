#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <tuple>

#include "dtrain/nn/models.h"
#include "gradcheck.h"

using namespace dtrain;
using dtrain::test::gradcheck;
using dtrain::test::random_tensor;

TEST(Gradients, Linear) {
  Rng rng(1);
  nn::Linear l(7, 5, true, rng);
  gradcheck(l, random_tensor({4, 7}, rng));
}

TEST(Gradients, LinearOnThreeDimensionalInput) {
  Rng rng(2);
  nn::Linear l(6, 3, false, rng);
  gradcheck(l, random_tensor({2, 3, 6}, rng));
}

// Under bf16 math a Linear's forward and input gradient read the weight's working copy (made by
// update_working_copies), bit for bit what rounding the master gives; in fp32 the copy is dropped.
// Changing the master without a new copy shows that the copy, not the master, is what is read.
TEST(WorkingCopies, LinearReadsTheCopyTheEngineWouldRoundTo) {
  Rng rng(3);
  nn::Linear l(24, 32, true, rng);
  Tensor x = random_tensor({20, 24}, rng), dy = random_tensor({20, 32}, rng);
  Engine& e = cpu_engine();
  struct Restore {
    ~Restore() { cpu_engine().set_math_precision(MathPrecision::F32); }
  } restore;
  e.set_math_precision(MathPrecision::BF16);
  auto run = [&]() {
    Tensor y = l.forward(x).clone();
    return std::pair{y, l.backward(dy).clone()};
  };
  auto [y_master, dx_master] = run();
  std::vector<nn::Parameter*> params = l.parameters();
  nn::update_working_copies(params, MathPrecision::BF16);
  ASSERT_TRUE(l.weight().working.defined());
  EXPECT_EQ(l.weight().working.dtype(), DType::BF16);
  EXPECT_FALSE(l.bias()->working.defined()) << "no GEMM reads the bias whole";
  auto [y_copy, dx_copy] = run();
  for (int64_t i = 0; i < y_master.numel(); ++i) ASSERT_EQ(y_master.f32()[i], y_copy.f32()[i]) << i;
  for (int64_t i = 0; i < dx_master.numel(); ++i) ASSERT_EQ(dx_master.f32()[i], dx_copy.f32()[i]) << i;
  // A master changed after the copy was made: the layer still reads the copy (so trainers must
  // make copies after every update), and a new copy brings the change in.
  l.weight().value.f32()[0] += 0.5f;
  auto [y_stale, dx_stale] = run();
  for (int64_t i = 0; i < y_master.numel(); ++i) ASSERT_EQ(y_master.f32()[i], y_stale.f32()[i]) << i;
  nn::update_working_copies(params, MathPrecision::BF16);
  EXPECT_NE(run().first.f32()[0], y_master.f32()[0]);
  nn::update_working_copies(params, MathPrecision::F32);
  EXPECT_FALSE(l.weight().working.defined());
}

// Under bf16/f16 math a Linear rounds dy once for both backward GEMMs: its dW, db and dx are
// bitwise the engine's own GEMMs on the f32 dy (which round it inside), for both precisions.
TEST(LowPrecisionLinear, RoundingDyOnceChangesNoBit) {
  Rng rng(12);
  Tensor x = random_tensor({40, 24}, rng), dy = random_tensor({40, 32}, rng);
  Engine& e = cpu_engine();
  struct Restore {
    ~Restore() { cpu_engine().set_math_precision(MathPrecision::F32); }
  } restore;
  for (MathPrecision prec : {MathPrecision::BF16, MathPrecision::F16}) {
    e.set_math_precision(prec);
    Rng init(5);
    nn::Linear l(24, 32, true, init);
    l.forward(x);
    Tensor dx = l.backward(dy).clone();
    Tensor dw = Tensor::zeros({32, 24}), want_dx = Tensor::zeros({40, 24});
    e.gemm(true, false, 32, 24, 40, 1.f, dy, x, 1.f, dw);
    e.gemm(false, false, 40, 24, 32, 1.f, dy, l.weight().value, 0.f, want_dx);
    for (int64_t i = 0; i < dw.numel(); ++i)
      ASSERT_EQ(dw.f32()[i], l.weight().grad.f32()[i]) << "dW " << i << " " << math_precision_name(prec);
    for (int64_t i = 0; i < dx.numel(); ++i)
      ASSERT_EQ(want_dx.f32()[i], dx.f32()[i]) << "dx " << i << " " << math_precision_name(prec);
    // The products did round: fp32 math gives other bits.
    e.set_math_precision(MathPrecision::F32);
    Tensor f32_dx = Tensor::zeros({40, 24});
    e.gemm(false, false, 40, 24, 32, 1.f, dy, l.weight().value, 0.f, f32_dx);
    bool differs = false;
    for (int64_t i = 0; i < dx.numel(); ++i) differs |= f32_dx.f32()[i] != dx.f32()[i];
    EXPECT_TRUE(differs) << math_precision_name(prec);
  }
}

TEST(Gradients, Conv2dStrideAndPadding) {
  for (auto [k, s, p] : {std::tuple{3, 1, 1}, {3, 2, 1}, {1, 1, 0}, {5, 2, 2}}) {
    Rng rng(3);
    nn::Conv2d c(3, 4, k, s, p, true, rng);
    gradcheck(c, random_tensor({2, 3, 9, 9}, rng));
  }
}

TEST(Gradients, Conv2dSingleInputChannel) {
  Rng rng(31);
  nn::Conv2d c(1, 16, 3, 1, 1, true, rng);
  gradcheck(c, random_tensor({2, 1, 8, 8}, rng));
}

TEST(Gradients, MaxPool) {
  Rng rng(4);
  nn::Pool2d pool(PoolKind::Max, 2, 2);
  // Well-separated values so a nudge of eps never changes which element is the max.
  Tensor x = Tensor::empty({2, 3, 6, 6});
  std::vector<int64_t> perm(x.numel());
  for (int64_t i = 0; i < x.numel(); ++i) perm[i] = i;
  for (int64_t i = x.numel() - 1; i > 0; --i) std::swap(perm[i], perm[rng.below(i + 1)]);
  for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = 0.1f * static_cast<float>(perm[i]);
  gradcheck(pool, x);
}

// Max pooling against a loop written here: padding never wins, the first maximum of a window (row
// major) takes the gradient when values tie (zeros after ReLU do). Covers the 2x2/2 case and
// overlapping, padded windows. (NaN: the engine's own loop propagates it, oneDNN's kernels may not.)
TEST(MaxPool, MatchesANaiveLoopWithTiesAndPadding) {
  for (auto [k, s, p] : {std::tuple{2, 2, 0}, {3, 2, 1}, {3, 1, 1}}) {
    Rng rng(44);
    const int64_t n = 2, c = 3, h = 7, w = 8;
    Tensor x = Tensor::empty({n, c, h, w});
    for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = std::floor(rng.uniform(-2.f, 3.f));  // ties, zeros
    nn::Pool2d pool(PoolKind::Max, k, s, p);
    pool.train();
    Tensor y = pool.forward(x);
    const int64_t oh = (h + 2 * p - k) / s + 1, ow = (w + 2 * p - k) / s + 1;
    ASSERT_EQ(y.numel(), n * c * oh * ow);
    Tensor dy = Tensor::empty(y.shape());
    for (int64_t i = 0; i < dy.numel(); ++i) dy.f32()[i] = static_cast<float>(i % 5 + 1);
    Tensor dx = pool.backward(dy);
    std::vector<float> want_dx(static_cast<size_t>(x.numel()), 0.f);
    for (int64_t pl = 0; pl < n * c; ++pl)
      for (int64_t i = 0; i < oh; ++i)
        for (int64_t j = 0; j < ow; ++j) {
          float m = -std::numeric_limits<float>::infinity();
          int64_t at = -1;
          for (int64_t a = i * s - p; a < i * s - p + k; ++a)
            for (int64_t b = j * s - p; b < j * s - p + k; ++b) {
              if (a < 0 || a >= h || b < 0 || b >= w || (at >= 0 && std::isnan(m))) continue;
              float v = x.f32()[pl * h * w + a * w + b];
              if (at < 0 || v > m || std::isnan(v)) m = v, at = pl * h * w + a * w + b;
            }
          const int64_t o = pl * oh * ow + i * ow + j;
          if (std::isnan(m))
            EXPECT_TRUE(std::isnan(y.f32()[o])) << "k" << k << " s" << s << " p" << p << " out " << o;
          else
            EXPECT_EQ(y.f32()[o], m) << "k" << k << " s" << s << " p" << p << " out " << o;
          want_dx[static_cast<size_t>(at)] += dy.f32()[o];
        }
    for (int64_t i = 0; i < x.numel(); ++i)
      ASSERT_EQ(dx.f32()[i], want_dx[static_cast<size_t>(i)]) << "k" << k << " s" << s << " p" << p << " dx " << i;
  }
}

TEST(Gradients, AvgPoolAndGlobalAvgPool) {
  Rng rng(5);
  nn::Pool2d pool(PoolKind::Avg, 3, 2, 1);
  gradcheck(pool, random_tensor({2, 2, 7, 7}, rng));
  nn::GlobalAvgPool gap;
  gradcheck(gap, random_tensor({2, 3, 4, 5}, rng));
}

TEST(Gradients, ReluAndGelu) {
  Rng rng(6);
  nn::Activation relu(Unary::Relu), gelu(Unary::Gelu);
  Tensor x = random_tensor({3, 17}, rng);
  for (int64_t i = 0; i < x.numel(); ++i)  // keep away from the kink at 0
    if (std::abs(x.f32()[i]) < 0.05f) x.f32()[i] = 0.3f;
  gradcheck(relu, x);
  gradcheck(gelu, random_tensor({3, 17}, rng));
}

TEST(Gradients, BatchNorm2dTraining) {
  Rng rng(7);
  nn::BatchNorm2d bn(3);
  for (nn::Parameter* p : bn.parameters())  // non-trivial gamma and beta
    for (int64_t i = 0; i < p->value.numel(); ++i) p->value.f32()[i] = 0.5f + rng.uniform();
  gradcheck(bn, random_tensor({4, 3, 3, 3}, rng), 7, 1e-2f, 3e-2);
}

TEST(Gradients, LayerNorm) {
  Rng rng(8);
  nn::LayerNorm ln(10);
  for (nn::Parameter* p : ln.parameters())
    for (int64_t i = 0; i < p->value.numel(); ++i) p->value.f32()[i] = 0.5f + rng.uniform();
  gradcheck(ln, random_tensor({5, 10}, rng), 7, 1e-2f, 3e-2);
}

TEST(Gradients, ResidualWithShortcut) {
  Rng rng(9);
  auto body = std::make_unique<nn::Sequential>();
  body->add(std::make_unique<nn::Conv2d>(2, 4, 3, 1, 1, true, rng));
  body->add(nn::GELU());
  nn::Residual res(std::move(body), std::make_unique<nn::Conv2d>(2, 4, 1, 1, 0, false, rng));
  gradcheck(res, random_tensor({2, 2, 5, 5}, rng));
  nn::Residual identity(std::make_unique<nn::Linear>(6, 6, true, rng));
  gradcheck(identity, random_tensor({3, 6}, rng));
}

TEST(Gradients, DropoutUsesTheSameMaskInBackward) {
  Rng rng(10);
  nn::Dropout d(0.5f, 11);
  Tensor x = random_tensor({4, 50}, rng);
  Tensor y = d.forward(x).clone();
  Tensor ones = Tensor::full({4, 50}, 1.f);
  Tensor dx = d.backward(ones);
  int zeros = 0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    float m = dx.f32()[i];
    EXPECT_TRUE(m == 0.f || m == 2.f) << m;
    EXPECT_FLOAT_EQ(y.f32()[i], x.f32()[i] * m);
    zeros += (m == 0.f);
  }
  EXPECT_GT(zeros, 60);
  EXPECT_LT(zeros, 140);
  d.eval();
  Tensor z = d.forward(x);
  EXPECT_EQ(z.f32()[3], x.f32()[3]);
}

TEST(Gradients, SoftmaxCrossEntropy) {
  Rng rng(12);
  Tensor logits = random_tensor({5, 7}, rng);
  Tensor labels = Tensor::empty({5}, DType::I32);
  for (int i = 0; i < 5; ++i) labels.data<int32_t>()[i] = (i * 3) % 7;
  nn::SoftmaxCrossEntropy ce;
  ce.forward(logits, labels);
  Tensor g = ce.backward().clone();
  const float eps = 1e-2f;
  for (int64_t i = 0; i < logits.numel(); ++i) {
    float keep = logits.f32()[i];
    logits.f32()[i] = keep + eps;
    double up = ce.forward(logits, labels);
    logits.f32()[i] = keep - eps;
    double down = ce.forward(logits, labels);
    logits.f32()[i] = keep;
    EXPECT_NEAR((up - down) / (2 * eps), g.f32()[i], 2e-3) << i;
  }
}

TEST(Gradients, CrossEntropyValueAndAccuracy) {
  // Uniform logits: loss = log(C); argmax ties resolve to class 0.
  Tensor logits = Tensor::zeros({2, 4});
  Tensor labels = Tensor::empty({2}, DType::I32);
  labels.data<int32_t>()[0] = 0;
  labels.data<int32_t>()[1] = 3;
  nn::SoftmaxCrossEntropy ce;
  int64_t correct = -1;
  EXPECT_NEAR(ce.forward(logits, labels, &correct), std::log(4.0), 1e-6);
  EXPECT_EQ(correct, 1);
}

TEST(Gradients, CrossEntropyAccumulatesLikeForward) {
  // accumulate() adds the loss sums and hits of several batches into one stats row, and backward()
  // after it is backward() after forward().
  Rng rng(14);
  Tensor a = random_tensor({6, 5}, rng), b = random_tensor({4, 5}, rng);
  Tensor la = Tensor::empty({6}, DType::I32), lb = Tensor::empty({4}, DType::I32);
  for (int i = 0; i < 6; ++i) la.data<int32_t>()[i] = (i * 2) % 5;
  for (int i = 0; i < 4; ++i) lb.data<int32_t>()[i] = (i * 3 + 1) % 5;
  nn::SoftmaxCrossEntropy ce;
  int64_t ha = 0, hb = 0;
  ce.forward(a, la, &ha);
  const double sa = ce.last_loss_sum();
  ce.forward(b, lb, &hb);
  const double sb = ce.last_loss_sum();
  Tensor gb = ce.backward(0.5f).clone();
  Tensor stats = Tensor::zeros({kXentStatsFloats});
  nn::SoftmaxCrossEntropy acc;
  acc.accumulate(a, la, stats);
  acc.accumulate(b, lb, stats);
  const XentStats st = xent_stats(stats);
  EXPECT_DOUBLE_EQ(st.loss_sum, sa + sb);
  EXPECT_EQ(st.hits, static_cast<uint64_t>(ha + hb));
  EXPECT_EQ(st.bad_label, 0);
  Tensor g = acc.backward(0.5f);
  for (int64_t i = 0; i < g.numel(); ++i) EXPECT_EQ(g.f32()[i], gb.f32()[i]) << i;
  lb.data<int32_t>()[2] = 5;  // out of range: the CPU engine says so at once
  EXPECT_THROW(acc.accumulate(b, lb, stats), Error);
  Tensor wrong = Tensor::zeros({3});
  EXPECT_THROW(acc.accumulate(a, la, wrong), Error);
}

TEST(Models, SimpleCnnGradientsEndToEnd) {
  nn::ModelSpec spec{"simple_cnn", {1, 8, 8}, 3};
  auto m = nn::make_model(spec);
  Rng rng(13);
  gradcheck(*m, random_tensor({2, 1, 8, 8}, rng), 7, 1e-3f, 3e-2, 12);
}

TEST(Models, ShapesAndParameterCounts) {
  auto cnn = nn::make_model({"simple_cnn", {1, 28, 28}, 10});
  // conv1 16*1*9+16, conv2 32*16*9+32, linear 1568*10+10
  EXPECT_EQ(cnn->parameter_count(), 160 + 4640 + 15690);
  Tensor y = cnn->forward(Tensor::zeros({3, 1, 28, 28}));
  EXPECT_EQ(y.shape(), (Shape{3, 10}));
  auto resnet = nn::make_model({"resnet20", {3, 32, 32}, 10});
  EXPECT_NEAR(static_cast<double>(resnet->parameter_count()), 0.27e6, 0.01e6);  // ResNet-20 has ~0.27 M
  EXPECT_EQ(resnet->forward(Tensor::zeros({2, 3, 32, 32})).shape(), (Shape{2, 10}));
  EXPECT_THROW(nn::make_model({"nosuch", {1, 28, 28}, 10}), InputError);
  EXPECT_THROW(cnn->forward(Tensor::zeros({3, 3, 28, 28})), Error);  // wrong channel count
}

TEST(Models, GradReadyHookFiresOncePerParameterInReverseOrder) {
  auto m = nn::make_model({"simple_cnn", {1, 8, 8}, 3});
  std::vector<std::string> fired;
  m->set_grad_ready_hook([&](nn::Parameter& p) { fired.push_back(p.name); });
  auto params = m->parameters();
  m->forward(Tensor::zeros({2, 1, 8, 8}));
  m->backward(Tensor::full({2, 3}, 1.f));
  ASSERT_EQ(fired.size(), params.size());
  EXPECT_EQ(fired.front(), "7.weight");  // the classifier finishes first
  EXPECT_EQ(fired.back(), "0.bias");
}

// A pipeline holds several micro-batches between their forward and backward: every layer of the
// image models must stash all its backward reads (the max pool's argmax, the shapes Flatten and
// the pools restore), so a backward after another micro-batch's forward, here even of another
// batch size, gives exactly that micro-batch's gradients. Dropout draws its mask in the first
// forward in both models, so the masks agree.
TEST(ActivationStash, ImageModelsBackwardOfAnEarlierMicroBatch) {
  for (const nn::ModelSpec& spec :
       {nn::ModelSpec{"simple_cnn", {1, 12, 12}, 5}, nn::ModelSpec{"resnet20", {3, 8, 8}, 5},
        nn::ModelSpec{"mlp", {1, 6, 6}, 5, {16, 8}, 0.25f}}) {
    auto a = nn::make_model(spec), ref = nn::make_model(spec);
    Rng rng(21);
    Shape s0{2}, s1{3};
    s0.insert(s0.end(), spec.input.begin(), spec.input.end());
    s1.insert(s1.end(), spec.input.begin(), spec.input.end());
    Tensor x0 = random_tensor(s0, rng), x1 = random_tensor(s1, rng), r = random_tensor({2, 5}, rng);
    a->forward(x0);
    nn::ActivationStash first = a->stash_activations();
    a->forward(x1);  // another micro-batch, of another size, in between
    nn::ActivationStash second = a->stash_activations();
    a->restore_activations(std::move(first));
    ref->forward(x0);
    Tensor dx, dx_ref;
    {
      nn::PhaseScope bwd(nn::Phase::Backward);  // as a pipeline runs backward
      dx = a->backward(r).clone();
      dx_ref = ref->backward(r).clone();
    }
    ASSERT_EQ(dx.shape(), dx_ref.shape()) << spec.name;
    for (int64_t k = 0; k < dx.numel(); ++k) ASSERT_EQ(dx.f32()[k], dx_ref.f32()[k]) << spec.name << " d(input)";
    auto pa = a->parameters(), pr = ref->parameters();
    for (size_t i = 0; i < pa.size(); ++i)
      for (int64_t k = 0; k < pa[i]->grad.numel(); ++k)
        ASSERT_EQ(pa[i]->grad.f32()[k], pr[i]->grad.f32()[k]) << spec.name << " " << pa[i]->name;
  }
}

// A stage of a Sequential names its parameters and buffers as the whole model does, and holds
// the whole model's initial values: any pipeline layout starts from the one-rank weights.
TEST(SequentialStage, KeepsTheWholeModelsNamesAndValues) {
  const nn::ModelSpec spec{"resnet20", {3, 8, 8}, 10};
  auto whole = nn::make_sequential_model(spec);
  std::vector<std::pair<std::string, std::vector<float>>> want;
  auto in_range = [](const std::string& name, int begin, int end) {
    const int layer = std::stoi(name.substr(0, name.find('.')));
    return layer >= begin && layer < end;
  };
  for (nn::Parameter* p : whole->parameters())
    if (in_range(p->name, 4, 9))
      want.emplace_back(p->name, std::vector<float>(p->value.f32(), p->value.f32() + p->value.numel()));
  std::vector<std::string> want_buffers;
  for (nn::Buffer* b : whole->buffers())
    if (in_range(b->name, 4, 9)) want_buffers.push_back(b->name);
  auto stage = nn::Sequential::stage_of(std::move(whole), 4, 9);
  EXPECT_EQ(stage->size(), 5u);
  std::vector<nn::Parameter*> got = stage->parameters();
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i]->name, want[i].first);
    EXPECT_EQ(std::vector<float>(got[i]->value.f32(), got[i]->value.f32() + got[i]->value.numel()), want[i].second)
        << got[i]->name;
  }
  std::vector<std::string> got_buffers;
  for (nn::Buffer* b : stage->buffers()) got_buffers.push_back(b->name);
  EXPECT_EQ(got_buffers, want_buffers);
  EXPECT_EQ(want_buffers.front(), "4.0.body.1.running_mean");
  // A stage of a stage still counts from the whole model.
  auto inner = nn::Sequential::stage_of(std::move(stage), 2, 4);
  EXPECT_EQ(inner->parameters().front()->name, "6.0.body.0.weight");
}

// The boundary shapes are those a training forward passes between the layers, and finding them
// changes no state: running statistics, dropout streams and the training flag stay.
TEST(SequentialStage, BoundaryShapesChangeNoState) {
  auto cnn = nn::make_sequential_model({"simple_cnn", {1, 28, 28}, 10});
  const std::vector<Shape> want{{4, 1, 28, 28},  {4, 16, 28, 28}, {4, 16, 28, 28}, {4, 16, 14, 14}, {4, 32, 14, 14},
                                {4, 32, 14, 14}, {4, 32, 7, 7},   {4, 1568},       {4, 10}};
  EXPECT_EQ(nn::layer_boundary_shapes(*cnn, {4, 1, 28, 28}), want);
  nn::ModelSpec spec{"resnet20", {3, 8, 8}, 10};
  auto resnet = nn::make_sequential_model(spec);
  Rng rng(5);
  resnet->forward(random_tensor({2, 3, 8, 8}, rng));  // running statistics away from their start
  std::vector<std::vector<float>> before;
  for (nn::Buffer* b : resnet->buffers()) before.emplace_back(b->value.f32(), b->value.f32() + b->value.numel());
  const std::vector<Shape> shapes = nn::layer_boundary_shapes(*resnet, {6, 3, 8, 8});
  ASSERT_EQ(shapes.size(), resnet->size() + 1);
  EXPECT_EQ(shapes[3], (Shape{6, 16, 8, 8}));
  EXPECT_EQ(shapes[10], (Shape{6, 64, 2, 2}));
  EXPECT_EQ(shapes.back(), (Shape{6, 10}));
  EXPECT_TRUE(resnet->training());
  auto buffers = resnet->buffers();
  for (size_t i = 0; i < buffers.size(); ++i)
    EXPECT_EQ(std::vector<float>(buffers[i]->value.f32(), buffers[i]->value.f32() + buffers[i]->value.numel()),
              before[i])
        << buffers[i]->name;
  auto mlp = nn::make_sequential_model({"mlp", {1, 4, 4}, 3, {8}, 0.5f});
  std::vector<nn::Buffer*> rng_state = mlp->buffers();
  ASSERT_EQ(rng_state.size(), 1u);
  const std::vector<int64_t> stream(rng_state[0]->value.data<int64_t>(), rng_state[0]->value.data<int64_t>() + 4);
  nn::layer_boundary_shapes(*mlp, {2, 1, 4, 4});
  EXPECT_EQ(std::vector<int64_t>(rng_state[0]->value.data<int64_t>(), rng_state[0]->value.data<int64_t>() + 4), stream);
}
