// Gated linear units, act(a) * b, forward and backward in one pass each (see gated_linear.py).
//
// Two layouts: separate (a and b two arrays of one shape) and packed (one array x whose rows
// are [a | b]). The backward reads a, b and g once and writes da = g * b * act'(a) and
// db = g * act(a) from the same loop.
#include "common.h"

namespace jaxfuse {
namespace {

template <Act A, typename T>
void forward_span(const T* __restrict a, const T* __restrict b, T* __restrict y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) store(y, i, act_value<A>(load(a, i)) * load(b, i));
}

template <Act A, typename T>
void backward_span(const T* __restrict a, const T* __restrict b, const T* __restrict g,
                   T* __restrict da, T* __restrict db, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float value, grad;
    act_value_grad<A>(load(a, i), value, grad);
    float gi = load(g, i);
    store(da, i, gi * load(b, i) * grad);
    store(db, i, gi * value);
  }
}

// The last axis of a packed array: [a | b], each half wide.
int64_t half_width(const ffi::AnyBuffer& x) {
  auto dims = x.dimensions();
  return dims.size() == 0 ? 0 : dims[dims.size() - 1] / 2;
}

// Calls fn.template operator()<T, A>() with the storage type and the activation; an error for
// a dtype or an activation index the kernels lack.
template <typename Fn>
ffi::Error with_types(ffi::DataType dtype, int32_t activation, Fn&& fn) {
  bool known = false;
  with_storage(dtype, [&]<typename T>() {
    known = with_activation(activation, [&]<Act A>() { fn.template operator()<T, A>(); });
  });
  if (known) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(
      "glu (cpu): float32, bfloat16 or float16 and a named activation, got dtype " +
      std::to_string(static_cast<int>(dtype)) + " and activation " + std::to_string(activation));
}

ffi::Error Forward(ffi::ThreadPool pool, ffi::AnyBuffer a, ffi::AnyBuffer b,
                   ffi::Result<ffi::AnyBuffer> y, int32_t activation) {
  return with_types(a.element_type(), activation, [&]<typename T, Act A>() {
    const T* pa = static_cast<const T*>(a.untyped_data());
    const T* pb = static_cast<const T*>(b.untyped_data());
    T* py = static_cast<T*>(y->untyped_data());
    parallel_for(pool, a.element_count(), kGrain, [&](int64_t lo, int64_t hi) {
      forward_span<A>(pa + lo, pb + lo, py + lo, hi - lo);
    });
  });
}

ffi::Error ForwardPacked(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                         int32_t activation) {
  int64_t h = half_width(x);
  int64_t rows = h ? x.element_count() / (2 * h) : 0;
  return with_types(x.element_type(), activation, [&]<typename T, Act A>() {
    const T* px = static_cast<const T*>(x.untyped_data());
    T* py = static_cast<T*>(y->untyped_data());
    parallel_for(pool, rows, row_grain(h), [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r)
        forward_span<A>(px + r * 2 * h, px + r * 2 * h + h, py + r * h, h);
    });
  });
}

ffi::Error Backward(ffi::ThreadPool pool, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer g,
                    ffi::Result<ffi::AnyBuffer> da, ffi::Result<ffi::AnyBuffer> db,
                    int32_t activation) {
  return with_types(a.element_type(), activation, [&]<typename T, Act A>() {
    const T* pa = static_cast<const T*>(a.untyped_data());
    const T* pb = static_cast<const T*>(b.untyped_data());
    const T* pg = static_cast<const T*>(g.untyped_data());
    T* pda = static_cast<T*>(da->untyped_data());
    T* pdb = static_cast<T*>(db->untyped_data());
    parallel_for(pool, a.element_count(), kGrain, [&](int64_t lo, int64_t hi) {
      backward_span<A>(pa + lo, pb + lo, pg + lo, pda + lo, pdb + lo, hi - lo);
    });
  });
}

ffi::Error BackwardPacked(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer g,
                          ffi::Result<ffi::AnyBuffer> dx, int32_t activation) {
  int64_t h = half_width(x);
  int64_t rows = h ? x.element_count() / (2 * h) : 0;
  return with_types(x.element_type(), activation, [&]<typename T, Act A>() {
    const T* px = static_cast<const T*>(x.untyped_data());
    const T* pg = static_cast<const T*>(g.untyped_data());
    T* pdx = static_cast<T*>(dx->untyped_data());
    parallel_for(pool, rows, row_grain(h), [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        int64_t row = r * 2 * h;
        backward_span<A>(px + row, px + row + h, pg + r * h, pdx + row, pdx + row + h, h);
      }
    });
  });
}

}  // namespace
}  // namespace jaxfuse

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxfuse_glu_forward, jaxfuse::Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("activation"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxfuse_glu_forward_packed, jaxfuse::ForwardPacked,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("activation"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxfuse_glu_backward, jaxfuse::Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("activation"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxfuse_glu_backward_packed, jaxfuse::BackwardPacked,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("activation"));
