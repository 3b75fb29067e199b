// One-pass CPU kernels for ``fused=True`` (SGD, Adam, AdamW, Adagrad) and RMSprop's default
// path, called through XLA's FFI.
//
// XLA's CPU backend has no multi-output fusion: a jitted SGD step is two loops over memory
// (buffer, then parameter) and Adam more, so each input is read more than once. These
// kernels read every input once and write every output once, in place (the outputs alias
// the inputs), split over XLA's intra-op thread pool.
//
// Numerics: each element goes through exactly the operations of the jitted rule
// (functorch_optim/_sgd.py, _adam.py, _adagrad.py, _rmsprop.py) in the same order and dtype. XLA's CPU code
// generator contracts a multiply feeding an add into one fused multiply-add, so the same
// places use ``std::fma`` here (torch's own FMAs: ``addcmul``, ``lerp``, ``add(alpha=)``);
// a product torch stores before adding it (``mul_``) the rule stores too, and it is
// rounded here as well. The file is compiled with ``-ffp-contract=off`` so that no other
// contraction happens. Scalars (learning rate, bias corrections, flags) are
// computed by the jitted code and passed in as small arrays, so changing them never
// recompiles anything.
//
// With the ``window`` attribute a call also carries grad_accumulate's accumulator (one
// more buffer kind, after the optimizer's): a call that does not close the window only
// adds the gradient in, one pass, and leaves params, buffers and counters as they are;
// the call that closes it reads the accumulator and the last gradient, writes the
// window's mean (or sum, or weighted mean) back and steps on it, in the same pass.
//
// Built with the package (setup.py, against the build-time jaxlib's ``jax.ffi.include_dir()``),
// for any CPU of the architecture: on x86-64 the element loops are compiled three times
// (x86-64-v4 = AVX-512, x86-64-v3 = AVX2 + FMA, and the baseline) and the loader picks the
// best the CPU runs (GCC/Clang function multiversioning, ``FO_CLONES``). ``std::fma`` is
// exact in every clone (an instruction, or the C library's correctly rounded ``fma``), and
// ``-ffp-contract=off`` holds for all of them, so every clone gives the same bits.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if !defined(FO_CLONES) && defined(__x86_64__) && defined(__ELF__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define FO_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
#endif
#ifndef FO_CLONES
#define FO_CLONES  // one build for the target's baseline (aarch64: NEON and FMA); tests set it
#endif

// Elements per work item: big enough that scheduling costs nothing, small enough to
// balance the threads.
constexpr int64_t kGrain = 1 << 16;

// Runs item(i) for i in [0, items) on the caller and the pool's threads. Workers take
// items from a shared counter; the caller never waits on a task that has not started
// (the pool may be busy with other work of the same step), only on items in progress.
template <typename Item>
void ParallelFor(ffi::ThreadPool& pool, int64_t items, Item item) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  if (items <= 1 || threads <= 1) {
    for (int64_t i = 0; i < items; ++i) item(i);
    return;
  }
  struct Shared {
    Item item;
    int64_t items;
    std::atomic<int64_t> next{0}, done{0};
    Shared(Item f, int64_t n) : item(std::move(f)), items(n) {}
    void Run() {
      for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
        item(i);
        if (done.fetch_add(1, std::memory_order_acq_rel) + 1 == items) done.notify_all();
      }
    }
  };
  auto shared = std::make_shared<Shared>(std::move(item), items);
  const int64_t helpers = std::min(threads, items) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([shared] { shared->Run(); });
  shared->Run();
  // sleep (futex), not spin, while a worker finishes its last item: on a busy machine
  // spinning would take the core that worker needs
  for (int64_t d; (d = shared->done.load(std::memory_order_acquire)) < items;) shared->done.wait(d);
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

