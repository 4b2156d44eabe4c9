// normlab's CPU RMSNorm: one fused loop per row for the forward (with the residual add) and the backward, and the
// autograd function around them, registered as PyTorch operators (namespace normlab_cpu) so that an eager call
// costs what a native ATen op costs: no Python between the dispatcher and the loops (model/kernels/cpu_rms.py).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros_like.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

namespace normlab_cpu {
using at::Tensor;
using OptTensor = std::optional<Tensor>;

struct bf16 { uint16_t bits; };

inline float load(float v) { return v; }
inline float load(bf16 v) { uint32_t u = uint32_t(v.bits) << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline void store(float* p, float v) { *p = v; }
inline void store(bf16* p, float v) {  // round to nearest even, NaN stays NaN (as torch's conversion)
  uint32_t u; std::memcpy(&u, &v, 4);
  p->bits = v != v ? uint16_t(0x7FC0) : uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
template <typename T> inline float round_to(float v) { T t; store(&t, v); return load(t); }

// y = x̂ · (offset + w), x̂ = h · rstd, h = x (+ res). ROUND: Llama order, x̂ is cast to T before the gain.
// The flags are template parameters so that every inner loop is branch-free and vectorizes.
template <typename T, typename W, typename O, bool RES, bool ROUND>
void fwd(const T* x, const T* res, T* h, const W* w, O* y, float* rstd, int64_t rows, int64_t n, int64_t sx,
         int64_t sr, float eps, float offset, int threads) {
  #pragma omp parallel for if(threads > 1) num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * sx;
    float ss = 0.f;
    if (RES) {
      const T* rr = res + r * sr;
      T* hr = h + r * n;
      #pragma omp simd reduction(+:ss)
      for (int64_t i = 0; i < n; ++i) {
        const float v = round_to<T>(load(xr[i]) + load(rr[i]));  // normalize the stored (rounded) sum
        store(hr + i, v);
        ss += v * v;
      }
      xr = hr;
    } else {
      #pragma omp simd reduction(+:ss)
      for (int64_t i = 0; i < n; ++i) { const float v = load(xr[i]); ss += v * v; }
    }
    const float rs = 1.f / std::sqrt(ss / float(n) + eps);
    rstd[r] = rs;
    O* yr = y + r * n;
    #pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const float xh = load(xr[i]) * rs;
      store(yr + i, (ROUND ? round_to<T>(xh) : xh) * (load(w[i]) + offset));
    }
  }
}

// dx = rstd · (g − x̂ · mean(g · x̂)) (+ dh), g = dy · (offset + w); dw from per-thread fp32 partial sums
// (`part`: threads × n floats), added up once at the end.
template <typename T, typename W, typename O, bool DH, bool ROUND>
void bwd(const O* dy, const T* dh, const T* h, const W* w, const float* rstd, T* dx, W* dw, float* part,
         int64_t rows, int64_t n, int64_t sdy, int64_t sdh, int64_t sh, float offset, int threads) {
  int used = 1;
  #pragma omp parallel if(threads > 1) num_threads(threads)
  {
    int t = 0, nt = 1;
#ifdef _OPENMP
    t = omp_get_thread_num();
    nt = omp_get_num_threads();
#endif
    if (t == 0) used = nt;  // OpenMP may run fewer threads than asked
    float* acc = part + int64_t(t) * n;
    std::fill(acc, acc + n, 0.f);
    const int64_t per = (rows + nt - 1) / nt;
    const int64_t r0 = std::min(rows, t * per), r1 = std::min(rows, r0 + per);
    for (int64_t r = r0; r < r1; ++r) {
      const O* gr = dy + r * sdy;
      const T* hr = h + r * sh;
      const T* dhr = DH ? dh + r * sdh : nullptr;
      T* dxr = dx + r * n;
      const float rs = rstd[r];
      float c = 0.f;
      #pragma omp simd reduction(+:c)
      for (int64_t i = 0; i < n; ++i) c += load(gr[i]) * (load(w[i]) + offset) * load(hr[i]);
      c *= rs * rs / float(n);  // x̂ · mean(g · x̂) = h · rstd² · mean(g · h)
      #pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const float g = load(gr[i]), hi = load(hr[i]);
        const float v = (g * (load(w[i]) + offset) - hi * c) * rs;
        store(dxr + i, DH ? v + load(dhr[i]) : v);
        const float xh = hi * rs;
        acc[i] += g * (ROUND ? round_to<T>(xh) : xh);
      }
    }
  }
  if (dw == nullptr) return;
  for (int64_t i = 0; i < n; ++i) {
    float s = 0.f;
    for (int t = 0; t < used; ++t) s += part[int64_t(t) * n + i];
    store(dw + i, s);
  }
}

template <typename F> void with_flags(bool a, bool b, F&& f) {  // two runtime bools → template parameters
  using yes = std::true_type; using no = std::false_type;
  if (a) { if (b) f(yes{}, yes{}); else f(yes{}, no{}); }
  else { if (b) f(no{}, yes{}); else f(no{}, no{}); }
}

