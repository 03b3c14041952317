// The Gram -> task-weights solves of fastpals.surgery, once, as C++ that compiles for the host and for CUDA
// devices (FASTPALS_HD = __host__ __device__ under nvcc). Templates over the arithmetic type (float or double);
// nothing allocates: every function works in a caller-provided workspace of solve_workspace_size(method, T)
// elements. Sequential code for one problem; the CPU entry (solve_weights.cpp) calls solve_weights() once per
// solve, the CUDA kernel (solve_weights_kernel.cuh) runs it on one thread of one block.
//
// Each method follows its PyTorch transcription in fastpals/surgery (same algorithm, same fixed rules, same order
// of rounding steps where it matters), which stays the reference and the fallback:
//   jacobi_eigh   solvers.py jacobi_eigh      cyclic Jacobi, round-robin order, Demmel-Veselic skip rule
//   nonneg_qp     solvers.py nonneg_qp        block principal pivoting with Murty's backup rule
//   mgda          weights_solved.py           Frank-Wolfe (Sener & Koltun, Algorithm 2)
//   alpha_fair    weights_solved.py           FairGrad's / Nash-MTL's damped Newton root
// The linear solves are LU with partial pivoting (the PyTorch code: clamped Gauss-Jordan up to T = 16, LAPACK's
// LU beyond), so results agree to round-off, not bit for bit.
// Iterative loops stop once their iterate is a fixed point (the PyTorch code runs the whole fixed budget with
// the iterate frozen instead, which gives the same result).
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define FASTPALS_HD __host__ __device__
#define FASTPALS_NOINLINE __noinline__
#else
#define FASTPALS_HD
#define FASTPALS_NOINLINE
#endif

namespace fastpals {

// method codes of solve_weights (the op's `method` string maps to these in solve_weights.cpp)
enum Method : int {
  IMTLG = 0,
  ALIGNEDMTL = 1,
  UPGRAD = 2,
  DUALPROJ = 3,
  GEM = 4,
  MGDA = 5,
  ALPHA_FAIR = 6,
  GRADVAC = 7,
  PCGRAD = 8,
  CAGRAD = 9,
  SUM = 10,
  MEAN = 11,
  CONSTANT = 12,
  RANDOM = 13,
  PCD = 14,
  MODO = 15,
  SDMGRAD = 16,
  KRUM = 17,
  NUM_METHODS = 18
};

// the slots of the `params` array per method (unused slots are ignored)
//   IMTLG:      [0] sweeps
//   ALIGNEDMTL: [0] sweeps, [1] scale mode (0 min, 1 median, 2 rmse), [2] eps of the Gram's dtype
//   UPGRAD, DUALPROJ: [0] norm_eps, [1] reg_eps, [2] max_iter
//   GEM:        [0] tol, [1] ridge, [2] max_iter
//   MGDA:       [0] epsilon, [1] max_iters
//   ALPHA_FAIR: [0] alpha (> 0), [1] max_iter  (FairGrad's and Nash-MTL's root of G x = x^(-1/alpha))
//   GRADVAC:    [0] beta, [1] eps; vec: the projection orders (T x (T - 1), row-major); state: the EMA
//               targets phi_hat (T x T, read and written)
//   PCGRAD:     vec: the projection orders (T x (T - 1), row-major)
//   CAGRAD:     [0] c, [1] norm_eps, [2] 1: every support (exact), 0: projected gradient then active set;
//               vec: [0] projected-gradient iterations, [1] active-set iterations
//   PCD:        [0] the relative precision below which the direction counts as zero; vec: the scales s [0, T),
//               the fractions tau of the secondary tasks [T, 2T - 1)
//   MODO:       [0] gamma, [1] rho; state: lambda [T] (read and written)
//   SDMGRAD:    [0] lr, [1] momentum, [2] n_iter; vec: the preference p [0, T), lambda_ at [T]; state: w [T]
//   KRUM:       [0] n_byzantine, [1] n_selected
//   SUM, MEAN:  none;  CONSTANT: vec [0, T) the weights;  RANDOM: vec [0, T) the normal draws z (w = softmax(z))
// `vec` (length vec_size(method, T)): UPGRAD/DUALPROJ/ALIGNEDMTL: the preference vector in [0, T); GEM: the proposal in [0, T)
// and the constraint mask (1 or 0) in [T, 2T); MGDA, IMTLG: unused.
constexpr int NUM_PARAMS = 3;

template <typename S>
struct Eps;
template <>
struct Eps<double> {
  static constexpr double value = DBL_EPSILON;
  static constexpr double tiny = DBL_MIN;
};
template <>
struct Eps<float> {
  static constexpr float value = FLT_EPSILON;
  static constexpr float tiny = FLT_MIN;
};

template <typename S>
FASTPALS_HD inline S smax(S a, S b) { return a > b ? a : b; }
template <typename S>
FASTPALS_HD inline S smin(S a, S b) { return a < b ? a : b; }

// a positive floor v in double, the smallest normal float in float (v would underflow to 0)
template <typename S>
FASTPALS_HD inline S floor_of(double v) { return S(sizeof(S) == sizeof(double) ? v : 1e-37); }

template <typename S>
FASTPALS_HD inline bool finite(S v) {
#if defined(__CUDA_ARCH__)
  return isfinite(v);
#else
  return std::isfinite(v);
#endif
}

FASTPALS_HD inline int jacobi_sweeps(int t) {
  int n = t + t % 2, bits = 0;
  for (int v = n - 1; v > 0; v >>= 1) ++bits;
  return 2 * bits + 4;
}

FASTPALS_HD inline int64_t jacobi_workspace(int t) {
  int n = t + t % 2;
  return 2 * int64_t(n) * n + 3 * int64_t(n);
}

// Eigendecomposition of the symmetric n x n matrix m (row-major, n even; an odd T is padded by the caller with
// a zero row and column), in place: on return diag(m) holds the eigenvalues and vec (n x n, row-major) the
// eigenvectors in its columns. At most `sweeps` sweeps of n - 1 rounds of n / 2 disjoint rotations; each round
// rotates the rows of all its pairs, then the columns, then zeroes the pairs' off-diagonal entries, as the
// PyTorch transcription does. The column rotation is done as a row rotation of the transpose (the same
// products and sums, contiguous), and the eigenvectors are kept transposed until the end. work: 3 n elements.
template <typename S>
FASTPALS_HD void rotate_rows(S* a, int n, int p, int q, S c, S sp, S sq) {
  for (int j = 0; j < n; ++j) {
    S ap = a[p * n + j], aq = a[q * n + j];
    a[p * n + j] = c * ap + sp * aq;
    a[q * n + j] = c * aq + sq * ap;
  }
}

template <typename S>
FASTPALS_HD void transpose(S* a, int n) {
  for (int i = 0; i < n; ++i)
    for (int j = i + 1; j < n; ++j) {
      S tmp = a[i * n + j];
      a[i * n + j] = a[j * n + i];
      a[j * n + i] = tmp;
    }
}

template <typename S>
FASTPALS_HD void jacobi_eigh(S* m, S* vec, int n, int sweeps, S* work) {
  S* cs = work;               // cos of the rotation that index i is part of
  S* sn = work + n;           // signed sin (R[partner(i), i])
  S* partner = work + 2 * n;  // as S to keep one workspace type
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j) vec[i * n + j] = i == j ? S(1) : S(0);  // vec^T
  const S eps = Eps<double>::value;  // the float64 eps, as in the transcription
  const int half = n / 2;
  for (int sweep = 0; sweep < sweeps; ++sweep) {
    bool rotated = false;
    for (int r = 0; r < n - 1; ++r) {
      for (int k = 0; k < half; ++k) {
        int p = k == 0 ? 0 : 1 + (k - 1 + r) % (n - 1);
        int q = 1 + (n - 2 - k + r) % (n - 1);
        S app = m[p * n + p], aqq = m[q * n + q], apq = m[p * n + q];
        bool skip = fabs(apq) <= eps * sqrt(fabs(app * aqq));
        S theta = skip ? S(0) : S(0.5) * atan(S(2) * apq / (aqq - app));
        rotated = rotated || !skip;
        S c = cos(theta), s = sin(theta);
        cs[p] = c;
        cs[q] = c;
        sn[p] = -s;
        sn[q] = s;
        partner[p] = S(q);
        partner[q] = S(p);
      }
      // m <- R^T m (rows), m <- (R^T m^T)^T = m R (columns), vec^T <- R^T vec^T
      for (int k = 0; k < half; ++k) {
        int p = k == 0 ? 0 : 1 + (k - 1 + r) % (n - 1);
        int q = int(partner[p]);
        rotate_rows(m, n, p, q, cs[p], sn[p], sn[q]);
      }
      transpose(m, n);
      for (int k = 0; k < half; ++k) {
        int p = k == 0 ? 0 : 1 + (k - 1 + r) % (n - 1);
        int q = int(partner[p]);
        rotate_rows(m, n, p, q, cs[p], sn[p], sn[q]);
        rotate_rows(vec, n, p, q, cs[p], sn[p], sn[q]);
      }
      transpose(m, n);
      for (int k = 0; k < half; ++k) {
        int p = k == 0 ? 0 : 1 + (k - 1 + r) % (n - 1);
        int q = int(partner[p]);
        m[p * n + q] = S(0);
        m[q * n + p] = S(0);
      }
    }
    // a sweep without a rotation leaves diag(m) and vec as they are and every off-diagonal entry zero, so the
    // remaining sweeps of the budget are the identity
    if (!rotated) break;
  }
  transpose(vec, n);
}

