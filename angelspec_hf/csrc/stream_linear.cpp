// A weight-streaming fp32 linear for forwards of a few rows on a CPU (angelspec_hf/cpu_kernels.py, "stream").
//
// MKL's sgemm reads a weight once for a one-row forward (a matrix-vector product bound by memory bandwidth) but runs
// a forward of 4-12 rows as a small GEMM that takes up to twice as long. Here a weight [N, K] is packed once into
// column blocks [ceil(N / 32), K, 32]; a forward streams each block from memory once (prefetched ahead) and multiplies
// it into a tile of up to 12 rows held in vector registers, so 12 rows cost little more than one (more rows: one pass
// over the weights per tile). Written with GCC vector extensions: compiled for the machine it runs on
// (-march=native), AVX-512 or AVX2 alike.
//
// Numerics: every row is computed by the same sequence of operations whatever the other rows and their number (a
// row's output is bit for bit independent of them), summing the reduction in chunks of 64 and adding the chunks,
// which keeps the rounding error at the level of MKL's blocked sum.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

namespace {

typedef float v16 __attribute__((vector_size(64), aligned(4)));
constexpr int64_t NB = 32;  // output columns per packed block: two 16-float vectors
constexpr int64_t KC = 64;  // reduction chunk
constexpr int64_t MR = 12;  // rows per tile (two accumulators per row: 24 vector registers)
constexpr int64_t PF = 16;  // prefetch distance, in reduction steps

// y[m, :ncols] = sum_k xt[k * M + m] * wp[k, :ncols]   (xt: the tile's rows transposed, [K, M]; wp: one block)
template <int M>
void tile(const float* __restrict xt, int64_t K, const float* __restrict wp, float* __restrict y, int64_t ldy,
          int64_t ncols) {
  v16 t0[M], t1[M];
#pragma GCC unroll 16
  for (int m = 0; m < M; ++m) t0[m] = t1[m] = (v16){};
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t k1 = std::min(K, k0 + KC);
    v16 a0[M], a1[M];
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) a0[m] = a1[m] = (v16){};
    for (int64_t k = k0; k < k1; ++k) {
      __builtin_prefetch(wp + (k + PF) * NB);
      __builtin_prefetch(wp + (k + PF) * NB + 16);
      const v16 w0 = *reinterpret_cast<const v16*>(wp + k * NB);
      const v16 w1 = *reinterpret_cast<const v16*>(wp + k * NB + 16);
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m) {
        const float x = xt[k * M + m];
        a0[m] += x * w0;
        a1[m] += x * w1;
      }
    }
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) {
      t0[m] += a0[m];
      t1[m] += a1[m];
    }
  }
  for (int m = 0; m < M; ++m) {
    if (ncols == NB) {
      *reinterpret_cast<v16*>(y + m * ldy) = t0[m];
      *reinterpret_cast<v16*>(y + m * ldy + 16) = t1[m];
    } else {
      float row[NB];
      *reinterpret_cast<v16*>(row) = t0[m];
      *reinterpret_cast<v16*>(row + 16) = t1[m];
      std::copy(row, row + ncols, y + m * ldy);
    }
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, float*, int64_t, int64_t);
constexpr TileFn kTiles[MR + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>,  tile<5>,  tile<6>,
                                   tile<7>, tile<8>, tile<9>, tile<10>, tile<11>, tile<12>};

}  // namespace

// weight [N, K] fp32 -> packed [ceil(N / 32), K, 32], the last block's missing columns zero
torch::Tensor pack(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat32 && weight.device().is_cpu(),
              "stream_linear.pack: a 2-D fp32 CPU weight, got ", weight.sizes(), " ", weight.scalar_type());
  const auto w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), blocks = (N + NB - 1) / NB;
  auto packed = torch::zeros({blocks, K, NB}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t c = 0; c < NB && b * NB + c < N; ++c)
        for (int64_t k = 0; k < K; ++k) dst[(b * K + k) * NB + c] = src[(b * NB + c) * K + k];
  });
  return packed;
}

// x [..., K] fp32, packed from a weight [N, K], bias [N] or None -> x @ weight.T + bias, [..., N] (rows in tiles of
// 12: a weight is read once a tile). The bias is added to each finished sum, as `out += bias` after the product would.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t N,
                     const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == torch::kFloat32 && x.device().is_cpu(),
              "stream_linear.linear: fp32 CPU rows, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == NB && packed.size(1) == x.size(-1) &&
                  packed.size(0) == (N + NB - 1) / NB && packed.is_contiguous(),
              "stream_linear.linear: packed weight ", packed.sizes(), " does not fit rows ", x.sizes(), " and ", N,
              " outputs");
  const float* bp = nullptr;
  torch::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == torch::kFloat32 && bias->device().is_cpu(),
                "stream_linear.linear: a bias of ", N, " fp32 values, got ", bias->sizes(), " ", bias->scalar_type());
    bc = bias->contiguous();
    bp = bc.data_ptr<float>();
  }
  const int64_t K = x.size(-1), R = K == 0 ? 0 : x.numel() / K, blocks = packed.size(0), tiles = (R + MR - 1) / MR;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  auto y = torch::empty(shape, x.options());
  if (R == 0 || N == 0) return y;
  const auto xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  std::vector<float> xt(static_cast<size_t>(tiles * MR * K));  // each tile's rows transposed: [K, rows]
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t r0 = t * MR, rows = std::min(MR, R - r0);
    for (int64_t k = 0; k < K; ++k)
      for (int64_t m = 0; m < rows; ++m) xt[t * MR * K + k * rows + m] = xp[(r0 + m) * K + k];
  }
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t ncols = std::min(NB, N - b * NB);
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t r0 = t * MR, rows = std::min(MR, R - r0);
        float* yb = yp + r0 * N + b * NB;
        kTiles[rows](xt.data() + t * MR * K, K, wp + b * K * NB, yb, N, ncols);
        if (bp != nullptr)
          for (int64_t m = 0; m < rows; ++m)
            for (int64_t c = 0; c < ncols; ++c) yb[m * N + c] += bp[b * NB + c];
      }
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "pack an fp32 weight [N, K] into 32-column blocks");
  m.def("linear", &linear, "x @ weight.T + bias from the packed weight", py::arg("x"), py::arg("packed"),
        py::arg("N"), py::arg("bias") = py::none());
}
