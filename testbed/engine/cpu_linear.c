
/* y = x W^T + bias for few rows (a decode step's), on weights packed once into panels of 32
   output columns: w [n / 32][k][32], so each input column's 32 weights are two adjacent
   vectors and a panel streams from memory in one run (asked for 4 KB ahead). Up to 8 rows
   share each weight load (8 x 2 accumulators). A decode step reads every weight once, so a
   few rows are bound by memory: oneDNN's matmul (testbed/engine/linear.py) reads them at
   ~32 GB/s here, this at ~38 (near what one core streams); from 8 rows on, the reuse of each
   load keeps this ahead too (1.5x at 8, 1.16x at 32, 1.07x at 64 rows). */
static inline __attribute__((always_inline)) void panel_rows(
        const float *x, int64_t x_stride, const int rows, const v16 *panel, int64_t k,
        const float *bias, float *y, int64_t n) {
    v16 a0[8], a1[8];
    const v16 b0 = bias ? ((const v16 *)bias)[0] : (v16){0};
    const v16 b1 = bias ? ((const v16 *)bias)[1] : (v16){0};
    for (int r = 0; r < rows; r++) { a0[r] = b0; a1[r] = b1; }
    for (int64_t c = 0; c < k; c++) {
        __builtin_prefetch((const char *)(panel + 2 * c) + 4096, 0, 0);
        __builtin_prefetch((const char *)(panel + 2 * c) + 4096 + 64, 0, 0);
        const v16 w0 = panel[2 * c], w1 = panel[2 * c + 1];
        for (int r = 0; r < rows; r++) {
            const float xv = x[r * x_stride + c];
            a0[r] += xv * w0;
            a1[r] += xv * w1;
        }
    }
    for (int r = 0; r < rows; r++) {
        ((v16 *)(y + r * n))[0] = a0[r];
        ((v16 *)(y + r * n))[1] = a1[r];
    }
}

/* x [m, k] (rows x_stride floats apart), w packed as above (n a multiple of 32), bias [n] or
   NULL, y [m, n] contiguous. */
void panel_linear(const float *x, int64_t x_stride, int64_t m, const float *w, int64_t k,
                  int64_t n, const float *bias, float *y) {
    for (int64_t p = 0; p < n / 32; p++) {
        const v16 *panel = (const v16 *)(w + p * k * 32);
        const float *bp = bias ? bias + p * 32 : NULL;
        for (int64_t r0 = 0; r0 < m; r0 += 8) {
            const float *xr = x + r0 * x_stride;
            float *yr = y + r0 * n + p * 32;
            switch (m - r0 < 8 ? m - r0 : 8) {  /* the row count a constant: unrolled */
                case 1: panel_rows(xr, x_stride, 1, panel, k, bp, yr, n); break;
                case 2: panel_rows(xr, x_stride, 2, panel, k, bp, yr, n); break;
                case 3: panel_rows(xr, x_stride, 3, panel, k, bp, yr, n); break;
                case 4: panel_rows(xr, x_stride, 4, panel, k, bp, yr, n); break;
                case 5: panel_rows(xr, x_stride, 5, panel, k, bp, yr, n); break;
                case 6: panel_rows(xr, x_stride, 6, panel, k, bp, yr, n); break;
                case 7: panel_rows(xr, x_stride, 7, panel, k, bp, yr, n); break;
                default: panel_rows(xr, x_stride, 8, panel, k, bp, yr, n);
            }
        }
    }
}
