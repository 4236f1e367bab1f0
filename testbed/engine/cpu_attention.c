/* The CPU's attention kernels over the KV pool, read in place (testbed/engine/cpu_attention.py
   builds this file once and calls it through ctypes): decode_attention for decode steps (one
   query per request, a head group's rows together, the log-sum-exp out for cascade merges) and
   extend_attention for prefill steps (each request's new tokens, causal from the lower right).
   fp32, one thread, head_dim a multiple of 16 up to 256. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* 16 floats, loaded and stored unaligned; the compiler maps it to the CPU's vectors */
typedef float v16 __attribute__((vector_size(64), aligned(4), may_alias));

static inline float hsum(v16 x) {
    float s = 0.0f;
    for (int l = 0; l < 16; l++) s += x[l];
    return s;
}

/* A slot's row is asked for AHEAD rows before it is read: the hardware prefetcher follows a
   sequence's rows only while they are adjacent, and page-1 slots rarely are (decode steps hand
   each request one slot a step, so a batch's rows interleave; a long-lived pool scatters them).
   Without it every row waits for memory: 2 x 448 interleaved slots cost 3.8x ascending ones,
   with it 1.3x (`python -m experiments.benchmarks.slot_order`). */
#define AHEAD 12

static inline void prefetch_row(const float *row, int64_t width) {
    for (int64_t b = 0; b < width * 16; b += 16) __builtin_prefetch(row + b, 0, 0);
}

/* One sequence: its keys' rows k[slot] (all kv heads, kh * nv * 16 floats, contiguous) read
   once for every head's r query rows; then the values' rows likewise. nv (head_dim / 16) is a
   constant where inlined, so each row is a few whole-vector operations. */
static inline __attribute__((always_inline)) void sequence(
        const float *q, const float *k, const float *v, const int32_t *slots, int64_t len,
        int64_t kh, int64_t r, const int nv, float scale, float *scores, v16 *acc, float *o,
        float *lse) {
    const int64_t rows = kh * r, width = kh * nv;  /* query rows; vectors in a slot's row */
    for (int64_t j = 0; j < len; j++) {
        if (j + AHEAD < len) prefetch_row(k + (int64_t)slots[j + AHEAD] * width * 16, width);
        const v16 *kr = (const v16 *)(k + (int64_t)slots[j] * width * 16);
        for (int64_t h = 0; h < kh; h++) {
            for (int64_t a = 0; a < r; a++) {
                const v16 *qa = (const v16 *)(q + (h * r + a) * nv * 16);
                v16 dot = qa[0] * kr[h * nv];
                for (int x = 1; x < nv; x++) dot += qa[x] * kr[h * nv + x];
                scores[(h * r + a) * len + j] = hsum(dot) * scale;
            }
        }
    }
    for (int64_t a = 0; a < rows; a++) {
        float *sa = scores + a * len, m = -FLT_MAX, sum = 0.0f;
        for (int64_t j = 0; j < len; j++) m = sa[j] > m ? sa[j] : m;
        #pragma omp simd reduction(+:sum)
        for (int64_t j = 0; j < len; j++) { sa[j] = expf(sa[j] - m); sum += sa[j]; }
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
        #pragma omp simd
        for (int64_t j = 0; j < len; j++) sa[j] *= inv;
        if (lse) lse[a] = len > 0 ? m + logf(sum) : -FLT_MAX;
    }
    memset(acc, 0, sizeof(v16) * rows * nv);
    for (int64_t j = 0; j < len; j++) {
        if (j + AHEAD < len) prefetch_row(v + (int64_t)slots[j + AHEAD] * width * 16, width);
        const v16 *vr = (const v16 *)(v + (int64_t)slots[j] * width * 16);
        for (int64_t h = 0; h < kh; h++) {
            for (int64_t a = 0; a < r; a++) {
                const float p = scores[(h * r + a) * len + j];
                v16 *acc_a = acc + (h * r + a) * nv;
                for (int x = 0; x < nv; x++) acc_a[x] += p * vr[h * nv + x];
            }
        }
    }
    memcpy(o, acc, sizeof(v16) * rows * nv);
}

/* q [n, kh, r, d], k and v [slots, kh, d], o [n, kh, r, d], lse [n, kh, r] (or NULL), all
   fp32 and contiguous; sequence i reads slots indices[indptr[i] .. indptr[i + 1] - 1] (the
   slot table's int32 ids; indptr int64); d a multiple of 16 up to 256.
   Returns 0; 1 when scratch memory could not be had, 2 for a head_dim it does not take. */
