// The one place where LibTorch 1.13 (Debian, CI) and 2.x (the CUDA machine) differ for us.
// Keyed on TORCH_VERSION_MAJOR/MINOR, never on __has_include (Debian ships headers that do not
// compile).
#pragma once

#include <cmath>
#include <limits>
#include <optional>

#include <ATen/ATen.h>
#include <torch/version.h>

namespace lorastream::worker {

// Causal attention over q [B, H, S, D] and k, v [B, KV, S, D] (H a multiple of KV, grouped-
// query attention), scale 1/sqrt(D), as transformers' sdpa path computes it. LibTorch >= 2
// runs scaled_dot_product_attention (flash / memory-efficient kernels on CUDA); 1.13 has none,
// so the fallback computes softmax(q k^T * scale + causal mask) v exactly, the softmax in f32.
inline at::Tensor CausalAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const int64_t heads = q.size(1), kv_heads = k.size(1);
  const int64_t groups = heads / kv_heads;
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 5)
  return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                          /*is_causal=*/true, /*scale=*/::std::nullopt,
                                          /*enable_gqa=*/groups > 1);
#else
  auto repeat = [&](const at::Tensor& t) {
    if (groups == 1) return t;
    auto s = t.sizes();
    return t.unsqueeze(2)
        .expand({s[0], s[1], groups, s[2], s[3]})
        .reshape({s[0], s[1] * groups, s[2], s[3]});
  };
  at::Tensor kk = repeat(k), vv = repeat(v);
#if TORCH_VERSION_MAJOR >= 2
  return at::scaled_dot_product_attention(q, kk, vv, {}, 0.0, /*is_causal=*/true);
#else
  const int64_t s = q.size(2);
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
  at::Tensor scores = at::matmul(q, kk.transpose(-2, -1)) * scale;
  at::Tensor mask = at::ones({s, s}, q.options().dtype(at::kBool)).triu(1);
  scores = scores.masked_fill(mask, -std::numeric_limits<float>::infinity());
  at::Tensor probs = at::softmax(scores, -1, at::kFloat).to(q.scalar_type());
  return at::matmul(probs, vv);
#endif
#endif
}

}  // namespace lorastream::worker