// Solve a x = b in place (a: k x k row-major, general) by LU with partial pivoting (rows swapped in place).
template <typename S>
FASTPALS_HD void lu_solve(S* a, S* b, int k) {
  for (int c = 0; c < k; ++c) {
    int piv = c;
    for (int i = c + 1; i < k; ++i)
      if (fabs(a[i * k + c]) > fabs(a[piv * k + c])) piv = i;
    if (piv != c) {
      for (int j = 0; j < k; ++j) {
        S tmp = a[c * k + j];
        a[c * k + j] = a[piv * k + j];
        a[piv * k + j] = tmp;
      }
      S tmp = b[c];
      b[c] = b[piv];
      b[piv] = tmp;
    }
    S d = a[c * k + c];
    for (int i = c + 1; i < k; ++i) {
      S f = a[i * k + c] / d;
      for (int j = c + 1; j < k; ++j) a[i * k + j] -= f * a[c * k + j];
      b[i] -= f * b[c];
    }
  }
  for (int i = k - 1; i >= 0; --i) {
    S acc = b[i];
    for (int j = i + 1; j < k; ++j) acc -= a[i * k + j] * b[j];
    b[i] = acc / a[i * k + i];
  }
}

FASTPALS_HD inline int64_t qp_workspace(int t) { return int64_t(t) * t + 4 * int64_t(t); }

// x = argmin_{x >= 0} 1/2 x^T q x + b^T x for one right-hand side (q t x t symmetric positive definite), by block
// principal pivoting: full exchanges while the number of infeasible variables falls (and 3 more times), then
// Murty's single pivot on the largest infeasible index; at most `iters` exchanges, stopping once the KKT
// conditions hold to `thresh`. work: qp_workspace(t) elements.
template <typename S>
FASTPALS_HD void nonneg_qp(const S* q, const S* b, int t, int iters, S thresh, S* x, S* work) {
  S* sys = work;                 // t x t
  S* rhs = sys + t * t;          // t
  S* slack = rhs + t;            // t
  S* passive = slack + t;        // t: 1 free, 0 at the bound
  S* free_idx = passive + t;     // t
  for (int i = 0; i < t; ++i) passive[i] = S(0);
  int best = t + 1, backup_left = 3;
  for (int it = 0; it <= iters; ++it) {
    // x = the solution on the free set (solve_on)
    int k = 0;
    for (int i = 0; i < t; ++i)
      if (passive[i] != S(0)) free_idx[k++] = S(i);
    for (int a = 0; a < k; ++a) {
      int i = int(free_idx[a]);
      for (int c = 0; c < k; ++c) sys[a * k + c] = q[i * t + int(free_idx[c])];
      rhs[a] = -b[i];
    }
    lu_solve(sys, rhs, k);
    for (int i = 0; i < t; ++i) x[i] = S(0);
    for (int a = 0; a < k; ++a) x[int(free_idx[a])] = rhs[a];
    if (it == iters) break;
    int ninf = 0, largest = -1;
    for (int j = 0; j < t; ++j) {
      S s = b[j];
      S acc = S(0);
      for (int i = 0; i < t; ++i) acc += x[i] * q[i * t + j];
      s = acc + s;
      slack[j] = s;
      bool inf = passive[j] != S(0) ? x[j] < -thresh : s < -thresh;
      slack[j] = inf ? S(1) : S(0);  // reused as the infeasible flags
      if (inf) {
        ++ninf;
        largest = j;
      }
    }
    if (ninf == 0) break;  // optimal: further exchanges would leave the free set as it is
    bool improved = ninf < best;
    bool use_full = improved || backup_left > 0;
    backup_left = improved ? 3 : backup_left - 1;
    best = ninf < best ? ninf : best;
    for (int j = 0; j < t; ++j) {
      bool flip = slack[j] != S(0) && (use_full || j == largest);
      if (flip) passive[j] = passive[j] != S(0) ? S(0) : S(1);
    }
  }
  for (int i = 0; i < t; ++i) x[i] = smax(x[i], S(0));
}