int decode_attention(const float *q, const float *k, const float *v, const int64_t *indptr,
                     const int32_t *indices, int64_t n, int64_t kh, int64_t r, int64_t d,
                     float scale, float *o, float *lse) {
    if (d % 16 != 0 || d > 256) return 2;
    const int nv = (int)(d / 16);
    int64_t longest = 1;
    for (int64_t i = 0; i < n; i++)
        if (indptr[i + 1] - indptr[i] > longest) longest = indptr[i + 1] - indptr[i];
    float *scores = malloc(sizeof(float) * (size_t)(kh * r * longest));
    v16 *acc = malloc(sizeof(v16) * (size_t)(kh * r * nv));
    if (!scores || !acc) { free(scores); free(acc); return 1; }
    for (int64_t i = 0; i < n; i++) {
        const int64_t start = indptr[i], len = indptr[i + 1] - start;
        const float *qi = q + i * kh * r * d;
        float *oi = o + i * kh * r * d, *li = lse ? lse + i * kh * r : NULL;
        switch (nv) {  /* the common head_dims with their sizes known */
            case 4: sequence(qi, k, v, indices + start, len, kh, r, 4, scale, scores, acc, oi, li);
                    break;
            case 8: sequence(qi, k, v, indices + start, len, kh, r, 8, scale, scores, acc, oi, li);
                    break;
            default: sequence(qi, k, v, indices + start, len, kh, r, nv, scale, scores, acc, oi,
                              li);
        }
    }
    free(scores); free(acc);
    return 0;
}

/* Prefill (extend) attention: request i's new query tokens q[qo_indptr[i] ..] against its KV
   slots indices[kv_indptr[i] ..] (its cached prefix, then its new tokens, whose K/V the layer
   stored already), causal from the lower right: new token t sees keys 0 .. prefix + t. Per
   request and KV head, the keys are copied once into a transposed scratch (16 keys a vector,
   so a query row's 16 scores are head_dim fused multiply-adds, no horizontal sums); QB query
   rows (the head group's rows of consecutive tokens) then take their scores together, an exact
   softmax over the keys each row sees, and the values read in place. */
#define QB 8

static inline __attribute__((always_inline)) void extend_head(
        const float *q, int64_t q_stride, int64_t qlen, int64_t prefix, int64_t group,
        const float *k, const float *v, const int32_t *slots, int64_t len, int64_t kh,
        int64_t g, const int nv, float scale, float *kt, float *scores, int64_t span,
        float *o, int64_t o_stride) {
    const int64_t d = nv * 16, width = kh * nv;  /* vectors in a slot's row */
    const int64_t tiles = (len + 15) / 16;
    for (int64_t tile = 0; tile < tiles; tile++) {  /* kt[tile][x][lane] = key (16 tile + lane), x */
        float *dst = kt + tile * d * 16;
        for (int lane = 0; lane < 16; lane++) {
            const int64_t j = tile * 16 + lane;
            if (j < len) {
                if (j + AHEAD < len) prefetch_row(k + (int64_t)slots[j + AHEAD] * width * 16 + g * d, nv);
                const float *row = k + (int64_t)slots[j] * width * 16 + g * d;
                for (int64_t x = 0; x < d; x++) dst[x * 16 + lane] = row[x];
            } else {
                for (int64_t x = 0; x < d; x++) dst[x * 16 + lane] = 0.0f;
            }
        }
    }
    const int64_t rows = qlen * group;
    for (int64_t r0 = 0; r0 < rows; r0 += QB) {
        const int64_t nb = rows - r0 < QB ? rows - r0 : QB;
        const float *qr[QB];
        int64_t seen[QB];  /* keys row b sees */
        for (int b = 0; b < QB; b++) {
            const int64_t r = r0 + (b < nb ? b : nb - 1), t = r / group;
            qr[b] = q + t * q_stride + (g * group + r % group) * d;
            seen[b] = prefix + t + 1;
        }
        const int64_t keys = seen[nb - 1], ktiles = (keys + 15) / 16;
        for (int64_t tile = 0; tile < ktiles; tile++) {
            const v16 *kv = (const v16 *)(kt + tile * d * 16);
            v16 acc[QB];
            for (int b = 0; b < QB; b++) acc[b] = kv[0] * qr[b][0];
            for (int64_t x = 1; x < d; x++)
                for (int b = 0; b < QB; b++) acc[b] += kv[x] * qr[b][x];
            for (int b = 0; b < QB; b++)
                *(v16 *)(scores + b * span + tile * 16) = acc[b] * scale;
        }
        for (int b = 0; b < nb; b++) {
            float *sb = scores + b * span, m = -FLT_MAX, sum = 0.0f;
            const int64_t n = seen[b];
            for (int64_t j = 0; j < n; j++) m = sb[j] > m ? sb[j] : m;
            #pragma omp simd reduction(+:sum)
            for (int64_t j = 0; j < n; j++) { sb[j] = expf(sb[j] - m); sum += sb[j]; }
            const float inv = 1.0f / sum;
            #pragma omp simd
            for (int64_t j = 0; j < n; j++) sb[j] *= inv;
            for (int64_t j = n; j < keys; j++) sb[j] = 0.0f;
        }
        v16 out[QB][16];
        for (int b = 0; b < nb; b++) for (int x = 0; x < nv; x++) out[b][x] = (v16){0};
        for (int64_t j = 0; j < keys; j++) {
            if (j + AHEAD < keys) prefetch_row(v + (int64_t)slots[j + AHEAD] * width * 16 + g * d, nv);
            const v16 *vr = (const v16 *)(v + (int64_t)slots[j] * width * 16 + g * d);
            for (int b = 0; b < nb; b++) {
                const float p = scores[b * span + j];
                for (int x = 0; x < nv; x++) out[b][x] += p * vr[x];
            }
        }
        for (int b = 0; b < nb; b++) {
            const int64_t r = r0 + b, t = r / group;
            memcpy(o + t * o_stride + (g * group + r % group) * d, out[b], sizeof(v16) * nv);
        }
    }
}