// ------------------------------------------------------------------- accumulation window
// flags (appended to the optimizer's): [this call has a gradient, fresh, stepping, weighted]
// scalars (appended): [scale, weight]: what the closing call multiplies the window's sum
// by (1 / every for the mean: XLA turns grad_accumulate's ``sum / every`` into a multiply
// by the reciprocal; 1 / the weight sum for the weighted mean; 1 for the sum), and the
// weight this call's gradient is added in with (reduction "weighted" only).

// A window's scalars of one parameter. ``weight`` is 1 unless ``weighted``: the step's
// ``fma(g, weight, acc)`` is then ``acc + g`` exactly (one rounding of the same sum), so
// the loops need no branch on ``weighted`` (a branch kept GCC from vectorizing them).
template <typename T>
struct WindowScalars {
  T scale, weight;
  bool weighted;
};

// The gradient a step reads: the call's own (kWindow false), or the window's sum with the
// call's gradient added in (times its weight: ``acc + g * w``, contracted as XLA does),
// times the scale, written back to the accumulator as grad_accumulate's jitted path
// stores it.
template <typename T, bool kWindow, bool kHasG, bool kMean>
inline T StepGrad(int64_t i, const T* __restrict g, T* __restrict acc, const WindowScalars<T>& w) {
  if (!kWindow) return g[i];
  T a = acc[i];
  if (kHasG) a = std::fma(g[i], w.weight, a);  // acc + g exactly where not weighted (weight 1)
  if (kMean) a = a * w.scale;
  acc[i] = a;
  return a;
}

// A call that does not step: the window's first call overwrites the sum
// (``where(fresh, g, acc + g)``, weighted ``where(fresh, 0, acc) + g * w``; without a
// gradient ``where(fresh, 0, acc)``).
template <typename T>
FO_CLONES void AddLoop(int64_t lo, int64_t hi, T* __restrict acc, const T* __restrict g, bool fresh,
             const WindowScalars<T>& w) {
  if (g == nullptr) {
    if (fresh) std::fill(acc + lo, acc + hi, T(0));
  } else if (w.weighted) {
    const T wi = w.weight;
    if (fresh) {
      for (int64_t i = lo; i < hi; ++i) acc[i] = std::fma(g[i], wi, T(0));
    } else {
      for (int64_t i = lo; i < hi; ++i) acc[i] = std::fma(g[i], wi, acc[i]);
    }
  } else if (fresh) {
    std::copy(g + lo, g + hi, acc + lo);
  } else {
    for (int64_t i = lo; i < hi; ++i) acc[i] = acc[i] + g[i];
  }
}

// Where a step's new parameter goes: over the parameter, or with ``kDelta`` (``update``'s
// call: the parameter stays as it is) the update ``new - param`` over the gradient, which
// the loop has read at ``i`` already (the output aliases the gradient's operand).
template <bool kDelta, typename T>
inline void Put(int64_t i, T* __restrict p, T* __restrict g, T pi, T np) {
  if (kDelta) {
    g[i] = np - pi;
  } else {
    p[i] = np;
  }
}

// ---------------------------------------------------------------------------------- SGD
// scalars: [-lr, momentum, 1 - dampening, weight_decay]
// flags:   [active, weight_decay != 0, step == 1, momentum != 0]
template <typename T, bool kWd, bool kUse, bool kWindow, bool kHasG, bool kMean, bool kDelta>
FO_CLONES void SgdLoop(int64_t lo, int64_t hi, T* __restrict p, T* __restrict g, T* __restrict buf,
             T* __restrict acc, T neg_lr, T mom, T damp1, T wd, T sign, const WindowScalars<T>& w, bool first,
             bool nesterov) {
  for (int64_t i = lo; i < hi; ++i) {
    const T pi = p[i];
    T gi = StepGrad<T, kWindow, kHasG, kMean>(i, g, acc, w) * sign;
    if (kWd) gi = std::fma(wd, pi, gi);
    if (kUse) {
      // buf.mul_(momentum).add_(grad, alpha=1 - dampening): the product rounded, one FMA
      const T nb = first ? gi : std::fma(gi, damp1, buf[i] * mom);
      buf[i] = nb;
      gi = nesterov ? std::fma(mom, nb, gi) : nb;
    }
    Put<kDelta>(i, p, g, pi, std::fma(neg_lr, gi, pi));
  }
}

