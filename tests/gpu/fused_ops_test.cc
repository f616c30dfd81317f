// The fused CUDA kernels of the block (worker/model/cuda/fused_kernels.cu) agree with their ATen
// references (worker/model/fused_ops.h): they round at the same points, so in bf16 nearly every
// element is bit-equal and the rest differ by one unit in the last place (an f32 sum taken in
// another order), in f32 they agree to f32 rounding. Inputs in the layouts the block uses.
#include <ATen/ATen.h>
#include <catch2/catch.hpp>

#include "worker/model/fused_ops.h"

using namespace lorastream;
using namespace lorastream::worker;

namespace {

const c10::Device kCuda(c10::kCUDA, 0);

// Fraction of elements that differ, and the largest difference relative to the largest
// |want| (element-wise ratios would blow up where a sum cancels to near zero).
struct Agreement {
  double differing = 0, worst = 0;
};
Agreement Compare(const at::Tensor& got, const at::Tensor& want) {
  REQUIRE(got.sizes() == want.sizes());
  REQUIRE(got.scalar_type() == want.scalar_type());
  at::Tensor g = got.to(at::kCPU, at::kDouble), w = want.to(at::kCPU, at::kDouble);
  Agreement a;
  a.differing = g.ne(w).to(at::kDouble).mean().item<double>();
  a.worst = (g - w).abs().max().item<double>() / w.abs().max().item<double>();
  return a;
}

// One unit in the last place of the dtype, relative.
double Ulp(c10::ScalarType t) { return t == at::kBFloat16 ? 1.0 / 128 : 1.2e-7; }

// Within a few units in the last place; in bf16 (where both round at the same points) nearly
// every element bit-equal. f32 sums taken in another order (and nvcc's fused multiply-adds)
// make most f32 elements differ in their last bits.
void CheckClose(const at::Tensor& got, const at::Tensor& want, c10::ScalarType t) {
  Agreement a = Compare(got, want);
  INFO("differing " << a.differing << ", worst relative to the largest " << a.worst);
  CHECK(a.worst <= 4 * Ulp(t));
  if (t == at::kBFloat16) CHECK(a.differing < 0.02);
}

}  // namespace

TEST_CASE("fused RMSNorm forward and backward agree with the reference", "[gpu]") {
  REQUIRE(FusedKernelsEnabled());
  for (auto t : {at::kBFloat16, at::kFloat}) {
    for (auto shape : {std::vector<int64_t>{300, 4096}, std::vector<int64_t>{2, 37, 8, 128}}) {
      DYNAMIC_SECTION(c10::toString(t) << " rows of " << shape.back()) {
        auto o = at::TensorOptions().device(kCuda).dtype(t);
        at::Tensor x = at::randn(shape, o) * 3, w = at::rand({shape.back()}, o) + 0.5;
        at::Tensor dy = at::randn(shape, o);
        at::Tensor r_got, r_want;
        at::Tensor y_got = RmsNormRstd(x, w, 1e-6, &r_got);
        at::Tensor y_want = reference::RmsNormRstd(x, w, 1e-6, &r_want);
        CHECK(r_got.sizes() == r_want.sizes());
        CHECK(Compare(r_got, r_want).worst < 1e-6);
        CheckClose(y_got, y_want, t);
        CheckClose(RmsNormBackward(dy, x, r_want, w), reference::RmsNormBackward(dy, x, r_want, w),
                   t);
      }
    }
  }
}

TEST_CASE("fused SwiGLU forward and backward agree with the reference", "[gpu]") {
  for (auto t : {at::kBFloat16, at::kFloat}) {
    DYNAMIC_SECTION(c10::toString(t)) {
      auto o = at::TensorOptions().device(kCuda).dtype(t);
      at::Tensor gate = at::randn({517, 1408}, o) * 4, up = at::randn({517, 1408}, o);
      at::Tensor dz = at::randn({517, 1408}, o);
      CheckClose(SwiGlu(gate, up), reference::SwiGlu(gate, up), t);
      auto [dg, du] = SwiGluBackward(dz, gate, up);
      auto [dg_want, du_want] = reference::SwiGluBackward(dz, gate, up);
      CheckClose(dg, dg_want, t);
      CheckClose(du, du_want, t);
    }
  }
}