// ------------------------------------------------------------------------------------------------------------
// the weightings: g is the T x T Gram (row-major, arithmetic type), w the T weights

// IMTL-G: w = G^+ d / sum(G^+ d), d_i = sqrt(G_ii); G^+ from the eigenpairs with |lam| > T eps max|lam|.
template <typename S>
FASTPALS_HD void imtlg(const S* g, int t, int sweeps, S* w, S* ws) {
  int n = t + t % 2;
  S* m = ws;
  S* vec = m + n * n;
  S* work = vec + n * n;
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j)
      m[i * n + j] = i < t && j < t ? S(0.5) * (g[i * t + j] + g[j * t + i]) : S(0);
  jacobi_eigh(m, vec, n, sweeps, work);
  S sigmax = S(0);
  for (int i = 0; i < t; ++i) sigmax = smax(sigmax, S(fabs(m[i * n + i])));
  S* inv_d = work;  // inv_k * (vec^T d)_k
  for (int kk = 0; kk < t; ++kk) {
    S lam = m[kk * n + kk];
    bool keep = fabs(lam) > S(t) * S(Eps<double>::value) * sigmax;
    S acc = S(0);
    for (int i = 0; i < t; ++i) acc += vec[i * n + kk] * sqrt(smax(g[i * t + i], S(0)));
    inv_d[kk] = keep ? (S(1) / lam) * acc : S(0);
  }
  S sum = S(0);
  for (int i = 0; i < t; ++i) {
    S acc = S(0);
    for (int kk = 0; kk < t; ++kk) acc += vec[i * n + kk] * inv_d[kk];
    w[i] = acc;
    sum += acc;
  }
  bool small = fabs(sum) < S(1e-12);
  for (int i = 0; i < t; ++i) w[i] = small ? S(0) : w[i] / sum;
}

// Aligned-MTL: w = sqrt(scale) V diag(lam^-1/2) V^T p over the eigenpairs above max(lam) T eps_dtype; p if none.
template <typename S>
FASTPALS_HD void alignedmtl(const S* g, const S* pref, int t, int sweeps, int scale_mode, S eps_dtype, S* w,
                            S* ws) {
  int n = t + t % 2;
  S* m = ws;
  S* vec = m + n * n;
  S* work = vec + n * n;
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j)
      m[i * n + j] = i < t && j < t ? (i <= j ? g[i * t + j] : g[j * t + i]) : S(0);
  jacobi_eigh(m, vec, n, sweeps, work);
  S lmax = m[0];
  for (int i = 1; i < t; ++i) lmax = smax(lmax, m[i * n + i]);
  S tol = lmax * S(t) * eps_dtype;
  int rank = 0;
  S lmin = S(INFINITY), lsum = S(0);
  for (int i = 0; i < t; ++i) {
    S lam = m[i * n + i];
    if (lam > tol) {
      ++rank;
      lmin = smin(lmin, lam);
      lsum += lam;
    }
  }
  if (rank == 0) {
    for (int i = 0; i < t; ++i) w[i] = pref[i];
    return;
  }
  S scale;
  if (scale_mode == 0) {
    scale = lmin;
  } else if (scale_mode == 2) {
    scale = lsum / S(rank);
  } else {  // lower median of the kept eigenvalues: the ((rank - 1) / 2)-th smallest
    int target = (rank - 1) / 2;
    scale = lmin;
    for (int i = 0; i < t; ++i) {
      S lam = m[i * n + i];
      if (!(lam > tol)) continue;
      int below = 0, equal_before = 0;
      for (int j = 0; j < t; ++j) {
        S other = m[j * n + j];
        if (!(other > tol)) continue;
        if (other < lam) ++below;
        else if (other == lam && j < i) ++equal_before;
      }
      if (below + equal_before == target) scale = lam;
    }
  }
  S root = sqrt(scale);
  S* proj = work;  // inv_sqrt_k * (V^T p)_k
  for (int kk = 0; kk < t; ++kk) {
    S lam = m[kk * n + kk];
    bool keep = lam > tol;
    S acc = S(0);
    for (int i = 0; i < t; ++i) acc += vec[i * n + kk] * pref[i];
    proj[kk] = keep ? (S(1) / sqrt(lam)) * acc : S(0);
  }
  for (int i = 0; i < t; ++i) {
    S acc = S(0);
    for (int kk = 0; kk < t; ++kk) acc += vec[i * n + kk] * proj[kk];
    w[i] = root * acc;
  }
}

// UPGrad (rows = T: each task's preference-scaled row) and DualProj (one row: the preference vector): weights of
// the projections onto the dual cone, argmin_{v >= u} v^T G' v, G' = G / tr(G) (0 below norm_eps) + reg_eps I.
template <typename S>
FASTPALS_HD void dual_cone(const S* g, const S* pref, int t, bool all_rows, S norm_eps, S reg_eps, int iters,
                           S* w, S* ws) {
  S* gr = ws;            // t x t
  S* b = gr + t * t;     // t
  S* x = b + t;          // t
  S* work = x + t;       // qp_workspace(t)
  S tr = S(0);
  for (int i = 0; i < t; ++i) tr += S(0.5) * (g[i * t + i] + g[i * t + i]);
  bool small = tr < norm_eps;
  S qmax = S(0);
  for (int i = 0; i < t; ++i)
    for (int j = 0; j < t; ++j) {
      S sym = S(0.5) * (g[i * t + j] + g[j * t + i]);
      gr[i * t + j] = (small ? S(0) : sym / tr) + (i == j ? reg_eps : S(0));
    }
  for (int i = 0; i < t; ++i) qmax = smax(qmax, gr[i * t + i]);
  S thresh = S(1e-13) * smax(qmax, S(Eps<S>::tiny));
  for (int i = 0; i < t; ++i) w[i] = pref[i];
  int rows = all_rows ? t : 1;
  for (int r = 0; r < rows; ++r) {
    for (int j = 0; j < t; ++j) {
      if (all_rows) {
        b[j] = pref[r] * gr[r * t + j];
      } else {
        S acc = S(0);
        for (int i = 0; i < t; ++i) acc += pref[i] * gr[i * t + j];
        b[j] = acc;
      }
    }
    nonneg_qp(gr, b, t, iters, thresh, x, work);
    for (int j = 0; j < t; ++j) w[j] += x[j];
  }
}

