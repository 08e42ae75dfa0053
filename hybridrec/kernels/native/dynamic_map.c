/* A dynamic table shard's id -> slot map on the CPU: one training step's uses, admissions and
 * evictions, decision for decision those of the torch path (hybridrec/sparse/dynamic/idmap.py
 * and policy.py, which state the policy), at a few ns per id instead of ~40 torch ops a step.
 *
 * Called through ctypes by hybridrec/kernels/native_map.py with the map's tensors' data
 * pointers; single-threaded and deterministic. The raw id -> slot index is an open-addressing
 * hash table (linear probing, backward-shift deletion) derived from slot_id: rebuilt from it on
 * load, never saved. Legend: N ids in a step, U distinct, M missed, A to admit, R shard slots,
 * S slots per bucket (Sw of them for ids), nb buckets of the shard.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INDEX_SALT 0x2545F4914F6CDD1DULL /* index positions apart from the buckets' hash */

static inline uint64_t mix64(uint64_t z) { /* splitmix64, as kernels/hashing.py's mix64 */
    z += 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static inline int64_t bucket_of(int64_t id, int64_t buckets) {
    return (int64_t)(mix64((uint64_t)id) & 0x7FFFFFFFFFFFFFFFULL) % buckets;
}

static inline uint64_t home(int64_t id, uint64_t mask) {
    return mix64((uint64_t)id ^ INDEX_SALT) & mask;
}

/* ---- the index: h[cap] entries (id, slot; slot -1: empty), cap a power of two ---- */

typedef struct {
    int64_t id, slot;
} entry_t;

static inline int64_t index_find(const entry_t *h, uint64_t mask, int64_t id) {
    for (uint64_t i = home(id, mask);; i = (i + 1) & mask) {
        if (h[i].slot < 0) return -1;
        if (h[i].id == id) return h[i].slot;
    }
}

static inline void index_put(entry_t *h, uint64_t mask, int64_t id, int64_t slot) {
    uint64_t i = home(id, mask);
    while (h[i].slot >= 0 && h[i].id != id) i = (i + 1) & mask;
    h[i].id = id;
    h[i].slot = slot;
}

static void index_del(entry_t *h, uint64_t mask, int64_t id) {
    uint64_t i = home(id, mask);
    while (h[i].slot >= 0 && h[i].id != id) i = (i + 1) & mask;
    if (h[i].slot < 0) return;
    for (uint64_t j = i;;) { /* shift back the entries whose probe passed through i */
        j = (j + 1) & mask;
        if (h[j].slot < 0) break;
        uint64_t k = home(h[j].id, mask);
        int stays = i <= j ? (i < k && k <= j) : (i < k || k <= j);
        if (!stays) {
            h[i] = h[j];
            i = j;
        }
    }
    h[i].slot = -1;
}

/* Rebuild the index h[cap] from slot_id[R] (-1: free). */
void hr_dyn_index_build(entry_t *h, int64_t cap, const int64_t *slot_id, int64_t r) {
    const uint64_t mask = (uint64_t)cap - 1;
    for (int64_t i = 0; i < cap; i++) h[i].slot = -1;
    for (int64_t s = 0; s < r; s++)
        if (slot_id[s] >= 0) index_put(h, mask, slot_id[s], s);
}

/* out[N]: each id's slot, -1 for none (evaluation: changes nothing). */
void hr_dyn_find(const entry_t *h, int64_t cap, const int64_t *ids, int64_t n, int64_t *out) {
    const uint64_t mask = (uint64_t)cap - 1;
    for (int64_t i = 0; i < n; i++) out[i] = index_find(h, mask, ids[i]);
}

/* ---- phase 1: uses ---- */

typedef struct {
    int64_t id, u;
} miss_t;

static int by_id(const void *a, const void *b) {
    int64_t x = ((const miss_t *)a)->id, y = ((const miss_t *)b)->id;
    return (x > y) - (x < y);
}

/* One step's ids[N]: uniq[U] (first-occurrence order) with counts ucount[U], inverse[N] (each
 * id's entry of uniq) and uslot[U] (its slot, -1 missed). Each hit slot s is used: busy[s] = 1,
 * last[s] = t, and under LFU (lfu != 0) score[s] += its count (fp32, as index_add_). The misses
 * come out ascending: miss_id[M], miss_u[M] (their uniq entries). Returns U and writes M to
 * *m_out; -1 if scratch memory is not available. */
int64_t hr_dyn_uses(const int64_t *ids, int64_t n, const entry_t *h, int64_t cap, int64_t t, int64_t lfu, float *score, int64_t *last, int8_t *busy,
                    int64_t *uniq, int64_t *ucount, int64_t *inverse, int64_t *uslot,
                    int64_t *miss_id, int64_t *miss_u, int64_t *m_out) {
    int bits = 4;
    while ((INT64_C(1) << bits) < 2 * n) bits++;
    const uint64_t tmask = (UINT64_C(1) << bits) - 1, mask = (uint64_t)cap - 1;
    int64_t *tk = malloc(sizeof(int64_t) << bits), *tv = malloc(sizeof(int64_t) << bits);
    miss_t *miss = malloc(sizeof(miss_t) * (size_t)(n > 0 ? n : 1));
    if (!tk || !tv || !miss) {
        free(tk);
        free(tv);
        free(miss);
        return -1;
    }
    for (uint64_t i = 0; i <= tmask; i++) tv[i] = -1;
    int64_t u = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t id = ids[i];
        uint64_t p = home(id, tmask);
        while (tv[p] >= 0 && tk[p] != id) p = (p + 1) & tmask;
        if (tv[p] < 0) {
            tk[p] = id;
            tv[p] = u;
            uniq[u] = id;
            ucount[u] = 0;
            u++;
        }
        ucount[tv[p]]++;
        inverse[i] = tv[p];
    }
    int64_t m = 0;
    for (int64_t k = 0; k < u; k++) {
        const int64_t s = index_find(h, mask, uniq[k]);
        uslot[k] = s;
        if (s < 0) {
            miss[m].id = uniq[k];
            miss[m].u = k;
            m++;
            continue;
        }
        busy[s] = 1;
        last[s] = t;
        if (lfu) score[s] += (float)ucount[k];
    }
    qsort(miss, (size_t)m, sizeof(miss_t), by_id);
    for (int64_t k = 0; k < m; k++) {
        miss_id[k] = miss[k].id;
        miss_u[k] = miss[k].u;
    }
    *m_out = m;
    free(tk);
    free(tv);
    free(miss);
    return u;
}