// --------------------------------------------------------------------------------- Adam
// scalars: [1 - lr*wd, wd, w = 1 - beta1, 1 - w, beta2, 1 - beta2, sqrt(bc2), eps, -lr/bc1]
// flags:   [active, weight_decay != 0, |w| < 0.5]
template <typename T>
struct AdamScalars {
  T decay, wd, w, w1, b2, omb2, bc2s, eps, neg_ss, sign;
  bool small;
};

// ``kSmall`` (``|w| < 0.5``, torch's lerp form) is a template flag, not a branch in the
// loop: with it in the loop GCC kept a branch per element and did not vectorize.
template <typename T, bool kDecay, bool kCoupled, bool kAms, bool kWindow, bool kHasG, bool kMean, bool kSmall,
          bool kDelta>
FO_CLONES void AdamLoop(int64_t lo, int64_t hi, T* __restrict p, T* __restrict g, T* __restrict m,
              T* __restrict v, T* __restrict vmax, T* __restrict acc, const AdamScalars<T> c,
              const WindowScalars<T>& w) {
  for (int64_t i = lo; i < hi; ++i) {
    const T pi = p[i];
    T gi = StepGrad<T, kWindow, kHasG, kMean>(i, g, acc, w) * c.sign;
    if (kCoupled) gi = std::fma(c.wd, pi, gi);
    const T mi = m[i];
    const T diff = gi - mi;
    const T nm = kSmall ? std::fma(c.w, diff, mi) : std::fma(-diff, c.w1, gi);
    m[i] = nm;
    // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2): the decayed moment
    // rounded, then one rounding of the gradient's product and the add
    const T nv = std::fma(c.omb2 * gi, gi, v[i] * c.b2);
    v[i] = nv;
    T second = nv;
    if (kAms) {
      second = Maximum(vmax[i], nv);
      vmax[i] = second;
    }
    // (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps): a division, then an add
    const T denom = std::sqrt(second) / c.bc2s + c.eps;
    const T update = (c.neg_ss * nm) / denom;
    // decoupled decay: param.mul_(1 - lr * wd) rounds, then the update is added
    Put<kDelta>(i, p, g, pi, (kDecay ? pi * c.decay : pi) + update);
  }
}

// ------------------------------------------------------------------------------ Adagrad
// scalars: [-clr = -lr / (1 + (step - 1) * lr_decay), weight_decay, eps]
// flags:   [active, weight_decay != 0]
template <typename T, bool kWd, bool kWindow, bool kHasG, bool kMean, bool kDelta>
FO_CLONES void AdagradLoop(int64_t lo, int64_t hi, T* __restrict p, T* __restrict g, T* __restrict sum,
                 T* __restrict acc, T neg_clr, T wd, T eps, T sign, const WindowScalars<T>& w) {
  for (int64_t i = lo; i < hi; ++i) {
    const T pi = p[i];
    T gi = StepGrad<T, kWindow, kHasG, kMean>(i, g, acc, w) * sign;
    if (kWd) gi = std::fma(wd, pi, gi);
    const T ns = std::fma(gi, gi, sum[i]);
    sum[i] = ns;
    Put<kDelta>(i, p, g, pi, pi + (neg_clr * gi) / (std::sqrt(ns) + eps));
  }
}

// ------------------------------------------------------------------------------ RMSprop
// scalars: [alpha, 1 - alpha, 1 - (1 - alpha), eps, -lr, weight_decay, momentum]
// flags:   [active, weight_decay != 0, momentum > 0, |1 - alpha| < 0.5]
// The rule's ``_torch_ops.fma`` is one FMA instruction in XLA's CPU program (where the CPU
// has one: ``cpu_contracts_fma``), so ``std::fma`` here.
template <typename T>
struct RmspropScalars {
  T alpha, oma, omoma, eps, neg_lr, wd, mom, sign;
};