// GEM: w = a + v, v = argmin_{v >= 0, v = 0 off the constrained rows} 1/2 v^T (G + ridge max(diag G) I) v + v^T G a.
template <typename S>
FASTPALS_HD void gem(const S* g, const S* a, const S* mask, int t, S tol, S ridge, int iters, S* w, S* ws) {
  S* q = ws;
  S* b = q + t * t;
  S* x = b + t;
  S* work = x + t;
  S scale = S(0);
  for (int i = 0; i < t; ++i) scale = smax(scale, S(0.5) * (g[i * t + i] + g[i * t + i]));
  scale = smax(scale, S(Eps<S>::tiny));
  for (int i = 0; i < t; ++i) {
    S acc = S(0);
    for (int j = 0; j < t; ++j) {
      S sym = S(0.5) * (g[i * t + j] + g[j * t + i]);
      bool both = mask[i] != S(0) && mask[j] != S(0);
      q[i * t + j] = both ? sym + (i == j ? ridge * scale : S(0)) : (i == j ? S(1) : S(0));
      acc += sym * a[j];
    }
    b[i] = mask[i] != S(0) ? acc : S(0);
  }
  nonneg_qp(q, b, t, iters, tol * scale, x, work);
  for (int i = 0; i < t; ++i) w[i] = a[i] + x[i];
}

// MGDA: Frank-Wolfe on the simplex from 1 / T, stopping after the first step smaller than epsilon.
template <typename S>
FASTPALS_HD void mgda(const S* g, int t, S epsilon, int max_iters, S* w, S* ws) {
  S* ga = ws;
  for (int i = 0; i < t; ++i) w[i] = S(1) / S(t);
  for (int it = 0; it < max_iters; ++it) {
    int k = 0;
    for (int i = 0; i < t; ++i) {
      S acc = S(0);
      for (int j = 0; j < t; ++j) acc += g[i * t + j] * w[j];
      ga[i] = acc;
      if (acc < ga[k]) k = i;
    }
    S a = S(0), b = S(0);
    for (int i = 0; i < t; ++i) {
      a += w[i] * g[i * t + k];
      b += w[i] * ga[i];
    }
    S c = g[k * t + k];
    S den = b + c - S(2) * a;
    S gamma = c <= a ? S(1) : (b <= a ? S(0) : (b - a) / (den > S(0) ? den : S(1)));
    for (int i = 0; i < t; ++i) w[i] = (S(1) - gamma) * w[i] + (i == k ? gamma : S(0));
    if (gamma < epsilon) break;
  }
}

// sum_i psi(x_i), psi = log (alpha = 1) or alpha / (alpha - 1) x^(1 - 1/alpha)
template <typename S>
FASTPALS_HD S alpha_fair_psi(const S* x, int t, S alpha) {
  S psi = S(0);
  for (int j = 0; j < t; ++j)
    psi += alpha == S(1) ? log(x[j]) : (alpha / (alpha - S(1))) * pow(x[j], S(1) - S(1) / alpha);
  return psi;
}

FASTPALS_HD inline int64_t alpha_fair_workspace(int t) { return 2 * int64_t(t) * t + 4 * int64_t(t); }

// The positive root of G x = x^(-1/alpha) by damped Newton on G / tr(G): exactly max_iter steps, each taking the
// first of the step sizes 2^-k, k < 40, that keeps x positive and satisfies Armijo's rule (none: x is kept);
// zeros when tr(G) <= 0. As weights_solved._alpha_fair_solve.
template <typename S>
FASTPALS_HD void alpha_fair(const S* g, int t, S alpha, int max_iter, S* x, S* ws) {
  S* gn = ws;
  S* hess = gn + t * t;
  S* grad = hess + t * t;
  S* d = grad + t;
  S* cand = d + t;
  S trace = S(0);
  for (int i = 0; i < t; ++i) trace += g[i * t + i];
  S tr = smax(trace, S(sizeof(S) == sizeof(double) ? 1e-300 : 1e-37));
  S total = S(0);
  for (int i = 0; i < t * t; ++i) {
    gn[i] = g[i] / tr;
    total += gn[i];
  }
  const S p = S(-1) / alpha;
  S s = smax(total / S(t * t), S(1e-6));
  S x0 = pow(s, -alpha / (alpha + S(1)));
  for (int i = 0; i < t; ++i) x[i] = x0;
  for (int it = 0; it < max_iter; ++it) {
    for (int i = 0; i < t; ++i) {
      S acc = S(0);
      for (int j = 0; j < t; ++j) acc += gn[i * t + j] * x[j];
      grad[i] = acc - pow(x[i], p);
      d[i] = -grad[i];
      for (int j = 0; j < t; ++j) hess[i * t + j] = gn[i * t + j] + (i == j ? -p * pow(x[i], p - S(1)) : S(0));
    }
    lu_solve(hess, d, t);
    // the objective 1/2 x^T gn x - psi(x) along x + step d: the quadratic from x^T gn x, x^T gn d, d^T gn d
    S slope = S(0), xgx = S(0), xgd = S(0), dgd = S(0);
    for (int i = 0; i < t; ++i) {
      S gx = S(0), gd = S(0);
      for (int j = 0; j < t; ++j) {
        gx += gn[i * t + j] * x[j];
        gd += gn[i * t + j] * d[j];
      }
      slope += grad[i] * d[i];
      xgx += x[i] * gx;
      xgd += x[i] * gd;
      dgd += d[i] * gd;
    }
    S f0 = S(0.5) * xgx - alpha_fair_psi(x, t, alpha);
    S step = S(1);
    for (int k = 0; k < 40; ++k, step *= S(0.5)) {
      bool pos = true;
      for (int i = 0; i < t; ++i) {
        cand[i] = x[i] + step * d[i];
        pos = pos && cand[i] > S(0);
      }
      if (!pos) continue;
      S fc = S(0.5) * (xgx + S(2) * step * xgd + step * step * dgd) - alpha_fair_psi(cand, t, alpha);
      if (fc <= f0 + S(1e-4) * step * slope && finite(fc)) {
        for (int i = 0; i < t; ++i) x[i] = cand[i];
        break;
      }
    }
  }
  S back = pow(tr, -alpha / (alpha + S(1)));
  for (int i = 0; i < t; ++i) x[i] = trace <= S(0) ? S(0) : x[i] * back;
}