/* ---- phase 2: admissions and evictions ---- */

static int by_key(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

static int by_key_desc(const void *a, const void *b) { return by_key(b, a); }

/* hr_dyn_admit's one argument, declared once here through the field list below (the struct,
 * its field names and offsets for hr_dyn_admit_layout) and mirrored field for field by
 * kernels/native_map.py's AdmitArgs (tests/unit/test_native_map_layout.py compares the two). */
#define HR_DYN_ADMIT_FIELDS(X)                                                                    \
    /* the step: the ids to admit [A] (ascending), their uniq entries and this step's counts */  \
    X(const int64_t *, want) X(const int64_t *, want_u) X(const int64_t *, want_count)          \
    X(int64_t, a)                                                                                \
    X(int64_t *, uslot) X(int64_t, u) /* the step's distinct ids' slots [U], -1 missed */        \
    /* the shard's map, written in place: per-slot arrays [R], free lists [nb, sw], n_free  */   \
    /* [nb], busy marks [R], the index h[cap] */                                                 \
    X(int64_t *, slot_id) X(float *, score) X(int64_t *, last) X(int64_t *, admits)              \
    X(int64_t *, evicts) X(int64_t *, free_pos) X(int64_t *, n_free) X(int8_t *, busy)           \
    X(entry_t *, h) X(int64_t, cap)                                                              \
    /* geometry (S slots per bucket, sw for ids, nb buckets from b0, of `buckets`) and policy */ \
    X(int64_t, S) X(int64_t, sw) X(int64_t, nb) X(int64_t, b0) X(int64_t, buckets)               \
    X(int64_t, evict) X(int64_t, t) X(int64_t, ttl_steps) X(int64_t, bulk)                       \
    /* out: new_slot[K], new_id[K], left[A], counts[2] */                                        \
    X(int64_t *, new_slot) X(int64_t *, new_id) X(int8_t *, left) X(int64_t *, counts)

#define AS_MEMBER(type, name) type name;
typedef struct {
    HR_DYN_ADMIT_FIELDS(AS_MEMBER)
} hr_dyn_admit_args;

#define AS_OFFSET(type, name) (int64_t) offsetof(hr_dyn_admit_args, name),
#define AS_NAME(type, name) #name " "

/* The struct's layout for ctypes' check: out[0] = sizeof, out[1 + i] = field i's offset (at
 * most n values written); returns how many there are. */
int64_t hr_dyn_admit_layout(int64_t *out, int64_t n) {
    const int64_t layout[] = {(int64_t)sizeof(hr_dyn_admit_args),
                              HR_DYN_ADMIT_FIELDS(AS_OFFSET)};
    const int64_t count = (int64_t)(sizeof(layout) / sizeof(layout[0]));
    for (int64_t i = 0; i < count && i < n; i++) out[i] = layout[i];
    return count;
}

/* The fields' names, in order, each followed by a space. */
const char *hr_dyn_admit_fields(void) { return HR_DYN_ADMIT_FIELDS(AS_NAME); }

static void evict_slot(const hr_dyn_admit_args *x, int64_t s, int64_t *evicted) {
    /* idmap._evict: an eviction's extra victim */
    index_del(x->h, (uint64_t)x->cap - 1, x->slot_id[s]);
    x->slot_id[s] = -1;
    x->score[s] = 0.0f;
    x->last[s] = 0;
    x->evicts[s] += 1;
    (*evicted)++;
}

/* The ids to admit want[A] (ascending; their uniq entries want_u[A], this step's counts
 * want_count[A]) take slots, per bucket as policy.choose_slots: free positions first, lowest
 * first; then one eviction of the lowest (level << 32 | position) among the bucket's slots
 * neither free nor busy (nor, under ttl, used within ttl_steps), at least `bulk` of them, the
 * victims no id takes becoming the bucket's free list. level: the LFU score's fp32 bits
 * (evict 0), the last use (1: lru, 2: ttl). Each admitted id's slot is written (slot_id, score
 * = its count, last = t, admits; evicts where it held an id) and indexed; uslot[want_u] gets it.
 * Out: new_slot[K], new_id[K] in want order; left[A] = 1 where an id got no slot;
 * counts[0..1] = (admitted K, evicted). Finally busy is cleared for every uslot. Returns K, or
 * -1 (no scratch memory), -2 (an id of another shard's buckets). */
int64_t hr_dyn_admit(const hr_dyn_admit_args *x) {
    const int64_t a = x->a, nb = x->nb, sw = x->sw, S = x->S;
    const uint64_t mask = (uint64_t)x->cap - 1;
    int64_t k_new = 0, rc = 0, evicted = 0;
    int64_t *lb = malloc(sizeof(int64_t) * (size_t)(a > 0 ? a : 1));
    int64_t *j = malloc(sizeof(int64_t) * (size_t)(a > 0 ? a : 1));
    int64_t *order = malloc(sizeof(int64_t) * (size_t)(a > 0 ? a : 1));
    int64_t *start = calloc((size_t)nb + 1, sizeof(int64_t));
    int64_t *prio = malloc(sizeof(int64_t) * (size_t)(sw > 0 ? sw : 1));
    if (!lb || !j || !order || !start || !prio) {
        rc = -1;
        goto done;
    }
    for (int64_t i = 0; i < a; i++) {
        lb[i] = bucket_of(x->want[i], x->buckets) - x->b0;
        if (lb[i] < 0 || lb[i] >= nb) {
            rc = -2;
            goto done;
        }
        start[lb[i] + 1]++;
        j[i] = -1;
    }
    for (int64_t b = 0; b < nb; b++) start[b + 1] += start[b];
    for (int64_t i = 0, *at = start; i < a; i++) order[at[lb[i]]++] = i; /* stable by bucket */
    for (int64_t b = nb; b > 0; b--) start[b] = start[b - 1];
    start[0] = 0;
    for (int64_t b = 0; b < nb; b++) {
        const int64_t need = start[b + 1] - start[b], nf = x->n_free[b];
        if (need == 0) continue;
        int64_t *fl = x->free_pos + b * sw;
        for (int64_t r = 0; r < need && r < nf; r++) j[order[start[b] + r]] = fl[nf - 1 - r];
        const int64_t shortfall = need - nf;
        if (shortfall <= 0) {
            x->n_free[b] = nf - need;
            continue;
        }
        int64_t want_k = shortfall > x->bulk ? shortfall : x->bulk;
        if (want_k > sw) want_k = sw;
        int64_t nc = 0;
        for (int64_t p = 0; p < sw; p++) {
            const int64_t s = b * S + p;
            if (x->slot_id[s] < 0 || x->busy[s]) continue;
            if (x->evict == 2 && x->t - x->last[s] <= x->ttl_steps) continue;
            int64_t level;
            if (x->evict == 0) {
                int32_t bits;
                memcpy(&bits, &x->score[s], sizeof(bits));
                level = bits;
            } else {
                level = x->last[s];
            }
            prio[nc++] = (int64_t)((uint64_t)level << 32) | p;
        }
        qsort(prio, (size_t)nc, sizeof(int64_t), by_key);
        const int64_t avail = want_k < nc ? want_k : nc;
        const int64_t taken = shortfall < avail ? shortfall : avail;
        for (int64_t q = 0; q < taken; q++) j[order[start[b] + nf + q]] = prio[q] & 0xFFFFFFFF;
        /* the extra victims: evicted now, then the free list, positions descending */
        const int64_t n_extra = avail - taken;
        for (int64_t q = taken; q < avail; q++)
            evict_slot(x, b * S + (prio[q] & 0xFFFFFFFF), &evicted);
        for (int64_t e = 0; e < n_extra; e++) fl[e] = prio[taken + e] & 0xFFFFFFFF;
        qsort(fl, (size_t)n_extra, sizeof(int64_t), by_key_desc); /* positions descending */
        x->n_free[b] = n_extra;
    }
    for (int64_t i = 0; i < a; i++) {
        x->left[i] = j[i] < 0;
        if (j[i] < 0) continue;
        const int64_t s = lb[i] * S + j[i];
        if (x->slot_id[s] >= 0) {
            index_del(x->h, mask, x->slot_id[s]);
            x->evicts[s] += 1;
            evicted++;
        }
        x->admits[s] += 1;
        x->slot_id[s] = x->want[i];
        x->score[s] = (float)x->want_count[i];
        x->last[s] = x->t;
        index_put(x->h, mask, x->want[i], s);
        x->uslot[x->want_u[i]] = s;
        x->new_slot[k_new] = s;
        x->new_id[k_new] = x->want[i];
        k_new++;
    }
    rc = k_new;
done:
    for (int64_t k = 0; k < x->u; k++)
        if (x->uslot[k] >= 0) x->busy[x->uslot[k]] = 0;
    x->counts[0] = k_new;
    x->counts[1] = evicted;
    free(lb);
    free(j);
    free(order);
    free(start);
    free(prio);
    return rc;
}

/* ---- fresh rows ---- */

/* out[K, c1 - c0]: the initial values of ids[K]'s rows, columns [c0, c1), as
 * kernels/hashing.py's fresh_rows computes them (fp32): mix64(id ^ key) plus the column times
 * the golden ratio, one more xorshift-multiply round, its top 24 bits u in [0, 1) make
 * (u * 2 - 1) * bound, each product rounded on its own (-ffp-contract=off). */
void hr_dyn_fresh_rows(const int64_t *ids, int64_t k, int64_t key, int64_t c0, int64_t c1,
                       float bound, float *out) {
    const int64_t d = c1 - c0;
    for (int64_t i = 0; i < k; i++) {
        const uint64_t h = mix64((uint64_t)(ids[i] ^ key));
        for (int64_t c = c0; c < c1; c++) {
            uint64_t z = h + (uint64_t)c * 0x9E3779B97F4A7C15ULL;
            z = (z ^ (z >> 32)) * 0x94D049BB133111EBULL;
            const float u = (float)(z >> 40) * (1.0f / 16777216.0f);
            out[i * d + (c - c0)] = (u * 2.0f - 1.0f) * bound;
        }
    }
}