template <typename T, bool kWd, bool kCentered, bool kMom, bool kWindow, bool kHasG, bool kMean, bool kSmall,
          bool kDelta>
FO_CLONES void RmspropLoop(int64_t lo, int64_t hi, T* __restrict p, T* __restrict g, T* __restrict sq,
                 T* __restrict mb, T* __restrict ga, T* __restrict acc, const RmspropScalars<T> c,
                 const WindowScalars<T>& w) {
  for (int64_t i = lo; i < hi; ++i) {
    const T pi = p[i];
    T gi = StepGrad<T, kWindow, kHasG, kMean>(i, g, acc, w) * c.sign;
    if (kWd) gi = std::fma(pi, c.wd, gi);
    // square_avg.mul_(alpha).addcmul_(grad, grad, value=1 - alpha)
    const T ns = std::fma(c.oma * gi, gi, sq[i] * c.alpha);
    sq[i] = ns;
    T second = ns;
    if (kCentered) {
      // grad_avg.lerp_(grad, 1 - alpha); square_avg.addcmul(grad_avg, grad_avg, value=-1)
      const T a = ga[i];
      const T diff = gi - a;
      const T na = kSmall ? std::fma(c.oma, diff, a) : std::fma(-diff, c.omoma, gi);
      ga[i] = na;
      second = std::fma(-na, na, ns);
    }
    const T denom = std::sqrt(second) + c.eps;
    if (kMom) {
      // buf.mul_(momentum).addcdiv_(grad, avg): the product rounded, then the add
      const T nb = mb[i] * c.mom + gi / denom;
      mb[i] = nb;
      Put<kDelta>(i, p, g, pi, std::fma(nb, c.neg_lr, pi));
    } else {
      Put<kDelta>(i, p, g, pi, pi + (c.neg_lr * gi) / denom);
    }
  }
}

// ----------------------------------------------------------------------- the call
// One call updates every parameter of one dtype. ``args`` = params[L], grads[L], then
// each buffer kind's L arrays (with ``window``, the accumulator last), then one table in
// the parameters' dtype: per parameter its S scalars and F flags (0 or 1; flag 0: "this
// parameter takes this step"), row after row from row ``first_row`` (a table may serve
// several calls), or with ``one_row`` one row every parameter reads; after the rows
// elements the kernel does not read (``_fused._call``: they keep XLA's CPU client from running the program
// inline on the caller's thread; one operand, where three were three XLA kernels); ``rets`` =
// params[L] and the buffers, each aliasing its argument. The step counters are the jitted
// code's (parameters that step alike share one). A window call's parameter without a
// gradient in this call (its gradient flag is 0) may have a one-element stand-in for it.
// With ``delta`` (``update``'s call, never a window's) the parameters are only read, and
// the first outputs alias the gradients: each gets the update ``new - param`` (a
// parameter that does not take the step: ``param - param``), what the jitted rule's
// ``update`` computes; no copy of the parameters, which stay alive after ``update``.
// A call's static attributes: its parameters, the table's row of the first, whether they
// all read one row, whether it is a window call, a delta call.
struct Call {
  int64_t count, first_row;
  bool one_row, window, delta;
};