TEST_CASE("fused rotary forward and backward agree with the reference, strided input", "[gpu]") {
  for (auto t : {at::kBFloat16, at::kFloat}) {
    DYNAMIC_SECTION(c10::toString(t)) {
      auto o = at::TensorOptions().device(kCuda).dtype(t);
      const int64_t b = 2, s = 45, h = 6, d = 64;
      // As the block has them: [B, S, h, D] projections seen as [B, h, S, D]; tables of a
      // longer sequence.
      at::Tensor x = at::randn({b, s, h, d}, o).transpose(1, 2);
      at::Tensor cos = at::randn({s + 7, d}, o), sin = at::randn({s + 7, d}, o);
      at::Tensor y = RopeForward(x, cos, sin);
      CheckClose(y, reference::RopeForward(x, cos.narrow(0, 0, s), sin.narrow(0, 0, s)), t);
      at::Tensor g = at::randn({b, h, s, d}, o);
      at::Tensor dx = RopeBackward(g, cos, sin);
      CheckClose(dx, reference::RopeBackward(g, cos.narrow(0, 0, s), sin.narrow(0, 0, s)), t);
      CHECK(dx.transpose(1, 2).is_contiguous());  // the projection's layout
    }
  }
}

namespace {

// BFL's apply_rope as worker/flux/flux_model.cc writes it in ATen, differentiable.
at::Tensor BflApplyRope(const at::Tensor& x, const at::Tensor& pe) {
  auto sizes = x.sizes().vec();
  sizes.back() /= 2;
  sizes.push_back(1);
  sizes.push_back(2);
  const at::Tensor xf = x.to(at::kFloat).reshape(sizes);
  const at::Tensor out = pe.select(-1, 0) * xf.select(-1, 0) + pe.select(-1, 1) * xf.select(-1, 1);
  return out.reshape(x.sizes()).to(x.scalar_type());
}

}  // namespace

TEST_CASE(
    "fused joint-attention heads: per-head RMSNorm, rotation and layout agree with the "
    "ATen ops and their autograd",
    "[gpu]") {
  for (auto t : {at::kBFloat16, at::kFloat}) {
    for (int64_t d : {16, 128}) {
      for (int64_t pe_batch : {1, 2}) {
        DYNAMIC_SECTION(c10::toString(t)
                        << ", D " << d << ", a table per " << (pe_batch == 1 ? "batch" : "item")) {
          auto o = at::TensorOptions().device(kCuda).dtype(t);
          const int64_t b = 2, l = 37, h = 3, col = h * d, offset = 5;
          // A projection with more columns than the part (FLUX.1's single blocks), the part
          // at a column past the first; positions offset in a joint sequence's table.
          const at::Tensor src = at::randn({b, l, 4 * h * d}, o) * 3;
          const at::Tensor scale = at::rand({d}, o) + 0.5;
          const at::Tensor pe =
              at::randn({pe_batch, 1, offset + l + 4, d / 2, 2, 2}, o.dtype(at::kFloat));
          const HeadsPart part{src, col, scale};
          REQUIRE(HeadsFusable(part, h, d, pe, offset));
          // Written where a joint [B, L, H, D] tensor keeps this stream's positions.
          const at::Tensor joint = at::zeros({b, offset + l + 2, h, d}, o);
          const at::Tensor out = joint.narrow(1, offset, l).permute({0, 2, 1, 3});
          REQUIRE(FusedHeadsForward(part, h, pe, offset, out));

          const at::Tensor leaf = src.detach().clone().requires_grad_(true);
          const at::Tensor x = leaf.narrow(-1, col, h * d).view({b, l, h, d}).permute({0, 2, 1, 3});
          const at::Tensor want = BflApplyRope(reference::RmsNormRstd(x, scale, 1e-6, nullptr),
                                               pe.narrow(2, offset, l));
          CheckClose(out, want.detach(), t);
          CHECK(joint.narrow(1, 0, offset).abs().max().item<double>() == 0);  // nothing else

          const at::Tensor g = at::randn({b, l, h, d}, o).permute({0, 2, 1, 3});
          want.backward(g);
          const at::Tensor dsrc = at::zeros_like(src);
          REQUIRE(FusedHeadsBackward(part, h, pe, offset, g, dsrc));
          CheckClose(dsrc, leaf.grad(), t);

          // v: copied there and back, exactly.
          const HeadsPart v{src, 2 * h * d, at::Tensor()};
          REQUIRE(FusedHeadsForward(v, h, at::Tensor(), offset, out));
          CHECK(
              out.equal(src.narrow(-1, 2 * h * d, h * d).view({b, l, h, d}).permute({0, 2, 1, 3})));
          const at::Tensor dv = at::zeros_like(src);
          REQUIRE(FusedHeadsBackward(v, h, at::Tensor(), offset, g, dv));
          CHECK(dv.narrow(-1, 2 * h * d, h * d)
                    .equal(g.permute({0, 2, 1, 3}).reshape({b, l, h * d})));
        }
      }
    }
  }
  // Not for it: an f64 projection, a head of 258, a table too short, a part past the columns.
  auto o = at::TensorOptions().device(kCuda);
  const at::Tensor pe = at::randn({1, 1, 5, 4, 2, 2}, o);
  CHECK(HeadsFusable({at::randn({1, 5, 16}, o), 0, {}}, 2, 8, pe, 0));
  CHECK_FALSE(HeadsFusable({at::randn({1, 5, 16}, o.dtype(at::kDouble)), 0, {}}, 2, 8, pe, 0));
  CHECK_FALSE(HeadsFusable({at::randn({1, 5, 516}, o), 0, {}}, 2, 258, {}, 0));
  CHECK_FALSE(HeadsFusable({at::randn({1, 5, 16}, o), 0, {}}, 2, 8, pe, 1));
  CHECK_FALSE(HeadsFusable({at::randn({1, 5, 16}, o), 8, {}}, 2, 8, pe, 0));
}

