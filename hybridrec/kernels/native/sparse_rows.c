/* hybridrec's CPU sparse backward: per-id gradients deduplicated by hashing, and the row
 * optimizers' updates applied in place, one pass over each touched row.
 *
 * Plain C with no torch headers: hybridrec/kernels/native.py compiles it at install (or on
 * first use) and calls it through ctypes with the tensors' data pointers. Every function is
 * single-threaded and deterministic.
 *
 * Rounding is torch's CPU ops', so results are bit-identical to the torch path: the file is
 * built with -ffp-contract=off (each product and sum rounded separately, as torch's separate
 * ops), the weight step is one explicit fmaf (torch's add/sub with alpha), sqrtf and division
 * are IEEE. Legend: N ids, B bags, D width, U distinct rows, R weight rows.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PREFETCH_AHEAD 8 /* rows: enough misses in flight to hide most of the latency */

typedef struct {
    int64_t key; /* a row, or -1: empty */
    int64_t slot;
} entry_t;

static inline void prefetch_row(const float *row, int64_t d) {
    for (int64_t b = 0; b < d * (int64_t)sizeof(float); b += 64)
        __builtin_prefetch((const char *)row + b, 1, 1);
}

/* uniq[U] (first-occurrence order) and out[U, D]: out[s] is the sum, in id order, of
 * grad[bags[i]] * scale_i over the ids i of row uniq[s], starting from 0 (as index_add_ into
 * zeros). scale_i is scale[i] if scale is given, else scale_all (1: no product is formed).
 * uniq and out need room for N rows. Returns U, or -1 if scratch memory is not available. */
int64_t hr_dedupe(const int64_t *rows, const int64_t *bags, const float *scale, float scale_all,
                  const float *grad, int64_t n, int64_t d, int64_t *uniq, float *out) {
    int bits = 4;
    while ((INT64_C(1) << bits) < 2 * n) bits++;
    const int64_t size = INT64_C(1) << bits, mask = size - 1;
    entry_t *table = malloc((size_t)size * sizeof(entry_t));
    if (!table) return -1;
    memset(table, 0xff, (size_t)size * sizeof(entry_t));
    const int scaled = scale != NULL || scale_all != 1.0f;
    int64_t u = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t r = rows[i];
        uint64_t h = ((uint64_t)r * UINT64_C(0x9E3779B97F4A7C15)) >> (64 - bits);
        while (table[h].key != r && table[h].key != -1) h = (h + 1) & mask;
        const float *g = grad + bags[i] * d;
        float *o;
        if (table[h].key == -1) {
            table[h].key = r;
            table[h].slot = u;
            uniq[u] = r;
            o = out + u * d;
            u++;
            for (int64_t j = 0; j < d; j++) o[j] = 0.0f;
        } else {
            o = out + table[h].slot * d;
        }
        if (scaled) {
            const float s = scale ? scale[i] : scale_all;
            for (int64_t j = 0; j < d; j++) {
                const float p = g[j] * s;
                o[j] = o[j] + p;
            }
        } else {
            for (int64_t j = 0; j < d; j++) o[j] = o[j] + g[j];
        }
    }
    free(table);
    return u;
}

/* Weight decay, applied by every row update below in the same way (hybridrec.kernels.rows):
 * kind NO_DECAY, L2 (g <- g + w * wd, before the maths) or DECOUPLED (w <- w * (1 - lr * wd),
 * then the maths' step); wd is rows[s] for row s where a per-row decay is given (a fused
 * group of tables with different decays), else wd; lr is the optimizer's learning rate. */
enum { NO_DECAY = 0, L2 = 1, DECOUPLED = 2 };

typedef struct {
    int64_t kind;
    float wd, lr;
    const float *rows;
} decay_t;

/* Row s's decay: its wd, and keep = 1 - lr * wd (each rounded, as torch's separate ops). */
static inline float row_wd(const decay_t *dc, int64_t s) { return dc->rows ? dc->rows[s] : dc->wd; }
static inline float row_keep(const decay_t *dc, float wd) { return 1.0f - dc->lr * wd; }

/* The gradient the maths see and the weight they step from, for one element. */
static inline void decay_element(int64_t kind, float wd, float keep, float *gj, float *wj) {
    if (kind == L2) {
        const float p = *wj * wd;
        *gj = *gj + p;
    } else if (kind == DECOUPLED) {
        *wj = *wj * keep;
    }
}

/* The row optimizers' updates, one per optimizer, all with one signature (hybridrec's
 * kernels/native.py calls any of them by name, as an optimizer's `native` names it):
 *   w [R, d] the weight; state[k] the optimizer's k-th state tensor, in the order of its
 *   state_spec ([R] row-wise or [R, d] element-wise); idx [u] the rows to update (distinct);
 *   g [u, d] their gradients; stat [u] each row's mean(g^2) over its full width (of the
 *   gradient the maths see: with L2 decay, g + w * wd), or NULL where the optimizer needs
 *   none; h the optimizer's scalars (its `scalars(step)`); the decay: kind, wd, lr and
 *   wd_rows [u] or NULL (see decay_t).
 * Each reads and writes each touched row once. */
#define ROW_UPDATE_ARGS                                                                        \
    float *w, float *const *state, const int64_t *idx, const float *g, const float *stat,      \
        int64_t u, int64_t d, const float *h, int64_t decay_kind, float wd_all, float decay_lr, \
        const float *wd_rows
#define DECAY_OF_ARGS {decay_kind, wd_all, decay_lr, wd_rows}