// GradVac (whole-model variant) as weights: for each task i, against the other tasks j in the order of row i of
// `orders`, g_i^PC += |g_i^PC| (hat sqrt(1 - phi^2) - phi sqrt(1 - hat^2)) / (|g_j| sqrt(1 - hat^2) + eps) g_j when
// the cosine phi of g_i^PC and g_j is below the target hat = phi_hat[i, j]; phi_hat[i, j] <- (1 - beta) hat +
// beta phi. g_i^PC is tracked as coefficients of the g_k and its products with them (updated by one row of G per
// projection); w = the coefficients' column sums. The rows are independent, so they run one after the other.
template <typename S>
FASTPALS_HD void gradvac(const S* g, const S* orders, int t, S beta, S eps, S* phi_hat, S* w, S* ws) {
  S* coef = ws;      // t: row i of the coefficients
  S* cg = coef + t;  // t: coef @ G
  S* norm = cg + t;  // t: |g_k|
  for (int k = 0; k < t; ++k) {
    norm[k] = sqrt(smax(g[k * t + k], S(0)));
    w[k] = S(0);
  }
  for (int i = 0; i < t; ++i) {
    for (int k = 0; k < t; ++k) {
      coef[k] = k == i ? S(1) : S(0);
      cg[k] = g[i * t + k];
    }
    for (int step = 0; step < t - 1; ++step) {
      int j = int(orders[i * (t - 1) + step]);
      S sq = S(0);
      for (int k = 0; k < t; ++k) sq += cg[k] * coef[k];
      S norm_i = sqrt(smax(sq, S(0)));
      S phi = cg[j] / (norm_i * norm[j] + eps);
      S hat = phi_hat[i * t + j];
      S s_phi = sqrt(smax(S(1) - phi * phi, S(0)));
      S s_hat = sqrt(smax(S(1) - hat * hat, S(0)));
      S delta = phi < hat ? norm_i * (hat * s_phi - phi * s_hat) / (norm[j] * s_hat + eps) : S(0);
      if (delta != S(0)) {
        coef[j] += delta;
        for (int k = 0; k < t; ++k) cg[k] += delta * g[j * t + k];
      }
      phi_hat[i * t + j] = (S(1) - beta) * hat + beta * phi;
    }
    for (int k = 0; k < t; ++k) w[k] += coef[k];
  }
}

// PCGrad as weights: task i's gradient, tracked as coefficients of the g_k, is projected in the order of row i of
// `orders` onto the normal plane of each original g_j it conflicts with; w = the coefficients' column sums.
template <typename S>
FASTPALS_HD void pcgrad(const S* g, const S* orders, int t, S* w, S* coef) {
  for (int k = 0; k < t; ++k) w[k] = S(0);
  for (int i = 0; i < t; ++i) {
    for (int k = 0; k < t; ++k) coef[k] = k == i ? S(1) : S(0);
    for (int step = 0; step < t - 1; ++step) {
      int j = int(orders[i * (t - 1) + step]);
      S dot = S(0);
      for (int k = 0; k < t; ++k) dot += coef[k] * g[k * t + j];
      S d = g[j * t + j];
      if (dot < S(0) && d > S(0)) coef[j] -= dot / d;
    }
    for (int k = 0; k < t; ++k) w[k] += coef[k];
  }
}

// CAGrad's objective <b, x> + rho sqrt(x^T G x) over the non-zero entries of x (their indices go to nz, t
// elements; G symmetric: the strict lower triangle counted twice, four partial sums per row)
template <typename S>
FASTPALS_HD FASTPALS_NOINLINE S cagrad_objective(const S* g, const S* b, S rho, const S* x, int t, S* norm_out, S* nz) {
  int k = 0;
  S lin = S(0);
  for (int i = 0; i < t; ++i)
    if (x[i] != S(0)) {
      nz[k++] = S(i);
      lin += x[i] * b[i];
    }
  S diag = S(0), off = S(0);
  for (int a = 0; a < k; ++a) {
    const int i = int(nz[a]);
    const S* row = g + int64_t(i) * t;
    S acc[4] = {S(0), S(0), S(0), S(0)};
    int c = 0;
    for (; c + 4 <= a; c += 4)
      for (int u = 0; u < 4; ++u) {
        const int j = int(nz[c + u]);
        acc[u] += row[j] * x[j];
      }
    for (; c < a; ++c) acc[0] += row[int(nz[c])] * x[int(nz[c])];
    off += x[i] * ((acc[0] + acc[1]) + (acc[2] + acc[3]));
    diag += x[i] * x[i] * row[i];
  }
  S norm = sqrt(smax(diag + S(2) * off, S(0)));
  if (norm_out) *norm_out = norm;
  return lin + rho * norm;
}

// CAGrad's KKT point on the support `in` (1 or 0 per task): a = G_SS^-1 1, c = G_SS^-1 b_S (ridge 1e-12 scale),
// w = (lam a - c) / sqrt(disc) with lam the root of the quadratic; returns whether disc > 0 and sum(a) > 0.
// work: t * t + 2 t elements.
template <typename S>
FASTPALS_HD FASTPALS_NOINLINE bool cagrad_on_support(const S* g, const S* b, S rho, const S* in, int t, S scale, S* w, S* work) {
  S* sys = work;
  S* a = sys + t * t;
  S* c = a + t;
  int k = 0;
  for (int i = 0; i < t; ++i) k += in[i] != S(0);
  for (int pass = 0; pass < 2; ++pass) {
    S* rhs = pass == 0 ? a : c;
    int r = 0;
    for (int i = 0; i < t; ++i) {
      if (in[i] == S(0)) continue;
      int l = 0;
      for (int j = 0; j < t; ++j)
        if (in[j] != S(0)) sys[r * k + l++] = g[i * t + j] + (i == j ? S(1e-12) * scale : S(0));
      rhs[r++] = pass == 0 ? S(1) : b[i];
    }
    lu_solve(sys, rhs, k);
  }
  S big_a = S(0), big_b = S(0), big_c = S(0);
  for (int i = t - 1, r = k - 1; i >= 0; --i) {  // unpack in place, from the back
    if (in[i] != S(0)) {
      a[i] = a[r];
      c[i] = c[r];
      --r;
    } else {
      a[i] = S(0);
      c[i] = S(0);
    }
  }
  for (int i = 0; i < t; ++i) {
    big_a += a[i];
    big_b += c[i];
    big_c += c[i] * b[i];
  }
  S disc = big_b * big_b - big_a * (big_c - rho * rho);
  bool ok = disc > S(0) && big_a > S(0);
  S sd = sqrt(ok ? disc : S(1));
  S lam = (big_b + sd) / (ok ? big_a : S(1));
  for (int i = 0; i < t; ++i) w[i] = (lam * a[i] - c[i]) / sd;
  return ok;
}

