#include "dtrain/optim/loss_scaler.h"

#include <algorithm>
#include <map>

#include "dtrain/kernels/engine.h"

namespace dtrain::optim {

LossScaler::LossScaler(LossScalerOptions o) : o_(o), scale_(o.init_scale) {
  DT_INPUT_CHECK(o.init_scale > 0.f && o.min_scale > 0.f && o.min_scale <= o.max_scale,
                 "loss scaler: scales must be > 0 and min_scale <= max_scale");
  DT_INPUT_CHECK(o.growth_factor > 1.f, "loss scaler: growth factor must be > 1, got " << o.growth_factor);
  DT_INPUT_CHECK(o.backoff_factor > 0.f && o.backoff_factor < 1.f,
                 "loss scaler: back-off factor must be in (0, 1), got " << o.backoff_factor);
  DT_INPUT_CHECK(o.growth_interval >= 1, "loss scaler: growth interval must be >= 1");
}

bool LossScaler::unscale(const std::vector<nn::Parameter*>& params) {
  const float inv = 1.f / scale_;
  // One found-inf flag per device, read once after all tensors are queued.
  std::map<std::pair<int, int>, Tensor> flags;
  for (nn::Parameter* p : params) {
    if (!p->grad.defined()) continue;
    Device d = p->grad.device();
    auto key = std::make_pair(static_cast<int>(d.type), d.index);
    auto it = flags.find(key);
    Engine& e = engine_for(d);
    if (it == flags.end()) {
      Tensor f = Tensor::empty({1}, DType::F32, d);
      e.fill(f, 0.f);
      it = flags.emplace(key, f).first;
    }
    e.unscale_and_check(p->grad, inv, it->second);
  }
  bool finite = true;
  for (auto& [key, flag] : flags) {
    Tensor host = Tensor::empty({1});
    engine_for(flag.device()).copy(flag, host);  // the CUDA engine's copy waits for the flag
    finite = finite && host.f32()[0] == 0.f;
  }
  return finite;
}

void LossScaler::update(bool grads_finite) {
  if (!grads_finite) {
    ++skipped_;
    good_ = 0;
    scale_ = std::max(o_.min_scale, scale_ * o_.backoff_factor);
    return;
  }
  if (++good_ >= o_.growth_interval) {
    scale_ = std::min(o_.max_scale, scale_ * o_.growth_factor);
    good_ = 0;
  }
}

bool LossScaler::step(Optimizer& opt, float lr) {
  bool finite = unscale(opt.params());
  if (finite) opt.step(lr);
  update(finite);
  return finite;
}

void LossScaler::set_state(float scale, int64_t good_steps, int64_t skipped_steps) {
  DT_INPUT_CHECK(scale > 0.f && good_steps >= 0 && skipped_steps >= 0, "loss scaler: bad saved state");
  scale_ = scale;
  good_ = good_steps;
  skipped_ = skipped_steps;
}

}  // namespace dtrain::optim