/* SGD, h = {lr}: w[idx[s]] -= lr * g[s] (fmaf(g, -lr, w), torch's sub_(g, alpha=lr)). */
void hr_sgd(ROW_UPDATE_ARGS) {
    (void)state;
    (void)stat;
    const decay_t dc = DECAY_OF_ARGS;
    const float lr = h[0];
    for (int64_t s = 0; s < u; s++) {
        if (s + PREFETCH_AHEAD < u) prefetch_row(w + idx[s + PREFETCH_AHEAD] * d, d);
        float *wr = w + idx[s] * d;
        const float *gr = g + s * d;
        if (dc.kind == NO_DECAY) {
            for (int64_t j = 0; j < d; j++) wr[j] = fmaf(gr[j], -lr, wr[j]);
            continue;
        }
        const float wd = row_wd(&dc, s), keep = row_keep(&dc, wd);
        for (int64_t j = 0; j < d; j++) {
            float gj = gr[j], wj = wr[j];
            decay_element(dc.kind, wd, keep, &gj, &wj);
            wr[j] = fmaf(gj, -lr, wj);
        }
    }
}

/* Row-wise Adagrad, state {acc [R]}, h = {lr, eps}: acc[r] += stat[s];
 * w[r] -= lr * g / (sqrt(acc[r]) + eps). */
void hr_rowwise_adagrad(ROW_UPDATE_ARGS) {
    const decay_t dc = DECAY_OF_ARGS;
    float *acc = state[0];
    const float lr = h[0], eps = h[1];
    for (int64_t s = 0; s < u; s++) {
        if (s + PREFETCH_AHEAD < u) {
            prefetch_row(w + idx[s + PREFETCH_AHEAD] * d, d);
            __builtin_prefetch(acc + idx[s + PREFETCH_AHEAD], 1, 1);
        }
        const int64_t r = idx[s];
        const float sum = acc[r] + stat[s];
        acc[r] = sum;
        const float den = sqrtf(sum) + eps;
        float *wr = w + r * d;
        const float *gr = g + s * d;
        if (dc.kind == NO_DECAY) {
            for (int64_t j = 0; j < d; j++) wr[j] = fmaf(gr[j] / den, -lr, wr[j]);
            continue;
        }
        const float wd = row_wd(&dc, s), keep = row_keep(&dc, wd);
        for (int64_t j = 0; j < d; j++) {
            float gj = gr[j], wj = wr[j];
            decay_element(dc.kind, wd, keep, &gj, &wj);
            wr[j] = fmaf(gj / den, -lr, wj);
        }
    }
}

/* Element-wise Adagrad (torch.optim.Adagrad), state {acc [R, d]}, h = {lr, eps}:
 * acc += g * g (one fmaf, as torch's addcmul_); w -= lr * g / (sqrt(acc) + eps). */
void hr_adagrad(ROW_UPDATE_ARGS) {
    (void)stat;
    const decay_t dc = DECAY_OF_ARGS;
    float *acc = state[0];
    const float lr = h[0], eps = h[1];
    for (int64_t s = 0; s < u; s++) {
        if (s + PREFETCH_AHEAD < u) {
            prefetch_row(w + idx[s + PREFETCH_AHEAD] * d, d);
            prefetch_row(acc + idx[s + PREFETCH_AHEAD] * d, d);
        }
        float *wr = w + idx[s] * d, *ar = acc + idx[s] * d;
        const float *gr = g + s * d;
        const float wd = dc.kind == NO_DECAY ? 0.0f : row_wd(&dc, s), keep = row_keep(&dc, wd);
        for (int64_t j = 0; j < d; j++) {
            float gj = gr[j], wj = wr[j];
            decay_element(dc.kind, wd, keep, &gj, &wj);
            const float sum = fmaf(gj, gj, ar[j]);
            ar[j] = sum;
            const float den = sqrtf(sum) + eps;
            wr[j] = fmaf(gj / den, -lr, wj);
        }
    }
}

/* Lazy Adam (torch.optim.SparseAdam's moments), state {m, v [R, d]}, h = {step, c1, c2, eps}:
 * m += (g - m) * c1; v += (g * g - v) * c2; w -= step * m / (sqrt(v) + eps), with
 * c1 = 1 - beta1, c2 = 1 - beta2 and step the bias-corrected step size. */
void hr_adam(ROW_UPDATE_ARGS) {
    (void)stat;
    const decay_t dc = DECAY_OF_ARGS;
    float *m = state[0], *v = state[1];
    const float step = h[0], c1 = h[1], c2 = h[2], eps = h[3];
    for (int64_t s = 0; s < u; s++) {
        if (s + PREFETCH_AHEAD < u) {
            const int64_t ahead = idx[s + PREFETCH_AHEAD] * d;
            prefetch_row(w + ahead, d);
            prefetch_row(m + ahead, d);
            prefetch_row(v + ahead, d);
        }
        const int64_t base = idx[s] * d;
        float *wr = w + base, *mr = m + base, *vr = v + base;
        const float *gr = g + s * d;
        const float wd = dc.kind == NO_DECAY ? 0.0f : row_wd(&dc, s), keep = row_keep(&dc, wd);
        for (int64_t j = 0; j < d; j++) {
            float gj = gr[j], wj = wr[j];
            decay_element(dc.kind, wd, keep, &gj, &wj);
            const float m0 = mr[j], v0 = vr[j];
            const float dm = (gj - m0) * c1;
            const float m1 = dm + m0;
            const float sq = gj * gj;
            const float dv = (sq - v0) * c2;
            const float v1 = dv + v0;
            mr[j] = m1;
            vr[j] = v1;
            const float den = sqrtf(v1) + eps;
            wr[j] = fmaf(m1 / den, -step, wj);
        }
    }
}