// Euclidean projection of y onto the probability simplex: max(y - tau, 0), tau found by Michelot's method (drop
// the entries at or below the running threshold until none is); in: t scratch elements.
template <typename S>
FASTPALS_HD FASTPALS_NOINLINE void simplex_projection(const S* y, int t, S* x, S* in) {
  for (int i = 0; i < t; ++i) in[i] = S(1);
  S tau = S(0);
  for (bool changed = true; changed;) {
    S sum = S(0);
    int cnt = 0;
    for (int i = 0; i < t; ++i)
      if (in[i] != S(0)) {
        sum += y[i];
        ++cnt;
      }
    tau = (sum - S(1)) / S(cnt);
    changed = false;
    for (int i = 0; i < t; ++i)
      if (in[i] != S(0) && y[i] <= tau) {
        in[i] = S(0);
        changed = true;
      }
  }
  for (int i = 0; i < t; ++i) x[i] = smax(y[i] - tau, S(0));
}

FASTPALS_HD inline int64_t cagrad_workspace(int t) { return 2 * int64_t(t) * t + 12 * int64_t(t); }

// CAGrad (weights_solved.py cagrad_weights): w* = argmin over the simplex of <b, w> + rho |g_w| on G / trace(G),
// from every support (exact) or from projected-gradient steps and a primal active-set method; the vertices are
// candidates too. Returns 1/T + rho / |g_w*| w*, zeros when |g_w*| < norm_eps.
template <typename S>
FASTPALS_HD FASTPALS_NOINLINE void cagrad(const S* g0, int t, S c, S norm_eps, bool exact, int pgd_iters, int search_iters, S* w,
                        S* ws) {
  S* g = ws;               // t x t: the normalised Gram
  S* work = g + t * t;     // t x t + 2t: the support solves
  S* b = work + t * t + 2 * t;
  S* best = b + t;
  S* cand = best + t;
  S* grad = cand + t;
  S* in = grad + t;
  S* gw = in + t;
  S* sorted = gw + t;
  S* tmp = sorted + t;
  S tr = S(0);
  for (int i = 0; i < t; ++i) tr += g0[i * t + i];
  for (int i = 0; i < t; ++i)
    for (int j = 0; j < t; ++j) g[i * t + j] = tr < norm_eps ? S(0) : S(0.5) * (g0[i * t + j] + g0[j * t + i]) / tr;
  S scale = S(0);
  for (int i = 0; i < t; ++i) scale = smax(scale, g[i * t + i]);
  scale = smax(scale, Eps<S>::tiny);
  S uu = S(0);
  for (int i = 0; i < t; ++i) {
    S acc = S(0);
    for (int j = 0; j < t; ++j) acc += g[i * t + j];
    b[i] = acc / S(t);
    uu += b[i] / S(t);
  }
  S rho = c * sqrt(smax(uu, S(0)));
  bool have = false;
  S best_obj = S(0);
  if (exact) {
    for (int64_t code = 1; code < (int64_t(1) << t); ++code) {
      for (int i = 0; i < t; ++i) in[i] = (code >> i) & 1 ? S(1) : S(0);
      bool ok = cagrad_on_support(g, b, rho, in, t, scale, cand, work);
      S sum = S(0);
      for (int i = 0; i < t; ++i) {
        ok = ok && cand[i] >= S(-1e-9);
        cand[i] = smax(cand[i], S(0));
        sum += cand[i];
      }
      if (!ok) continue;
      for (int i = 0; i < t; ++i) cand[i] /= smax(sum, floor_of<S>(1e-300));
      S f = cagrad_objective(g, b, rho, cand, t, (S*)nullptr, sorted);
      if (!have || f < best_obj) {
        have = true;
        best_obj = f;
        for (int i = 0; i < t; ++i) best[i] = cand[i];
      }
    }
  } else {
    // projected (sub)gradient steps from 1/T, 40 step sizes 2^-k and the current point tried each time
    S* x = best;
    for (int i = 0; i < t; ++i) x[i] = S(1) / S(t);
    for (int it = 0; it < pgd_iters; ++it) {
      S q = S(0);
      for (int i = 0; i < t; ++i) {
        S acc = S(0);
        for (int j = 0; j < t; ++j) acc += g[i * t + j] * x[j];
        gw[i] = acc;
        q += x[i] * acc;
      }
      S norm = smax(sqrt(smax(q, S(0))), floor_of<S>(1e-150));
      S mean = S(0);
      for (int i = 0; i < t; ++i) {
        grad[i] = b[i] + rho * gw[i] / norm;
        mean += grad[i];
      }
      mean /= S(t);
      S gmax = S(0);
      for (int i = 0; i < t; ++i) {
        grad[i] -= mean;
        gmax = smax(gmax, fabs(grad[i]));
      }
      gmax = smax(gmax, floor_of<S>(1e-300));
      S fbest = S(0);
      int kbest = -1;
      S step = S(1);
      for (int k = 0; k <= 40; ++k) {
        S s = k == 40 ? S(0) : step;
        for (int i = 0; i < t; ++i) tmp[i] = x[i] - s / gmax * grad[i];
        simplex_projection(tmp, t, cand, sorted);
        S f = cagrad_objective(g, b, rho, cand, t, (S*)nullptr, sorted);
        if (kbest < 0 || f < fbest) {
          fbest = f;
          kbest = k;
          for (int i = 0; i < t; ++i) in[i] = cand[i];
        }
        step *= S(0.5);
      }
      if (kbest == 40) break;  // the current point is kept: a fixed point, the next iterations keep it too
      for (int i = 0; i < t; ++i) x[i] = in[i];
    }
    // primal active set from the support of x; best point met kept in `best`
    S best_f = cagrad_objective(g, b, rho, x, t, (S*)nullptr, sorted);
    S xmax = x[0];
    int xarg = 0;
    for (int i = 1; i < t; ++i)
      if (x[i] > xmax) {
        xmax = x[i];
        xarg = i;
      }
    for (int i = 0; i < t; ++i) in[i] = (x[i] > S(1e-6) * xmax || i == xarg) ? S(1) : S(0);
    for (int it = 0; it < search_iters; ++it) {
      bool valid = cagrad_on_support(g, b, rho, in, t, scale, cand, work);
      bool any_neg = false;
      for (int i = 0; i < t; ++i) any_neg = any_neg || (in[i] != S(0) && cand[i] < S(0));
      bool feasible = valid && !any_neg;
      for (int i = 0; i < t; ++i) tmp[i] = smax(cand[i], S(0));
      S f = cagrad_objective(g, b, rho, tmp, t, (S*)nullptr, sorted);
      if (feasible && f < best_f) {
        best_f = f;
        for (int i = 0; i < t; ++i) best[i] = tmp[i];
      }
      S q = S(0);
      for (int i = 0; i < t; ++i) {
        S acc = S(0);
        for (int j = 0; j < t; ++j) acc += g[i * t + j] * cand[j];
        gw[i] = acc;
        q += cand[i] * acc;
      }
      S norm = sqrt(smax(q, floor_of<S>(1e-300)));
      S mu = S(0), gmax = S(0);
      for (int i = 0; i < t; ++i) {
        grad[i] = b[i] + rho * gw[i] / norm;
        mu += grad[i] * cand[i];
        gmax = smax(gmax, fabs(grad[i]));
      }
      S tol = S(1e-12) * (gmax + floor_of<S>(1e-300));
      int most = -1, smallest = -1, largest = 0;
      for (int i = 0; i < t; ++i) {
        if (in[i] == S(0) && grad[i] < mu - tol && (most < 0 || grad[i] < grad[most])) most = i;
        if (in[i] != S(0) && (smallest < 0 || best[i] < best[smallest])) smallest = i;
        if (best[i] > best[largest]) largest = i;
      }
      if (feasible && most < 0) break;  // optimal: the support freezes
      if (any_neg || !valid) {
        int left = 0;
        for (int i = 0; i < t; ++i) {
          bool keep = in[i] != S(0) && (valid ? !(cand[i] < S(0)) : i != smallest);
          in[i] = keep ? S(1) : S(0);
          left += keep;
        }
        if (left == 0) in[largest] = S(1);
      } else if (most >= 0) {
        in[most] = S(1);
      }
    }
    have = true;
    best_obj = cagrad_objective(g, b, rho, best, t, (S*)nullptr, sorted);
  }
  // the vertices are candidates too; the first minimum wins
  S norm_best = S(0);
  if (have) cagrad_objective(g, b, rho, best, t, &norm_best, sorted);
  for (int v = 0; v < t; ++v) {
    S f = b[v] + rho * sqrt(smax(g[v * t + v], S(0)));
    if (!have || f < best_obj) {
      have = true;
      best_obj = f;
      for (int i = 0; i < t; ++i) best[i] = i == v ? S(1) : S(0);
      norm_best = sqrt(smax(g[v * t + v], S(0)));
    }
  }
  bool small = norm_best < norm_eps;
  for (int i = 0; i < t; ++i) w[i] = small ? S(0) : S(1) / S(t) + rho / norm_best * best[i];
}