template <typename T>
struct Leaves {
  int64_t count = 0, buffers = 0, n_scalars = 0, n_flags = 0, first_row = 0;
  bool window = false, one_row = false, delta = false;
  std::vector<int64_t> size;
  std::vector<T*> param;  // read only in a delta call
  std::vector<T*> grad;   // nullptr: no gradient in this call (window only); written only in a delta call
  std::vector<T*> buffer;  // buffer[k * count + i]; the accumulator is kind ``buffers``
  const T* table = nullptr;
  T* buf(int64_t k, int64_t i) const { return k < buffers ? buffer[k * count + i] : nullptr; }
  T* acc(int64_t i) const { return window ? buffer[buffers * count + i] : nullptr; }
  // parameter i's scalars and flags (flag 0: "takes this step")
  const T* scalar_row(int64_t i) const {
    return table + (one_row ? 0 : first_row + i) * (n_scalars + n_flags);
  }
  const T* flag_row(int64_t i) const { return scalar_row(i) + n_scalars; }
  // the window's flags of parameter i: [has a gradient, fresh, stepping, weighted]; its
  // scale and weight
  const T* window_flags(int64_t i) const { return flag_row(i) + n_flags - 4; }
  WindowScalars<T> window_scalars(int64_t i) const {
    if (!window) return {T(1), T(1), false};
    const bool weighted = window_flags(i)[3] != 0;
    const T* s = scalar_row(i) + n_scalars - 2;
    return {s[0], weighted ? s[1] : T(1), weighted};
  }
};

template <typename T>
ffi::Error Unpack(const char* name, ffi::RemainingArgs args, ffi::RemainingRets rets, const Call& call,
                  int64_t buffers, int64_t n_scalars, int64_t n_flags, Leaves<T>& out) {
  const int64_t count = call.count;
  const bool window = call.window;
  auto fail = [&](const std::string& what) {
    return ffi::Error::InvalidArgument(std::string(name) + ": " + what);
  };
  const int64_t kinds = buffers + (window ? 1 : 0);
  if (window) n_scalars += 2, n_flags += 4;
  if (window && call.delta) return fail("a window call writes its parameters");
  if (count < 1 || static_cast<int64_t>(args.size()) != (2 + kinds) * count + 1 ||
      static_cast<int64_t>(rets.size()) != (1 + kinds) * count) {
    return fail("wrong number of operands");
  }
  const ffi::DataType dtype = std::is_same_v<T, float> ? ffi::F32 : ffi::F64;
  ffi::AnyBuffer table = args.get<ffi::AnyBuffer>((2 + kinds) * count).value();
  const int64_t rows = call.one_row ? 1 : call.first_row + count;
  if (call.first_row < 0 || table.element_type() != dtype ||
      table.element_count() < rows * (n_scalars + n_flags)) {
    return fail("bad table of scalars and flags");
  }
  out.table = static_cast<const T*>(table.untyped_data());
  out.count = count;
  out.buffers = buffers;
  out.n_scalars = n_scalars;
  out.n_flags = n_flags;
  out.window = window;
  out.first_row = call.first_row;
  out.one_row = call.one_row;
  out.delta = call.delta;
  for (int64_t j = 0; j < (2 + kinds) * count; ++j) {
    ffi::AnyBuffer b = args.get<ffi::AnyBuffer>(j).value();
    const int64_t i = j % count;
    if (b.element_type() != dtype) return fail("operand of another dtype");
    // a window call's parameter without a gradient in this call (None: a one-element
    // stand-in; grad_mask off: the gradient, unread)
    const bool no_grad = window && j >= count && j < 2 * count && !out.window_flags(i)[0];
    // output i: the parameter's, or in a delta call its gradient's (the update over it)
    T* const output = j < 2 * count ? static_cast<T*>(rets.get<ffi::AnyBuffer>(i).value()->untyped_data())
                                    : nullptr;
    if (j < count) {
      out.size.push_back(b.element_count());
      out.param.push_back(call.delta ? static_cast<T*>(b.untyped_data()) : output);
    } else if (b.element_count() != out.size[i] && !(no_grad && b.element_count() == 1)) {
      return fail("operand unlike its parameter");
    } else if (j < 2 * count) {
      out.grad.push_back(no_grad ? nullptr : call.delta ? output : static_cast<T*>(b.untyped_data()));
    } else {
      out.buffer.push_back(static_cast<T*>(rets.get<ffi::AnyBuffer>(j - count).value()->untyped_data()));
    }
  }
  return ffi::Error::Success();
}