TEST_CASE("fused cross entropy: the loss and the gradient over the logits agree with the reference",
          "[gpu]") {
  // What the head's chunk size and the memory estimate count on.
  REQUIRE(FusedCrossEntropyApplies(true, at::kBFloat16));
  REQUIRE(FusedCrossEntropyApplies(true, at::kHalf));
  REQUIRE_FALSE(FusedCrossEntropyApplies(true, at::kFloat));
  REQUIRE_FALSE(FusedCrossEntropyApplies(false, at::kBFloat16));
  for (auto t : {at::kBFloat16, at::kHalf}) {
    DYNAMIC_SECTION(c10::toString(t)) {
      // A llama-3 vocabulary, rows as in a chunk of the LM head; every 7th row ignored and
      // one target at each end of the vocabulary.
      const int64_t rows = 37, vocab = 128256;
      auto o = at::TensorOptions().device(kCuda).dtype(t);
      const at::Tensor logits = at::randn({rows, vocab}, o) * 3;
      at::Tensor targets = at::randint(0, vocab, {rows}, o.dtype(at::kLong));
      targets.index_put_({at::arange(0, rows, 7, o.dtype(at::kLong))}, -100);
      targets[1] = 0;
      targets[2] = vocab - 1;
      for (bool want_grad : {false, true}) {
        CAPTURE(want_grad);
        at::Tensor got = logits.clone(), want = logits.clone();
        const double loss = CrossEntropySum(&got, targets, want_grad).item<double>();
        const double loss_want =
            reference::CrossEntropySum(&want, targets, want_grad).item<double>();
        CHECK(loss == Approx(loss_want).epsilon(1e-6));
        if (!want_grad) continue;
        REQUIRE(got.defined());
        REQUIRE(got.scalar_type() == t);
        // Ignored rows have no gradient; the others sum to 0 (softmax minus one-hot).
        CHECK(got.index({at::arange(0, rows, 7, o.dtype(at::kLong))}).abs().max().item<double>() ==
              0);
        Agreement a = Compare(got, want);
        INFO("differing " << a.differing << ", worst relative to the largest " << a.worst);
        CHECK(a.worst <= 4 * (t == at::kHalf ? 1.0 / 1024 : 1.0 / 128));
        CHECK(a.differing < 0.02);
      }
    }
  }
}