FASTPALS_HD inline int64_t pcd_workspace(int t) { return 2 * int64_t(t) * t + 2 * int64_t(t) + qp_workspace(t); }

// PCD (weights_extra.py pcd_weights): on G~ = G s s^T, the multipliers mu >= 0 of the secondary tasks' progress
// constraints from the dual non-negative QP (ridge 1e-12 max diag; mu = 0 where the constraints are infeasible),
// w = [1, mu] s sqrt(G_00 / d^T d); zeros when
// G_00 = 0 or d^T d <= precision (sum |w_i| |g~_i|)^2.
template <typename S>
FASTPALS_HD FASTPALS_NOINLINE void pcd(const S* g, const S* s, const S* taus, int t, S precision, S* w, S* ws) {
  const int m = t - 1;
  S* ng = ws;           // t x t
  S* q = ng + t * t;    // m x m
  S* lin = q + t * t;   // m
  S* mu = lin + t;      // m
  S* work = mu + t;     // qp_workspace(m)
  for (int i = 0; i < t; ++i)
    for (int j = 0; j < t; ++j) ng[i * t + j] = g[i * t + j] * s[i] * s[j];
  w[0] = S(1);
  if (m > 0) {
    S top = S(0);
    for (int i = 1; i < t; ++i) top = smax(top, ng[i * t + i]);
    for (int i = 0; i < m; ++i) {
      for (int j = 0; j < m; ++j) q[i * m + j] = ng[(i + 1) * t + j + 1] + (i == j ? S(1e-12) * top : S(0));
      lin[i] = ng[(i + 1) * t] - taus[i] * ng[(i + 1) * t + i + 1];
    }
    S qmax = S(0);
    for (int i = 0; i < m; ++i) qmax = smax(qmax, q[i * m + i]);
    const int iters = 3 * m + 10 < 40 ? 3 * m + 10 : 40;  // solvers.py QP_MAX_ITER
    nonneg_qp(q, lin, m, iters, S(1e-13) * smax(qmax, Eps<S>::tiny), mu, work);
    // infeasible constraints (an unbounded dual, bounded only by the ridge): a constraint still violated by
    // more than 1e-6 max diag G~ without the ridge (the ridge alone shifts
    // it by 1e-12 max diag mu_j); then d = g~_0
    bool infeasible = false;
    for (int i = 0; i < m; ++i) {
      S slack = lin[i];
      for (int j = 0; j < m; ++j) slack += ng[(i + 1) * t + j + 1] * mu[j];
      infeasible = infeasible || slack < S(-1e-6) * smax(top, ng[0]);
    }
    for (int i = 0; i < m; ++i) w[i + 1] = infeasible ? S(0) : mu[i];
  }
  S dsq = S(0), mag = S(0);
  for (int i = 0; i < t; ++i) {
    S acc = S(0);
    for (int j = 0; j < t; ++j) acc += ng[i * t + j] * w[j];
    dsq += w[i] * acc;
    mag += fabs(w[i]) * sqrt(smax(ng[i * t + i], S(0)));
  }
  const bool keep = g[0] > S(0) && dsq > precision * mag * mag;
  const S factor = keep ? sqrt(g[0] / dsq) : S(0);
  for (int i = 0; i < t; ++i) w[i] = keep ? w[i] * s[i] * factor : S(0);
}

// MoDo (weights_extra.py modo_weights): lambda <- Proj_simplex(lambda - gamma (G lambda + rho lambda)); w = lambda.
template <typename S>
FASTPALS_HD FASTPALS_NOINLINE void modo(const S* g, int t, S gamma, S rho, S* lam, S* w, S* ws) {
  for (int i = 0; i < t; ++i) {
    S acc = S(0);
    for (int j = 0; j < t; ++j) acc += g[i * t + j] * lam[j];
    ws[i] = lam[i] - gamma * (acc + rho * lam[i]);
  }
  simplex_projection(ws, t, w, ws + t);
  for (int i = 0; i < t; ++i) lam[i] = w[i];
}