// An inactive leaf's share of a window call: the gradient added in, or on the closing
// call the window's mean written over the sum (the step itself is skipped).
template <typename T>
void WindowWork(const Leaves<T>& x, int64_t i, int64_t lo, int64_t hi) {
  const T* f = x.window_flags(i);  // has a gradient, fresh, stepping, weighted
  const WindowScalars<T> w = x.window_scalars(i);
  if (!f[2]) return AddLoop(lo, hi, x.acc(i), x.grad[i], bool(f[1]), w);
  WithFlags(
      [&](auto kHasG, auto kMean) {
        for (int64_t e = lo; e < hi; ++e) StepGrad<T, true, kHasG, kMean>(e, x.grad[i], x.acc(i), w);
      },
      x.grad[i] != nullptr, w.scale != T(1));
}

// A delta call's leaf that does not take the step: its update ``param - param`` (0, or NaN
// where the parameter is not finite, as the jitted ``new - param``).
template <typename T>
FO_CLONES void StillLoop(int64_t lo, int64_t hi, const T* __restrict p, T* __restrict u) {
  for (int64_t i = lo; i < hi; ++i) u[i] = p[i] - p[i];
}

// Runs step(leaf, lo, hi) over the elements of every active leaf, in items of kGrain. In
// a window call every leaf has work (the accumulator moves on every call): an active leaf
// steps, the others run WindowWork; in a delta call the others write their zero update.
template <typename T, typename Step>
void ForEachItem(ffi::ThreadPool& pool, const Leaves<T>& leaves, Step step) {
  struct Item {
    int64_t leaf, lo, hi;
    bool active;
  };
  std::vector<Item> items;
  for (int64_t i = 0; i < leaves.count; ++i) {
    // grad_mask: outputs alias inputs, unchanged
    const bool active = leaves.flag_row(i)[0] != 0;
    if (!active && !leaves.window && !leaves.delta) continue;
    for (int64_t lo = 0; lo < leaves.size[i]; lo += kGrain) {
      items.push_back({i, lo, std::min(leaves.size[i], lo + kGrain), active});
    }
  }
  ParallelFor(pool, static_cast<int64_t>(items.size()), [&](int64_t k) {
    const Item& it = items[k];
    if (it.active) {
      step(it.leaf, it.lo, it.hi);
    } else if (leaves.window) {
      WindowWork(leaves, it.leaf, it.lo, it.hi);
    } else {
      StillLoop(it.lo, it.hi, leaves.param[it.leaf], leaves.grad[it.leaf]);
    }
  });
}

// The call's template flags for leaf i, (window, this call has a gradient, scaled, delta),
// and its window scalars, for f(scalars, flags...): only the combinations a call can have
// are compiled (the gradient's flags in a window call, a delta outside one).
template <typename T, typename F>
void WithWindow(const Leaves<T>& x, int64_t i, F&& f) {
  const bool window = x.window;
  const WindowScalars<T> w = x.window_scalars(i);
  WithFlags(
      [&](auto kWindow, auto kHasG, auto kMean, auto kDelta) {
        if constexpr (kWindow ? !kDelta : !kHasG && !kMean) f(w, kWindow, kHasG, kMean, kDelta);
      },
      window, window && x.grad[i] != nullptr, window && w.scale != T(1), !window && x.delta);
}

template <typename T>
void SgdStep(ffi::ThreadPool& pool, const Leaves<T>& x, bool nesterov, bool maximize) {
  auto step = [&](int64_t i, int64_t lo, int64_t hi) {
    const T* s = x.scalar_row(i);  // -lr, momentum, 1 - dampening, weight_decay
    const T* f = x.flag_row(i);  // active, weight_decay != 0, step == 1, momentum != 0
    WithWindow(x, i, [&](const WindowScalars<T>& w, auto kWindow, auto kHasG, auto kMean, auto kDelta) {
      WithFlags(
          [&](auto kWd, auto kUse) {
            SgdLoop<T, kWd, kUse, kWindow, kHasG, kMean, kDelta>(lo, hi, x.param[i], x.grad[i], x.buf(0, i),
                                                         x.acc(i), s[0], s[1], s[2], s[3],
                                                         maximize ? T(-1) : T(1), w, bool(f[2]),
                                                         nesterov);
          },
          bool(f[1]), x.buffers > 0 && f[3]);
    });
  };
  ForEachItem(pool, x, step);
}

