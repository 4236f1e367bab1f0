/* The decoder layer's elementwise steps between its matmuls (testbed/engine/layer_kernels.py
   states their contract; radix_kernels/reference.py has them in torch), one call each instead
   of a few torch ops: on the CPU a small model's decode layer is otherwise mostly the
   dispatching of those ops. Rows are contiguous fp32. */

/* residual_out = x (+ residual); out = weight * (r / sqrt(mean(r * r) + eps)) per row */
void add_rmsnorm(const float *x, const float *residual, const float *weight, int64_t t,
                 int64_t n, float eps, float *out, float *residual_out) {
    for (int64_t i = 0; i < t; i++) {
        const float *xi = x + i * n, *ri = residual ? residual + i * n : NULL;
        float *oi = out + i * n, *si = residual_out + i * n, sum = 0.0f;
        #pragma omp simd reduction(+:sum)
        for (int64_t c = 0; c < n; c++) {
            const float r = ri ? xi[c] + ri[c] : xi[c];
            si[c] = r;
            sum += r * r;
        }
        const float inv = (float)(1.0 / sqrt((double)(sum / (float)n + eps)));
        #pragma omp simd
        for (int64_t c = 0; c < n; c++) oi[c] = weight[c] * (si[c] * inv);
    }
}

/* out [t, m] = silu(gate) * up of gate_up [t, 2m] (gate, then up, in each row) */
void silu_and_mul(const float *gate_up, int64_t t, int64_t m, float *out) {
    for (int64_t i = 0; i < t; i++) {
        const float *g = gate_up + i * 2 * m, *u = g + m;
        float *oi = out + i * m;
        #pragma omp simd
        for (int64_t c = 0; c < m; c++) oi[c] = g[c] / (1.0f + expf(-g[c])) * u[c];
    }
}

/* qkv [t, (h + 2 kh) d] rows (q heads, k heads, v heads): q and k turned by RoPE,
   x * cos + roll(x, d / 2) * sin with cos, sin [t, d] (sin sign-folded), q written to
   q_out [t, h, d], k and v to rows slots[i] of k_buf, v_buf [slots, kh, d]. */
void rope_store(const float *qkv, const float *cos_, const float *sin_, const int32_t *slots,
                int64_t t, int64_t h, int64_t kh, int64_t d, float *k_buf, float *v_buf,
                float *q_out) {
    const int64_t half = d / 2, width = (h + 2 * kh) * d;
    for (int64_t i = 0; i < t; i++) {
        const float *row = qkv + i * width, *c = cos_ + i * d, *s = sin_ + i * d;
        float *kd = k_buf + (int64_t)slots[i] * kh * d;
        for (int64_t head = 0; head < h + kh; head++) {
            const float *x = row + head * d;
            float *y = head < h ? q_out + (i * h + head) * d : kd + (head - h) * d;
            #pragma omp simd
            for (int64_t e = 0; e < half; e++) y[e] = x[e] * c[e] + x[e + half] * s[e];
            #pragma omp simd
            for (int64_t e = half; e < d; e++) y[e] = x[e] * c[e] + x[e - half] * s[e];
        }
        memcpy(v_buf + (int64_t)slots[i] * kh * d, row + (h + kh) * d, sizeof(float) * kh * d);
    }
}
