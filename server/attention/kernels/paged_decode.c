/* Decode attention on the CPU backend's paged, head-major KV cache, reading K/V in place.
 *
 * One query row per sequence (a decode step, or the sampling rows of a prefill's last layer).
 * Cache layout (server/attention/cpu.py): key, value [num_kv, num_slots, head_dim], float32;
 * a sequence's context is a list of slots. Grouped-query attention: query head h reads kv head
 * h / (num_heads / num_kv). Queries arrive already multiplied by the softmax scale. Softmax in
 * float32 over each row's own context (no padding enters it), two passes over the keys' scores.
 *
 * Built by server/attention/native.py with the system C compiler; single-threaded (the engine's
 * math threads belong to Paddle's own OpenMP runtime, which a second runtime would fight).
 * Measured against the Paddle-ops path: docs/performance.md ("Attention"); the runs in
 * docs/history/performance-passes.md ("Third pass").
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* GCC/Clang vector extensions: 8 floats, compiled to AVX2 (or two SSE halves without it) */
typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }
static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }
static inline float hsum8(v8 v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

/* s[c] = exp(s[c] - m); returns their sum. */
static inline float exp_shifted(float *restrict s, int64_t n, float m) {
    float sum = 0.0f;
    for (int64_t c = 0; c < n; c++) { s[c] = expf(s[c] - m); sum += s[c]; }
    return sum;
}

/* One sequence and one kv head: its `rep` query heads against the `n` context slots `ctx`. Inlined with
 * nv (head_dim / 8) a constant for the common head sizes, so the inner loops unroll fully. */
static inline __attribute__((always_inline)) void group(const float *restrict qg, const float *restrict kh,
        const float *restrict vh, const int64_t *restrict ctx, int64_t n, int64_t rep, const int64_t nv,
        float *restrict scores, float *restrict og) {
    const int64_t hd = 8 * nv;
    for (int64_t c = 0; c < n; c++) {
        const float *kr = kh + ctx[c] * hd;
        for (int64_t r = 0; r < rep; r++) {
            const float *qr = qg + r * hd;
            v8 acc = load8(qr) * load8(kr);
            for (int64_t i = 1; i < nv; i++) acc += load8(qr + 8 * i) * load8(kr + 8 * i);
            scores[r * n + c] = hsum8(acc);
        }
    }
    for (int64_t r = 0; r < rep; r++) {
        float *s = scores + r * n, m = s[0];
        for (int64_t c = 1; c < n; c++) m = s[c] > m ? s[c] : m;
        const float inv = 1.0f / exp_shifted(s, n, m);
        for (int64_t c = 0; c < n; c++) s[c] *= inv;
    }
    for (int64_t r = 0; r < rep; r++) {
        v8 o[16] = {0};  /* nv <= 16: head_dim <= 128 */
        const float *p = scores + r * n;
        for (int64_t c = 0; c < n; c++) {
            const float *vr = vh + ctx[c] * hd;
            for (int64_t i = 0; i < nv; i++) o[i] += p[c] * load8(vr + 8 * i);
        }
        for (int64_t i = 0; i < nv; i++) store8(og + r * hd + 8 * i, o[i]);
    }
}

/* q, out: [batch, num_heads, head_dim]; slots: [batch, width] (row b's first lens[b] are used).
 * Returns 0; -1 when the score workspace cannot be allocated; -2 for a head_dim the kernel does not
 * take (not a multiple of 8, or above 128). */
int wf_paged_decode_f32(const float *q, const float *key, const float *value, const int64_t *slots,
                        const int64_t *lens, int64_t batch, int64_t num_heads, int64_t num_kv,
                        int64_t head_dim, int64_t num_slots, int64_t width, float *out) {
    const int64_t rep = num_heads / num_kv, nv = head_dim / 8;
    if (head_dim % 8 || nv > 16) return -2;
    float *scores = malloc(sizeof(float) * (size_t)(rep * (width > 0 ? width : 1)));
    if (!scores) return -1;
    for (int64_t b = 0; b < batch; b++) {
        for (int64_t h = 0; h < num_kv; h++) {
            const float *qg = q + (b * num_heads + h * rep) * head_dim;
            const float *kh = key + h * num_slots * head_dim, *vh = value + h * num_slots * head_dim;
            float *og = out + (b * num_heads + h * rep) * head_dim;
            const int64_t *ctx = slots + b * width;
            if (nv == 8) group(qg, kh, vh, ctx, lens[b], rep, 8, scores, og);
            else if (nv == 16) group(qg, kh, vh, ctx, lens[b], rep, 16, scores, og);
            else group(qg, kh, vh, ctx, lens[b], rep, nv, scores, og);
        }
    }
    free(scores);
    return 0;
}