template <typename T>
void AdamStep(ffi::ThreadPool& pool, const Leaves<T>& x, bool maximize, bool decoupled) {
  auto step = [&](int64_t i, int64_t lo, int64_t hi) {
    const T* s = x.scalar_row(i);
    const T* f = x.flag_row(i);  // active, weight_decay != 0, |w| < 0.5
    const AdamScalars<T> c{s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], s[8],
                           maximize ? T(-1) : T(1), bool(f[2])};
    WithWindow(x, i, [&](const WindowScalars<T>& w, auto kWindow, auto kHasG, auto kMean, auto kDelta) {
      WithFlags(
          [&](auto kDecay, auto kCoupled, auto kAms, auto kSmall) {
            AdamLoop<T, kDecay, kCoupled, kAms, kWindow, kHasG, kMean, kSmall, kDelta>(
                lo, hi, x.param[i], x.grad[i], x.buf(0, i), x.buf(1, i), x.buf(2, i), x.acc(i), c, w);
          },
          decoupled && f[1], !decoupled && f[1], x.buffers == 3, c.small);
    });
  };
  ForEachItem(pool, x, step);
}

template <typename T>
void AdagradStep(ffi::ThreadPool& pool, const Leaves<T>& x, bool maximize) {
  auto step = [&](int64_t i, int64_t lo, int64_t hi) {
    const T* s = x.scalar_row(i);  // -clr, weight_decay, eps
    const T* f = x.flag_row(i);  // active, weight_decay != 0
    WithWindow(x, i, [&](const WindowScalars<T>& w, auto kWindow, auto kHasG, auto kMean, auto kDelta) {
      WithFlags(
          [&](auto kWd) {
            AdagradLoop<T, kWd, kWindow, kHasG, kMean, kDelta>(lo, hi, x.param[i], x.grad[i], x.buf(0, i), x.acc(i),
                                                       s[0], s[1], s[2], maximize ? T(-1) : T(1), w);
          },
          bool(f[1]));
    });
  };
  ForEachItem(pool, x, step);
}

// buffers: square_avg, then momentum_buffer (``has_momentum``), then grad_avg (``centered``)
template <typename T>
void RmspropStep(ffi::ThreadPool& pool, const Leaves<T>& x, bool has_momentum, bool centered, bool maximize) {
  auto step = [&](int64_t i, int64_t lo, int64_t hi) {
    const T* s = x.scalar_row(i);
    const T* f = x.flag_row(i);  // active, weight_decay != 0, momentum > 0, |1 - alpha| < 0.5
    const RmspropScalars<T> c{s[0], s[1], s[2], s[3], s[4], s[5], s[6], maximize ? T(-1) : T(1)};
    T* mb = has_momentum ? x.buf(1, i) : nullptr;
    T* ga = centered ? x.buf(has_momentum ? 2 : 1, i) : nullptr;
    WithWindow(x, i, [&](const WindowScalars<T>& w, auto kWindow, auto kHasG, auto kMean, auto kDelta) {
      WithFlags(
          [&](auto kWd, auto kCentered, auto kMom, auto kSmall) {
            RmspropLoop<T, kWd, kCentered, kMom, kWindow, kHasG, kMean, kSmall, kDelta>(
                lo, hi, x.param[i], x.grad[i], x.buf(0, i), mb, ga, x.acc(i), c, w);
          },
          bool(f[1]), centered, has_momentum && f[2], centered && f[3]);
    });
  };
  ForEachItem(pool, x, step);
}