template <typename F> void on_type(at::ScalarType s, F&& f) {  // fp32 | bf16 → the kernel's element type
  if (s == at::kFloat) f(float{});
  else if (s == at::kBFloat16) f(bf16{});
  else TORCH_CHECK(false, "normlab's CPU RMSNorm takes fp32 or bf16 tensors, got ", s);
}

// Like ATen's parallel_for: ~32K elements per thread at least. A parallel region over a small tensor costs more
// than it saves, and on a busy machine its closing barrier waits for a descheduled thread (ms).
int threads_for(int64_t numel) {
  return int(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), numel / 32768)));
}

// The rows of t over its last dim: a tensor whose data holds them with unit stride along a row, and the stride
// between rows (a copy only when the rows cannot be strided; no call into the dispatcher when t is contiguous).
std::pair<Tensor, int64_t> rows_of(const Tensor& t) {
  if (t.is_contiguous()) return {t, t.size(-1)};
  Tensor r = t.reshape({-1, t.size(-1)});
  if (r.stride(1) != 1 && r.size(1) != 1) r = r.contiguous();
  return {r, r.stride(0)};
}

// (y, h, mean, rstd) as model/kernels/common.py describes them: h = x + residual (empty without one), mean
// empty (RMSNorm), rstd fp32 per row; y follows type promotion with the gain under the Llama cast.
std::tuple<Tensor, Tensor, Tensor, Tensor> rms_norm_fwd(const Tensor& x, const OptTensor& weight,
                                                        const OptTensor& residual, double eps, double offset,
                                                        bool gemma_cast) {
  const bool has_w = weight.has_value() && weight->defined(), has_res = residual.has_value() && residual->defined();
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  const auto [x2, sx] = rows_of(x);
  const auto [res2, sr] = has_res ? rows_of(*residual) : std::pair<Tensor, int64_t>{};
  const Tensor w = has_w ? weight->contiguous() : at::ones({n}, x.options().dtype(at::kFloat));
  const bool round = has_w && !gemma_cast;
  const auto y_type = round ? at::promote_types(w.scalar_type(), x.scalar_type()) : x.scalar_type();
  Tensor y = at::empty(x.sizes(), x.options().dtype(y_type));
  Tensor h = has_res ? at::empty(x.sizes(), x.options()) : at::empty({0}, x.options());
  std::vector<int64_t> row_shape(x.sizes().begin(), x.sizes().end() - 1);
  Tensor rstd = at::empty(row_shape, x.options().dtype(at::kFloat));
  Tensor mean = at::empty({0}, x.options().dtype(at::kFloat));
  const float off = has_w ? float(offset) : 0.f;
  on_type(x.scalar_type(), [&](auto t) { on_type(w.scalar_type(), [&](auto wt) { on_type(y_type, [&](auto o) {
    using T = decltype(t); using Wt = decltype(wt); using O = decltype(o);
    with_flags(has_res, round, [&](auto res_flag, auto round_flag) {
      fwd<T, Wt, O, decltype(res_flag)::value, decltype(round_flag)::value>(
          static_cast<const T*>(x2.const_data_ptr()), has_res ? static_cast<const T*>(res2.const_data_ptr()) : nullptr,
          has_res ? static_cast<T*>(h.data_ptr()) : nullptr, static_cast<const Wt*>(w.const_data_ptr()),
          static_cast<O*>(y.data_ptr()), rstd.data_ptr<float>(), rows, n, sx, sr, float(eps), off,
          threads_for(rows * n));
    });
  }); }); });
  return {y, h, mean, rstd};
}

// (dx, dweight, dbias) for the forward above: dx in h's dtype, dweight in the gain's (empty without a gain),
// dbias empty. `h`: the normalized input (x, or the fused sum).
std::tuple<Tensor, Tensor, Tensor> rms_norm_bwd(const Tensor& dy, const OptTensor& dh, const Tensor& h,
                                                const OptTensor& weight, const Tensor& rstd, double offset,
                                                bool gemma_cast) {
  const bool has_w = weight.has_value() && weight->defined(), has_dh = dh.has_value() && dh->defined();
  const int64_t n = h.size(-1), rows = n ? h.numel() / n : 0;
  const auto [h2, sh] = rows_of(h);
  const auto [dy2, sdy] = rows_of(dy);
  const auto [dh2, sdh] = has_dh ? rows_of(dh->to(h.scalar_type())) : std::pair<Tensor, int64_t>{};
  const Tensor w = has_w ? weight->contiguous() : at::ones({n}, h.options().dtype(at::kFloat));
  const int threads = threads_for(rows * n);
  Tensor dx = at::empty(h.sizes(), h.options());
  Tensor dw = has_w ? at::empty(w.sizes(), w.options()) : at::empty({0}, h.options());
  Tensor part = at::empty({threads, n}, h.options().dtype(at::kFloat));
  on_type(h.scalar_type(), [&](auto t) { on_type(w.scalar_type(), [&](auto wt) { on_type(dy.scalar_type(),
                                                                                        [&](auto o) {
    using T = decltype(t); using Wt = decltype(wt); using O = decltype(o);
    with_flags(has_dh, has_w && !gemma_cast, [&](auto dh_flag, auto round_flag) {
      bwd<T, Wt, O, decltype(dh_flag)::value, decltype(round_flag)::value>(
          static_cast<const O*>(dy2.const_data_ptr()), has_dh ? static_cast<const T*>(dh2.const_data_ptr()) : nullptr,
          static_cast<const T*>(h2.const_data_ptr()), static_cast<const Wt*>(w.const_data_ptr()),
          rstd.const_data_ptr<float>(), static_cast<T*>(dx.data_ptr()), has_w ? static_cast<Wt*>(dw.data_ptr()) : nullptr,
          part.data_ptr<float>(), rows, n, sdy, sdh, sh, has_w ? float(offset) : 0.f, threads);
    });
  }); }); });
  return {dx, dw, at::empty({0}, h.options())};
}