// SDMGrad (weights_extra.py sdmgrad_weights): n_iter momentum steps on the simplex for 1/2 |J^T (w + lambda_ p)|^2
// on G / (mean_i sqrt(G_ii))^2 from the stored w; returns (w + lambda_ p) / (1 + lambda_).
template <typename S>
FASTPALS_HD FASTPALS_NOINLINE void sdmgrad(const S* g, const S* p, int t, S lr, S momentum, int n_iter,
                                           S lambda, S* state, S* w, S* ws) {
  S* velocity = ws;
  S* y = velocity + t;
  S* scratch = y + t;
  S scale = S(0);
  for (int i = 0; i < t; ++i) scale += sqrt(smax(g[i * t + i], S(0)));
  scale /= S(t);
  const S denom = scale * scale + S(1e-8);
  for (int step = 0; step < n_iter; ++step) {
    for (int i = 0; i < t; ++i) {
      S acc = S(0);
      for (int j = 0; j < t; ++j) acc += g[i * t + j] / denom * (state[j] + lambda * p[j]);
      velocity[i] = step == 0 ? acc : momentum * velocity[i] + acc;
      y[i] = state[i] - lr * velocity[i];
    }
    simplex_projection(y, t, state, scratch);
  }
  for (int i = 0; i < t; ++i) w[i] = (state[i] + lambda * p[i]) / (S(1) + lambda);
}

// (Multi-)Krum (weights_extra.py krum_weights): score_i = the sum of the distances |g_i - g_j| (from G) to its
// t - n_byzantine - 2 nearest others; the n_selected lowest scores (the lower index first on ties) get
// 1 / n_selected.
template <typename S>
FASTPALS_HD FASTPALS_NOINLINE void krum(const S* g, int t, int n_byzantine, int n_selected, S* w, S* ws) {
  S* row = ws;
  S* score = row + t;
  const int k = t - n_byzantine - 1;
  for (int i = 0; i < t; ++i) {
    for (int j = 0; j < t; ++j) row[j] = sqrt(smax(g[j * t + j] + g[i * t + i] - S(2) * g[i * t + j], S(0)));
    for (int a = 1; a < t; ++a) {  // insertion sort, ascending
      S v = row[a];
      int b = a - 1;
      while (b >= 0 && row[b] > v) {
        row[b + 1] = row[b];
        --b;
      }
      row[b + 1] = v;
    }
    S sum = S(0);
    for (int a = 1; a < k; ++a) sum += row[a];
    score[i] = sum;
    w[i] = S(0);
  }
  for (int n = 0; n < n_selected; ++n) {
    int best = -1;
    for (int i = 0; i < t; ++i)
      if (w[i] == S(0) && (best < 0 || score[i] < score[best])) best = i;
    w[best] = S(1) / S(n_selected);
  }
}

FASTPALS_HD inline int64_t vec_size(int method, int t) {
  return method == GRADVAC || method == PCGRAD ? int64_t(t) * (t - 1) : 2 * int64_t(t);
}

FASTPALS_HD inline int64_t solve_workspace_size(int method, int t) {
  switch (method) {
    case IMTLG:
    case ALIGNEDMTL:
      return jacobi_workspace(t);
    case UPGRAD:
    case DUALPROJ:
    case GEM:
      return int64_t(t) * t + 2 * int64_t(t) + qp_workspace(t);
    case MGDA:
      return t;
    case ALPHA_FAIR:
      return alpha_fair_workspace(t);
    case GRADVAC:
      return 3 * int64_t(t);
    case PCGRAD:
      return t;
    case CAGRAD:
      return cagrad_workspace(t);
    case PCD:
      return pcd_workspace(t);
    case MODO:
      return 2 * int64_t(t);
    case SDMGRAD:
      return 3 * int64_t(t);
    case KRUM:
      return 2 * int64_t(t);
    default:
      return 0;
  }
}

// The one entry: weights w [T] of `method` for the Gram g [T, T]; vec, params as documented above; ws holds
// solve_workspace_size(method, T) elements; state: GRADVAC's targets (else unused, may be null).
template <typename S>
FASTPALS_HD void solve_weights(int method, const S* g, int t, const S* vec, const S* params, S* w, S* ws,
                               S* state) {
  switch (method) {
    case IMTLG:
      imtlg(g, t, int(params[0]), w, ws);
      break;
    case ALIGNEDMTL:
      alignedmtl(g, vec, t, int(params[0]), int(params[1]), params[2], w, ws);
      break;
    case UPGRAD:
    case DUALPROJ:
      dual_cone(g, vec, t, method == UPGRAD, params[0], params[1], int(params[2]), w, ws);
      break;
    case GEM:
      gem(g, vec, vec + t, t, params[0], params[1], int(params[2]), w, ws);
      break;
    case MGDA:
      mgda(g, t, params[0], int(params[1]), w, ws);
      break;
    case ALPHA_FAIR:
      alpha_fair(g, t, params[0], int(params[1]), w, ws);
      break;
    case GRADVAC:
      gradvac(g, vec, t, params[0], params[1], state, w, ws);
      break;
    case PCGRAD:
      pcgrad(g, vec, t, w, ws);
      break;
    case CAGRAD:
      cagrad(g, t, params[0], params[1], params[2] != S(0), int(vec[0]), int(vec[1]), w, ws);
      break;
    case SUM:
    case MEAN:
      for (int i = 0; i < t; ++i) w[i] = method == SUM ? S(1) : S(1) / S(t);
      break;
    case CONSTANT:
      for (int i = 0; i < t; ++i) w[i] = vec[i];
      break;
    case PCD:
      pcd(g, vec, vec + t, t, params[0], w, ws);
      break;
    case MODO:
      modo(g, t, params[0], params[1], state, w, ws);
      break;
    case SDMGRAD:
      sdmgrad(g, vec, t, params[0], params[1], int(params[2]), vec[t], state, w, ws);
      break;
    case KRUM:
      krum(g, t, int(params[0]), int(params[1]), w, ws);
      break;
    case RANDOM: {
      S top = vec[0];
      for (int i = 1; i < t; ++i) top = smax(top, vec[i]);
      S sum = S(0);
      for (int i = 0; i < t; ++i) {
        w[i] = exp(vec[i] - top);
        sum += w[i];
      }
      for (int i = 0; i < t; ++i) w[i] /= sum;
      break;
    }
    default:
      break;
  }
}

}  // namespace fastpals
