// One-pass CPU kernels for ``fused=True`` (SGD, Adam, AdamW), called through XLA's FFI.
//
// XLA's CPU backend has no multi-output fusion: a jitted SGD step is two loops over memory
// (buffer, then parameter) and Adam more, so each input is read more than once. These
// kernels read every input once and write every output once, in place (the outputs alias
// the inputs), split over XLA's intra-op thread pool.
//
// Numerics: each element goes through exactly the operations of the jitted rule
// (functorch_optim/_sgd.py, _adam.py) in the same order and dtype. XLA's CPU code
// generator contracts a multiply feeding an add into one fused multiply-add, so the same
// places use ``std::fma`` here; the file is compiled with ``-ffp-contract=off`` so that no
// other contraction happens. Scalars (learning rate, bias corrections, flags) are
// computed by the jitted code and passed in as small arrays, so changing them never
// recompiles anything.
//
// Built on first use by functorch_optim/_fused.py against ``jax.ffi.include_dir()``.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Elements per task: big enough that scheduling costs nothing, small enough to balance.
constexpr int64_t kGrain = 1 << 16;

// Runs body(lo, hi) over [0, n) on the caller and the pool's threads. Workers take chunks
// from a shared counter; the caller never waits on a task that has not started (the pool
// may be busy with other kernels of the same step), only on chunks in progress.
template <typename Body>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, Body body) {
  const int64_t chunks = (n + kGrain - 1) / kGrain;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  if (chunks <= 1 || threads <= 1) {
    body(0, n);
    return;
  }
  struct Shared {
    Body body;
    int64_t n, chunks;
    std::atomic<int64_t> next{0}, done{0};
    Shared(Body b, int64_t n, int64_t c) : body(std::move(b)), n(n), chunks(c) {}
    void Run() {
      for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
        body(c * kGrain, std::min(n, (c + 1) * kGrain));
        if (done.fetch_add(1, std::memory_order_acq_rel) + 1 == chunks) done.notify_all();
      }
    }
  };
  auto shared = std::make_shared<Shared>(std::move(body), n, chunks);
  const int64_t helpers = std::min(threads, chunks) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([shared] { shared->Run(); });
  shared->Run();
  // sleep (futex), not spin, while a worker finishes its last chunk: on a busy machine
  // spinning would take the core that worker needs
  for (int64_t d; (d = shared->done.load(std::memory_order_acquire)) < chunks;) shared->done.wait(d);
}

// Calls f(std::integral_constant<bool, b>...) so that flags become compile-time constants
// and every loop below is a straight, vectorizable line.
template <typename F>
void WithFlags(F&& f) {
  f();
}
template <typename F, typename... Rest>
void WithFlags(F&& f, bool b, Rest... rest) {
  if (b) {
    WithFlags([&](auto... c) { f(std::true_type{}, c...); }, rest...);
  } else {
    WithFlags([&](auto... c) { f(std::false_type{}, c...); }, rest...);
  }
}

// XLA's maximum: NaN if either operand is NaN.
template <typename T>
inline T Maximum(T a, T b) {
  return (a > b || a != a) ? a : b;
}

// ---------------------------------------------------------------------------------- SGD
// scalars: [-lr, momentum, 1 - dampening, weight_decay]
// flags:   [active, weight_decay != 0, step == 1, momentum != 0]
template <typename T, bool kWd, bool kUse>
void SgdLoop(int64_t lo, int64_t hi, T* __restrict p, const T* __restrict g, T* __restrict buf,
             T neg_lr, T mom, T damp1, T wd, T sign, bool first, bool nesterov) {
  for (int64_t i = lo; i < hi; ++i) {
    const T pi = p[i];
    T gi = g[i] * sign;
    if (kWd) gi = std::fma(wd, pi, gi);
    if (kUse) {
      const T nb = first ? gi : std::fma(buf[i], mom, damp1 * gi);
      buf[i] = nb;
      gi = nesterov ? std::fma(mom, nb, gi) : nb;
    }
    p[i] = std::fma(neg_lr, gi, pi);
  }
}

template <typename T>
void Sgd(ffi::ThreadPool& pool, int64_t n, T* p, const T* g, T* buf, const T* s, const int32_t* f,
         bool has_momentum, bool nesterov, bool maximize) {
  if (!f[0]) return;  // grad_mask: outputs alias inputs, unchanged
  const T neg_lr = s[0], mom = s[1], damp1 = s[2], wd = s[3];
  const T sign = maximize ? T(-1) : T(1);  // -g exactly
  const bool first = f[2];
  // the loop is a plain function of plain values: the vectorizer then knows that the
  // stores cannot change the scalars (captured in a closure, they could alias)
  WithFlags(
      [&](auto kWd, auto kUse) {
        ParallelFor(pool, n, [=](int64_t lo, int64_t hi) {
          SgdLoop<T, kWd, kUse>(lo, hi, p, g, buf, neg_lr, mom, damp1, wd, sign, first, nesterov);
        });
      },
      bool(f[1]), has_momentum && f[3]);
}

// --------------------------------------------------------------------------------- Adam
// scalars: [1 - lr*wd, wd, w = 1 - beta1, 1 - w, beta2, 1 - beta2, 1 / sqrt(bc2), eps, -lr/bc1]
// flags:   [active, weight_decay != 0, |w| < 0.5]
template <typename T>
struct AdamScalars {
  T decay, wd, w, w1, b2, omb2, inv_bc2s, eps, neg_ss, sign;
  bool small;
};

