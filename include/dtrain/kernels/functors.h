#pragma once
// Element-wise math written once, as __host__ __device__ functors: the CPU engine loops over them
// with OpenMP and the CUDA engine launches them in kernels, so CPU tests cover the GPU's arithmetic.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "dtrain/core/dtype.h"

namespace dtrain::fn {

struct Relu {
  DT_HD float operator()(float x) const { return x > 0.f ? x : 0.f; }
};
struct ReluGrad {  // dx = dy * [x > 0]
  DT_HD float operator()(float x, float dy) const { return x > 0.f ? dy : 0.f; }
};

// tanh through one expf. glibc's tanhf (scalar, through expm1f) was 35 % of a GPT training step on
// the CPU; this is several times cheaper. Its absolute error (a few 1e-8) is what GELU's
// 0.5 x (1 + tanh) sees; only the relative error near 0 is larger, and GELU never divides by tanh.
DT_HD inline float tanh_via_exp(float u) {
  float e = expf(-2.f * fabsf(u));
  float t = (1.f - e) / (1.f + e);
  return u < 0.f ? -t : t;
}

// GELU, tanh approximation (as GPT-2 uses): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
struct Gelu {
  DT_HD float operator()(float x) const {
    const float k = 0.7978845608028654f;
    float u = k * (x + 0.044715f * x * x * x);
    return 0.5f * x * (1.f + tanh_via_exp(u));
  }
};
struct GeluGrad {
  DT_HD float operator()(float x, float dy) const {
    const float k = 0.7978845608028654f;
    float x2 = x * x;
    float u = k * (x + 0.044715f * x2 * x);
    float t = tanh_via_exp(u);
    float du = k * (1.f + 3.f * 0.044715f * x2);
    return dy * (0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * du);
  }
};

// GELU exactly, through erf (PyTorch's default nn.GELU, as ViT uses): 0.5 x (1 + erf(x / sqrt 2)).
struct GeluExact {
  DT_HD float operator()(float x) const { return 0.5f * x * (1.f + erff(x * 0.7071067811865476f)); }
};
struct GeluExactGrad {  // dy (Phi(x) + x phi(x))
  DT_HD float operator()(float x, float dy) const {
    const float cdf = 0.5f * (1.f + erff(x * 0.7071067811865476f));
    return dy * (cdf + x * 0.3989422804014327f * expf(-0.5f * x * x));
  }
};

// SiLU(g) = g sigmoid(g); SwiGLU: silu(gate) * up (the Llama family's MLP).
DT_HD inline float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }
struct SwiGlu {
  DT_HD float operator()(float gate, float up) const { return gate * sigmoid(gate) * up; }
};
struct SwiGluGrad {  // d gate = dy up silu'(gate), d up = dy silu(gate)
  DT_HD void operator()(float gate, float up, float dy, float& dgate, float& dup) const {
    const float s = sigmoid(gate);
    dup = dy * gate * s;
    dgate = dy * up * s * (1.f + gate * (1.f - s));
  }
};

// One rotary pair (x_i, x_{i+D/2}) by the angle whose cosine and sine are c and s (back by -angle
// when `inverse`).
struct RotatePair {
  bool inverse;
  DT_HD void operator()(float x1, float x2, float c, float s, float& y1, float& y2) const {
    if (inverse) s = -s;
    y1 = x1 * c - x2 * s;
    y2 = x2 * c + x1 * s;
  }
};

struct Mul {
  DT_HD float operator()(float a, float b) const { return a * b; }
};
struct Add {
  DT_HD float operator()(float a, float b) const { return a + b; }
};
struct Axpy {  // y + alpha * x, called as (x, y)
  float alpha;
  DT_HD float operator()(float x, float y) const { return y + alpha * x; }
};
struct Scale {
  float alpha;
  DT_HD float operator()(float x) const { return x * alpha; }
};