// Runs step(leaves) with T the operands' C++ type.
template <typename Step>
ffi::Error Dispatch(const char* name, ffi::RemainingArgs args, ffi::RemainingRets rets, const Call& call,
                    int64_t buffers, int64_t n_scalars, int64_t n_flags, Step step) {
  if (args.size() == 0) return ffi::Error::InvalidArgument(std::string(name) + ": no operands");
  const ffi::DataType dtype = args.get<ffi::AnyBuffer>(0).value().element_type();
  auto run = [&](auto zero) {
    using T = decltype(zero);
    Leaves<T> leaves;
    ffi::Error e = Unpack<T>(name, args, rets, call, buffers, n_scalars, n_flags, leaves);
    if (e.failure()) return e;
    step(leaves);
    return ffi::Error::Success();
  };
  if (dtype == ffi::F32) return run(float{});
  if (dtype == ffi::F64) return run(double{});
  return ffi::Error::InvalidArgument(std::string(name) + ": float32 or float64 parameters only");
}

ffi::Error SgdImpl(ffi::ThreadPool pool, ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t count,
                   int64_t first_row, bool one_row, bool window, bool delta, bool has_momentum, bool nesterov,
                   bool maximize) {
  return Dispatch("fused SGD", args, rets, {count, first_row, one_row, window, delta}, has_momentum ? 1 : 0, 4, 4,
                  [&](const auto& leaves) { SgdStep(pool, leaves, nesterov, maximize); });
}

ffi::Error AdamImpl(ffi::ThreadPool pool, ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t count,
                    int64_t first_row, bool one_row, bool window, bool delta, bool maximize, bool decoupled,
                    bool amsgrad) {
  return Dispatch("fused Adam", args, rets, {count, first_row, one_row, window, delta}, amsgrad ? 3 : 2, 9, 3,
                  [&](const auto& leaves) { AdamStep(pool, leaves, maximize, decoupled); });
}

ffi::Error AdagradImpl(ffi::ThreadPool pool, ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t count,
                       int64_t first_row, bool one_row, bool window, bool delta, bool maximize) {
  return Dispatch("fused Adagrad", args, rets, {count, first_row, one_row, window, delta}, 1, 3, 2,
                  [&](const auto& leaves) { AdagradStep(pool, leaves, maximize); });
}

ffi::Error RmspropImpl(ffi::ThreadPool pool, ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t count,
                       int64_t first_row, bool one_row, bool window, bool delta, bool has_momentum, bool centered,
                       bool maximize) {
  const int64_t buffers = 1 + (has_momentum ? 1 : 0) + (centered ? 1 : 0);
  return Dispatch("fused RMSprop", args, rets, {count, first_row, one_row, window, delta}, buffers, 7, 4,
                  [&](const auto& leaves) { RmspropStep(pool, leaves, has_momentum, centered, maximize); });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FoSgd, SgdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("count")
                                  .Attr<int64_t>("first_row")
                                  .Attr<bool>("one_row")
                                  .Attr<bool>("window")
                                  .Attr<bool>("delta")
                                  .Attr<bool>("has_momentum")
                                  .Attr<bool>("nesterov")
                                  .Attr<bool>("maximize"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FoAdam, AdamImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("count")
                                  .Attr<int64_t>("first_row")
                                  .Attr<bool>("one_row")
                                  .Attr<bool>("window")
                                  .Attr<bool>("delta")
                                  .Attr<bool>("maximize")
                                  .Attr<bool>("decoupled")
                                  .Attr<bool>("amsgrad"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FoAdagrad, AdagradImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("count")
                                  .Attr<int64_t>("first_row")
                                  .Attr<bool>("one_row")
                                  .Attr<bool>("window")
                                  .Attr<bool>("delta")
                                  .Attr<bool>("maximize"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FoRmsprop, RmspropImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("count")
                                  .Attr<int64_t>("first_row")
                                  .Attr<bool>("one_row")
                                  .Attr<bool>("window")
                                  .Attr<bool>("delta")
                                  .Attr<bool>("has_momentum")
                                  .Attr<bool>("centered")
                                  .Attr<bool>("maximize"));