template <typename T, bool kDecay, bool kCoupled, bool kAms>
void AdamLoop(int64_t lo, int64_t hi, T* __restrict p, const T* __restrict g, T* __restrict m,
              T* __restrict v, T* __restrict vmax, const AdamScalars<T> c) {
  for (int64_t i = lo; i < hi; ++i) {
    const T pi = p[i];
    T gi = g[i] * c.sign;
    if (kCoupled) gi = std::fma(c.wd, pi, gi);
    const T mi = m[i];
    const T diff = gi - mi;
    const T nm = c.small ? std::fma(c.w, diff, mi) : std::fma(-diff, c.w1, gi);
    m[i] = nm;
    const T nv = std::fma(v[i], c.b2, c.omb2 * gi * gi);
    v[i] = nv;
    T second = nv;
    if (kAms) {
      second = Maximum(vmax[i], nv);
      vmax[i] = second;
    }
    const T denom = std::fma(std::sqrt(second), c.inv_bc2s, c.eps);
    const T update = (c.neg_ss * nm) / denom;
    // decoupled decay: XLA contracts ``param * (1 - lr * wd) + update``
    p[i] = kDecay ? std::fma(pi, c.decay, update) : pi + update;
  }
}

template <typename T>
void Adam(ffi::ThreadPool& pool, int64_t n, T* p, const T* g, T* m, T* v, T* vmax, const T* s,
          const int32_t* f, bool maximize, bool decoupled) {
  if (!f[0]) return;
  const AdamScalars<T> c{s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], s[8],
                         maximize ? T(-1) : T(1), bool(f[2])};
  WithFlags(
      [&](auto kDecay, auto kCoupled, auto kAms) {
        ParallelFor(pool, n, [=](int64_t lo, int64_t hi) {
          AdamLoop<T, kDecay, kCoupled, kAms>(lo, hi, p, g, m, v, vmax, c);
        });
      },
      decoupled && f[1], !decoupled && f[1], vmax != nullptr);
}

// The operands of one call: ``args`` = param, grad, buffers..., scalars, flags and
// ``rets`` = param, buffers... (each aliasing its argument), all of the parameter's dtype.
struct Operands {
  ffi::RemainingArgs args;
  ffi::RemainingRets rets;
  ffi::DataType dtype() const { return args.get<ffi::AnyBuffer>(0).value().element_type(); }
  int64_t size() const { return args.get<ffi::AnyBuffer>(0).value().element_count(); }
  template <typename T>
  const T* in(size_t i) const {
    return static_cast<const T*>(args.get<ffi::AnyBuffer>(i).value().untyped_data());
  }
  template <typename T>
  T* out(size_t i) const {
    return static_cast<T*>(rets.get<ffi::AnyBuffer>(i).value()->untyped_data());
  }
  // Every array operand shaped and typed like the parameter; scalars and int32 flags after.
  ffi::Error Check(const char* name, size_t buffers) const {
    if (args.size() != buffers + 4 || rets.size() != buffers + 1) {
      return ffi::Error::InvalidArgument(std::string(name) + ": wrong number of operands");
    }
    const ffi::DataType t = dtype();
    if (t != ffi::F32 && t != ffi::F64) {
      return ffi::Error::InvalidArgument(std::string(name) + ": float32 or float64 only");
    }
    for (size_t i = 1; i < buffers + 2; ++i) {
      ffi::AnyBuffer b = args.get<ffi::AnyBuffer>(i).value();
      if (b.element_type() != t || b.element_count() != size()) {
        return ffi::Error::InvalidArgument(std::string(name) + ": operand unlike the parameter");
      }
    }
    if (args.get<ffi::AnyBuffer>(buffers + 2).value().element_type() != t ||
        args.get<ffi::AnyBuffer>(buffers + 3).value().element_type() != ffi::S32) {
      return ffi::Error::InvalidArgument(std::string(name) + ": bad scalars or flags");
    }
    return ffi::Error::Success();
  }
};

// Runs fn(T{}) with T the parameter's C++ type.
template <typename F>
void ByDtype(const Operands& ops, F&& fn) {
  if (ops.dtype() == ffi::F32) {
    fn(float{});
  } else {
    fn(double{});
  }
}

ffi::Error SgdImpl(ffi::ThreadPool pool, ffi::RemainingArgs args, ffi::RemainingRets rets,
                   bool has_momentum, bool nesterov, bool maximize) {
  const Operands ops{args, rets};
  const size_t k = has_momentum ? 1 : 0;
  if (ffi::Error e = ops.Check("fused SGD", k); e.failure()) return e;
  ByDtype(ops, [&](auto zero) {
    using T = decltype(zero);
    Sgd<T>(pool, ops.size(), ops.out<T>(0), ops.in<T>(1), k ? ops.out<T>(1) : nullptr,
           ops.in<T>(k + 2), ops.in<int32_t>(k + 3), has_momentum, nesterov, maximize);
  });
  return ffi::Error::Success();
}

ffi::Error AdamImpl(ffi::ThreadPool pool, ffi::RemainingArgs args, ffi::RemainingRets rets,
                    bool maximize, bool decoupled, bool amsgrad) {
  const Operands ops{args, rets};
  const size_t k = amsgrad ? 3 : 2;
  if (ffi::Error e = ops.Check("fused Adam", k); e.failure()) return e;
  ByDtype(ops, [&](auto zero) {
    using T = decltype(zero);
    Adam<T>(pool, ops.size(), ops.out<T>(0), ops.in<T>(1), ops.out<T>(1), ops.out<T>(2),
            amsgrad ? ops.out<T>(3) : nullptr, ops.in<T>(k + 2), ops.in<int32_t>(k + 3),
            maximize, decoupled);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FoSgd, SgdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<bool>("has_momentum")
                                  .Attr<bool>("nesterov")
                                  .Attr<bool>("maximize"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FoAdam, AdamImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<bool>("maximize")
                                  .Attr<bool>("decoupled")
                                  .Attr<bool>("amsgrad"));