// A stateless hash of (seed, index) to [0, 1) with 24 random bits, so a dropout mask depends on
// neither thread scheduling nor the device.
DT_HD inline float hash_uniform(uint64_t seed, uint64_t i) {
  uint64_t z = seed + (i + 1) * 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<float>(z >> 40) * (1.0f / 16777216.0f);
}
// Gradient compression (Engine::sign_encode, qsgd_encode): one element's code, the same on every device.
// The 1-bit code's sign: +1 for x >= 0 (bit set), -1 otherwise.
DT_HD inline float sign_unit(const uint8_t* bits, int64_t i) { return (bits[i >> 3] >> (i & 7)) & 1 ? 1.f : -1.f; }
// The byte of bits [8j, 8j + 8) of x (n elements): bit b set when x[8j + b] >= 0.
DT_HD inline uint8_t sign_byte(const float* x, int64_t n, int64_t j) {
  uint8_t byte = 0;
  for (int b = 0; b < 8 && 8 * j + b < n; ++b)
    if (x[8 * j + b] >= 0.f) byte = static_cast<uint8_t>(byte | (1u << b));
  return byte;
}
// The f32 at the head of a payload, which may lie at any byte address: rank r's payload starts r
// payloads into the gathered buffer, and a payload's size is rarely a multiple of 4.
DT_HD inline float payload_head(const uint8_t* p) {
  const uint32_t bits = static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
                        static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24;
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float v;
  std::memcpy(&v, &bits, 4);
  return v;
#endif
}
// QSGD's level of x for a vector of norm `norm` (> 0), s levels, u uniform in [0, 1).
DT_HD inline int8_t qsgd_level(float x, float norm, int levels, float u) {
  float level = fabsf(x) * static_cast<float>(levels) / norm;
  float lower = floorf(level);
  int l = static_cast<int>(lower) + (u < level - lower ? 1 : 0);
  l = l < levels ? l : levels;
  return static_cast<int8_t>(x < 0.f ? -l : l);
}

// Inverted dropout: element i keeps with probability 1-p and is then scaled by 1/(1-p).
struct DropoutMask {
  float p, keep_scale;
  uint64_t seed;
  DT_HD float operator()(uint64_t i) const { return hash_uniform(seed, i) >= p ? keep_scale : 0.f; }
};

// Loss scaling: the unscaled value, and whether the value is finite (inf and NaN both fail
// x - x == 0, which needs no <cmath> on the device).
struct Unscale {
  float inv_scale;
  DT_HD float operator()(float x) const { return x * inv_scale; }
};
DT_HD inline bool is_finite(float x) { return x - x == 0.f; }

// SGD with momentum (PyTorch's formulation): g = grad + wd*p; buf = mu*buf + (1-dampening)*g;
// step = nesterov ? g + mu*buf : buf; p -= lr*step. With mu == 0 the buffer is unused.
struct SgdStep {
  float lr, momentum, dampening, weight_decay;
  bool nesterov;
  DT_HD void operator()(float& p, float g, float& buf) const {
    g += weight_decay * p;
    float step = g;
    if (momentum != 0.f) {
      buf = momentum * buf + (1.f - dampening) * g;
      step = nesterov ? g + momentum * buf : buf;
    }
    p -= lr * step;
  }
};

// Adam / AdamW. decoupled: p -= lr*wd*p (AdamW); otherwise wd is added to the gradient (Adam).
// bias1 = 1 - beta1^t, bias2 = 1 - beta2^t, computed once per step by the caller.
struct AdamStep {
  float lr, beta1, beta2, eps, weight_decay, bias1, bias2;
  bool decoupled;
  DT_HD void operator()(float& p, float g, float& m, float& v) const {
    if (decoupled) {
      p -= lr * weight_decay * p;
    } else {
      g += weight_decay * p;
    }
    m = beta1 * m + (1.f - beta1) * g;
    v = beta2 * v + (1.f - beta2) * g * g;
    float mhat = m / bias1;
    float vhat = v / bias2;
    p -= lr * mhat / (sqrtf(vhat) + eps);
  }
};

}  // namespace dtrain::fn