/* q [T, h, d] with q_stride floats between tokens (a head's d floats contiguous, heads
   adjacent), k and v [slots, kh, d], o [T, h, d] contiguous; h a multiple of kh; request i's
   queries are tokens qo_indptr[i] .. qo_indptr[i + 1] - 1 and its keys the slots
   indices[kv_indptr[i] .. kv_indptr[i + 1] - 1], at least as many as its queries.
   Returns 0; 1 without scratch memory, 2 for a head_dim it does not take, 3 for a request
   with fewer keys than queries. */
int extend_attention(const float *q, int64_t q_stride, const float *k, const float *v,
                     const int64_t *qo_indptr, const int64_t *kv_indptr, const int32_t *indices,
                     int64_t n, int64_t h, int64_t kh, int64_t d, float scale, float *o) {
    if (d % 16 != 0 || d > 256) return 2;
    const int nv = (int)(d / 16);
    const int64_t group = h / kh;
    int64_t longest = 16;
    for (int64_t i = 0; i < n; i++) {
        const int64_t len = kv_indptr[i + 1] - kv_indptr[i];
        if (len < qo_indptr[i + 1] - qo_indptr[i]) return 3;
        if (len > longest) longest = len;
    }
    const int64_t span = (longest + 15) / 16 * 16;
    float *kt = aligned_alloc(64, sizeof(float) * (size_t)(span * d));
    float *scores = aligned_alloc(64, sizeof(float) * (size_t)(QB * span));
    if (!kt || !scores) { free(kt); free(scores); return 1; }
    for (int64_t i = 0; i < n; i++) {
        const int64_t q0 = qo_indptr[i], qlen = qo_indptr[i + 1] - q0;
        const int64_t k0 = kv_indptr[i], len = kv_indptr[i + 1] - k0;
        if (qlen == 0) continue;
        for (int64_t g = 0; g < kh; g++) {
            switch (nv) {
                case 4: extend_head(q + q0 * q_stride, q_stride, qlen, len - qlen, group, k, v,
                                    indices + k0, len, kh, g, 4, scale, kt, scores, span,
                                    o + q0 * h * d, h * d);
                        break;
                case 8: extend_head(q + q0 * q_stride, q_stride, qlen, len - qlen, group, k, v,
                                    indices + k0, len, kh, g, 8, scale, kt, scores, span,
                                    o + q0 * h * d, h * d);
                        break;
                default: extend_head(q + q0 * q_stride, q_stride, qlen, len - qlen, group, k, v,
                                     indices + k0, len, kh, g, nv, scale, kt, scores, span,
                                     o + q0 * h * d, h * d);
            }
        }
    }
    free(kt); free(scores);
    return 0;
}
