// LayerNorm and RMSNorm over the rows of a (rows, H) array, alone or after a residual add,
// forward and backward in one pass over memory each (see normalization.py).
//
// A row is converted to float32 once into a buffer of the chunk (it stays in L1 or L2), and its
// sums are taken from there. The backward writes dx and accumulates the parameters' gradients
// per chunk; the chunks' sums are added at the end.
#include <cmath>
#include <vector>

#include "common.h"

namespace jaxfuse {
namespace {

constexpr int64_t kBlockRows = 32;     // rows whose parameter gradients are summed apart

// The optional operands arrive as empty arrays.
template <typename T>
const T* optional(const ffi::AnyBuffer& a) {
  return a.element_count() ? static_cast<const T*>(a.untyped_data()) : nullptr;
}

template <typename T>
T* optional(ffi::Result<ffi::AnyBuffer>& a) {
  return a->element_count() ? static_cast<T*>(a->untyped_data()) : nullptr;
}

ffi::Error unsupported(ffi::DataType dtype) {
  return ffi::Error::InvalidArgument("normalization (cpu): float32, bfloat16 or float16, got "
                                     "dtype " + std::to_string(static_cast<int>(dtype)));
}

// Under vmap (ffi_call's broadcast_all) every operand gains the batch's leading axes: x is then
// (batch..., rows, H) and the parameters (batch..., H), and each example is normalized with
// its own parameters and sums its own parameter gradients. The number of examples is read off
// the parameters (off the parameter gradients in the backward); without parameters the
// examples are only more rows.
int64_t examples(const ffi::AnyBuffer& params, int64_t h) {
  return params.element_count() && h ? params.element_count() / h : 1;
}

ffi::Error Forward(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer residual,
                   ffi::AnyBuffer scale, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> y,
                   ffi::Result<ffi::AnyBuffer> z, ffi::Result<ffi::AnyBuffer> mean_out,
                   ffi::Result<ffi::AnyBuffer> rstd_out, float eps, bool centered) {
  auto dims = x.dimensions();
  int64_t h = dims.size() ? dims[dims.size() - 1] : 0;
  int64_t rows = h ? x.element_count() / h : 0;
  int64_t batch = std::max(examples(scale, h), examples(bias, h));
  int64_t per = rows / batch;   // rows of one example
  bool ok = with_storage(x.element_type(), [&]<typename T>() {
    const T* px = static_cast<const T*>(x.untyped_data());
    const T* pr = optional<T>(residual);
    const float* ps = optional<float>(scale);   // the parameters arrive as float32
    const float* pb = optional<float>(bias);
    T* py = static_cast<T*>(y->untyped_data());
    T* pz = optional<T>(z);
    float* pmean = optional<float>(mean_out);
    float* prstd = optional<float>(rstd_out);
    float inv_h = 1.0f / static_cast<float>(h);
    for (int64_t e = 0; e < batch; ++e) {
      const float* es = ps ? ps + e * h : nullptr;
      const float* eb = pb ? pb + e * h : nullptr;
      parallel_for(pool, per, row_grain(h), [&](int64_t lo, int64_t hi) {
        std::vector<float> v(h), s(h, 1.0f), b(h, 0.0f);
        for (int64_t j = 0; j < (es ? h : 0); ++j) s[j] = es[j];
        for (int64_t j = 0; j < (eb ? h : 0); ++j) b[j] = eb[j];
        for (int64_t r = e * per + lo; r < e * per + hi; ++r) {
          const T* xr = px + r * h;
          if (pr) {   // z = x + residual, rounded to the storage type, is what is normalized
            const T* rr = pr + r * h;
            T* zr = pz + r * h;
            for (int64_t j = 0; j < h; ++j) {
              store(zr, j, load(xr, j) + load(rr, j));
              v[j] = load(zr, j);
            }
          } else {
            for (int64_t j = 0; j < h; ++j) v[j] = load(xr, j);
          }
          float mean = centered ? row_sum(v.data(), h) * inv_h : 0.0f;
          for (int64_t j = 0; j < h; ++j) v[j] -= mean;
          float rstd = 1.0f / std::sqrt(row_dot(v.data(), v.data(), h) * inv_h + eps);
          T* yr = py + r * h;
          for (int64_t j = 0; j < h; ++j) store(yr, j, v[j] * rstd * s[j] + b[j]);
          if (pmean) pmean[r] = mean;
          if (prstd) prstd[r] = rstd;
        }
      });
    }
  });
  return ok ? ffi::Error::Success() : unsupported(x.element_type());
}

ffi::Error Backward(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer g,
                    ffi::AnyBuffer g_sum, ffi::AnyBuffer scale, ffi::AnyBuffer mean_in,
                    ffi::AnyBuffer rstd_in, ffi::Result<ffi::AnyBuffer> dx,
                    ffi::Result<ffi::AnyBuffer> dscale, ffi::Result<ffi::AnyBuffer> dbias) {
  auto dims = x.dimensions();
  int64_t h = dims.size() ? dims[dims.size() - 1] : 0;
  int64_t rows = h ? x.element_count() / h : 0;
  int64_t grads = std::max(dscale->element_count(), dbias->element_count());
  int64_t batch = std::max(examples(scale, h), grads && h ? grads / h : int64_t{1});
  int64_t per = rows / batch;   // rows of one example
  bool ok = with_storage(x.element_type(), [&]<typename T>() {
    const T* px = static_cast<const T*>(x.untyped_data());
    const T* pg = static_cast<const T*>(g.untyped_data());
    const T* pgs = optional<T>(g_sum);
    const float* ps = optional<float>(scale);
    const float* pmean = optional<float>(mean_in);
    const float* prstd = static_cast<const float*>(rstd_in.untyped_data());
    T* pdx = static_cast<T*>(dx->untyped_data());
    float* pdscale = optional<float>(dscale);
    float* pdbias = optional<float>(dbias);
    int64_t chunks = chunk_count(pool, per, row_grain(h));
    // Per chunk: the sums of g * xhat and of g over its rows.
    std::vector<float> partial(static_cast<size_t>(chunks) * 2 * h);
    float inv_h = 1.0f / static_cast<float>(h);
    for (int64_t e = 0; e < batch; ++e) {
      const float* es = ps ? ps + e * h : nullptr;
      std::fill(partial.begin(), partial.end(), 0.0f);
      parallel_chunks(pool, per, chunks, [&](int64_t c, int64_t lo, int64_t hi) {
        // The parameters' gradients are summed over blocks of kBlockRows rows, then the blocks
        // into the chunk's sum: a float32 error of about (kBlockRows + rows / kBlockRows)
        // roundings rather than one per row.
        std::vector<float> xc(h), gf(h), gs(h), s(h, 1.0f), block(2 * h, 0.0f);
        for (int64_t j = 0; j < (es ? h : 0); ++j) s[j] = es[j];
        float* chunk_sums = partial.data() + c * 2 * h;
        float* acc_scale = block.data();
        float* acc_bias = acc_scale + h;
        for (int64_t r = e * per + lo; r < e * per + hi; ++r) {
          const T* xr = px + r * h;
          const T* gr = pg + r * h;
          float mean = pmean ? pmean[r] : 0.0f;
          float rstd = prstd[r];
          for (int64_t j = 0; j < h; ++j) {
            xc[j] = load(xr, j) - mean;
            gf[j] = load(gr, j);
            gs[j] = gf[j] * s[j];
          }
          float coef1 = rstd * rstd * rstd * inv_h * row_dot(gs.data(), xc.data(), h);
          float coef2 = pmean ? rstd * inv_h * row_sum(gs.data(), h) : 0.0f;
          T* dxr = pdx + r * h;
          if (pgs) {
            const T* gsr = pgs + r * h;
            for (int64_t j = 0; j < h; ++j)
              store(dxr, j, rstd * gs[j] - xc[j] * coef1 - coef2 + load(gsr, j));
          } else {
            for (int64_t j = 0; j < h; ++j) store(dxr, j, rstd * gs[j] - xc[j] * coef1 - coef2);
          }
          for (int64_t j = 0; j < h; ++j) {
            acc_scale[j] += gf[j] * (xc[j] * rstd);
            acc_bias[j] += gf[j];
          }
          if ((r - e * per - lo) % kBlockRows == kBlockRows - 1 || r == e * per + hi - 1) {
            for (int64_t j = 0; j < 2 * h; ++j) {
              chunk_sums[j] += block[j];
              block[j] = 0.0f;
            }
          }
        }
      });
      for (int64_t j = 0; j < h; ++j) {
        float ds = 0.0f, db = 0.0f;
        for (int64_t c = 0; c < chunks; ++c) {
          ds += partial[c * 2 * h + j];
          db += partial[c * 2 * h + h + j];
        }
        if (pdscale) pdscale[e * h + j] = ds;
        if (pdbias) pdbias[e * h + j] = db;
      }
    }
  });
  return ok ? ffi::Error::Success() : unsupported(x.element_type());
}

}  // namespace
}  // namespace jaxfuse

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxfuse_norm_forward, jaxfuse::Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()   // x
                                  .Arg<ffi::AnyBuffer>()   // residual (or empty)
                                  .Arg<ffi::AnyBuffer>()   // scale (or empty)
                                  .Arg<ffi::AnyBuffer>()   // bias (or empty)
                                  .Ret<ffi::AnyBuffer>()   // y
                                  .Ret<ffi::AnyBuffer>()   // z (or empty)
                                  .Ret<ffi::AnyBuffer>()   // mean (or empty)
                                  .Ret<ffi::AnyBuffer>()   // rstd (or empty)
                                  .Attr<float>("eps")
                                  .Attr<bool>("centered"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxfuse_norm_backward, jaxfuse::Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()   // x
                                  .Arg<ffi::AnyBuffer>()   // g
                                  .Arg<ffi::AnyBuffer>()   // g_sum (or empty)
                                  .Arg<ffi::AnyBuffer>()   // scale (or empty)
                                  .Arg<ffi::AnyBuffer>()   // mean (or empty)
                                  .Arg<ffi::AnyBuffer>()   // rstd
                                  .Ret<ffi::AnyBuffer>()   // dx
                                  .Ret<ffi::AnyBuffer>()   // dscale (or empty)
                                  .Ret<ffi::AnyBuffer>()); // dbias (or empty)