// The eager entry point: (y, h) with the backward above as its autograd node, like a native ATen op.
struct RMSNormFunction : public torch::autograd::Function<RMSNormFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const Tensor& x,
                                                const OptTensor& weight, const OptTensor& residual, double eps,
                                                double offset, bool gemma_cast) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, h, mean, rstd] = rms_norm_fwd(x, weight, residual, eps, offset, gemma_cast);
    const bool has_res = residual.has_value() && residual->defined();
    ctx->save_for_backward({has_res ? h : x, weight.has_value() ? *weight : Tensor(), rstd});
    ctx->saved_data["offset"] = offset;
    ctx->saved_data["gemma_cast"] = gemma_cast;
    ctx->saved_data["x_type"] = int64_t(x.scalar_type());
    ctx->saved_data["res_type"] = has_res ? int64_t(residual->scalar_type()) : int64_t(-1);
    ctx->set_materialize_grads(false);
    if (!has_res) ctx->mark_non_differentiable({h});
    return {y, h};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const Tensor& h = saved[0];
    const int64_t res_type = ctx->saved_data["res_type"].toInt();  // -1: no residual
    Tensor dy = grads[0].defined() ? grads[0] : at::zeros_like(h);  // only h was used downstream
    const OptTensor dh = res_type >= 0 && grads[1].defined() ? OptTensor(grads[1]) : std::nullopt;
    const OptTensor weight = saved[1].defined() ? OptTensor(saved[1]) : std::nullopt;
    auto [dx, dw, db] = rms_norm_bwd(dy, dh, h, weight, saved[2], ctx->saved_data["offset"].toDouble(),
                                     ctx->saved_data["gemma_cast"].toBool());
    const auto as = [&dx](int64_t type) {  // dx in an input's dtype (no dispatch when it already is)
      return dx.scalar_type() == at::ScalarType(type) ? dx : dx.to(at::ScalarType(type));
    };
    return {as(ctx->saved_data["x_type"].toInt()), weight ? dw : Tensor(), res_type >= 0 ? as(res_type) : Tensor(),
            Tensor(), Tensor(), Tensor()};
  }
};

std::tuple<Tensor, Tensor> rms_norm(const Tensor& x, const OptTensor& weight, const OptTensor& residual,
                                    double eps, double offset, bool gemma_cast) {
  auto out = RMSNormFunction::apply(x, weight, residual, eps, offset, gemma_cast);
  return {out[0], out[1]};
}

std::tuple<Tensor, Tensor> rms_norm_inference(const Tensor& x, const OptTensor& weight, const OptTensor& residual,
                                              double eps, double offset, bool gemma_cast) {  // no autograd key
  auto [y, h, mean, rstd] = rms_norm_fwd(x, weight, residual, eps, offset, gemma_cast);
  return {y, h};
}
}  // namespace normlab_cpu

using namespace normlab_cpu;

TORCH_LIBRARY(normlab_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor? weight, Tensor? residual, float eps, float offset, bool gemma_cast) "
        "-> (Tensor, Tensor)");
  m.def("rms_norm_fwd(Tensor x, Tensor? weight, Tensor? residual, float eps, float offset, bool gemma_cast) "
        "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def("rms_norm_bwd(Tensor dy, Tensor? dh, Tensor h, Tensor? weight, Tensor rstd, float offset, "
        "bool gemma_cast) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(normlab_cpu, CPU, m) {
  m.impl("rms_norm_fwd", &rms_norm_fwd);
  m.impl("rms_norm_bwd", &rms_norm_bwd);
  m.impl("rms_norm", &rms_norm_inference);
}

TORCH_LIBRARY_IMPL(normlab_cpu, AutogradCPU, m) {
  m.impl("rms_norm", &rms_norm);
}
