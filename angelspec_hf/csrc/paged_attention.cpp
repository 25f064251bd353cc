// Attention of a packed ragged batch over the batched engine's paged KV pool, on a CPU, fp32
// (angelspec_hf/tgi_patch/engine/kernels/cpu_attention.py; the contract is `kernels.reference.paged_attention`'s).
//
// The reference gathers every group of sequences' keys and values out of the pool into padded tensors, then runs
// SDPA under an additive mask: in a decode step of 8 requests with a few hundred tokens each, that copying and masking
// took about a quarter of the step. Here each (sequence, KV head) is one work item: its keys are read in place through
// the page table, once for all the query heads that share them and all its new tokens; scores, softmax and the
// weighted sum of values run in fp32 (a two-pass softmax: max, then exp and sum). Nothing is padded and nothing masked.
// A sequence adding one token (a decoding row) computes each query head's scores key by key. A sequence adding several
// (a verification of drafted tokens) has many query rows per key: its keys are read in tiles of KEY_TILE, transposed
// once into a small buffer, and blocks of ROW_BLOCK rows get their scores against the tile from broadcast
// multiply-adds into independent accumulators (no horizontal sums); the weighted sum of values, likewise, reads each
// value once per block of rows.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <math.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#if defined(ANGELSPEC_MVEC)
// glibc's vector math library (libmvec: the build defines ANGELSPEC_MVEC where it links it, x86-64 with glibc) has
// SIMD variants of expf for every x86-64 vector ISA; declaring them lets the softmax's exp loop vectorize without
// -ffast-math (which would also reorder every other sum)
extern "C" float expf(float) __attribute__((simd("notinbranch")));
#endif

namespace {

constexpr int64_t KEY_TILE = 16;  // keys per tile of the many-rows path: one 512-bit register of fp32 per row
constexpr int64_t ROW_BLOCK = 8;  // query rows computed together: independent accumulators, each load used 8 times
constexpr int64_t LANES = 16;     // output dimensions per pass of the weighted sum of values

// Scores, softmax and weighted values of `rows` query rows (row r: `q_rows[r]`, seeing the first `limit[r]` keys, the
// sequence's pool rows `where`) into `out_rows[r]`. `scores` holds rows x keys, `tile` D x KEY_TILE.
void many_rows(int64_t rows, int64_t keys, int64_t D, float scale, const float* const* q_rows, const int64_t* limit,
               const int64_t* where, const float* k_all, const float* v_all, float* const* out_rows,
               std::vector<float>& scores, std::vector<float>& tile) {
  scores.assign(rows * keys, 0.f);
  tile.resize(D * KEY_TILE);
  for (int64_t p0 = 0; p0 < keys; p0 += KEY_TILE) {
    const int64_t width = std::min(KEY_TILE, keys - p0);
    for (int64_t j = 0; j < KEY_TILE; ++j) {  // tile[d][j] = key p0 + j, dimension d; zeros past the last key
      const float* k = j < width ? k_all + where[p0 + j] * D : nullptr;
      for (int64_t d = 0; d < D; ++d) tile[d * KEY_TILE + j] = k ? k[d] : 0.f;
    }
    for (int64_t r0 = 0; r0 < rows; r0 += ROW_BLOCK) {  // scores of ROW_BLOCK rows against the tile at once
      const int64_t block = std::min(ROW_BLOCK, rows - r0);
      bool wanted = false;
      for (int64_t i = 0; i < block; ++i) wanted = wanted || p0 < limit[r0 + i];
      if (!wanted) continue;
      const float* q[ROW_BLOCK];
      for (int64_t i = 0; i < ROW_BLOCK; ++i) q[i] = q_rows[r0 + std::min(i, block - 1)];
      float dots[ROW_BLOCK][KEY_TILE] = {};
      for (int64_t d = 0; d < D; ++d) {
        const float* t = tile.data() + d * KEY_TILE;
        for (int64_t i = 0; i < ROW_BLOCK; ++i) {
          const float qd = q[i][d];
#pragma omp simd
          for (int64_t j = 0; j < KEY_TILE; ++j) dots[i][j] += qd * t[j];
        }
      }
      for (int64_t i = 0; i < block; ++i) {
        float* out = scores.data() + (r0 + i) * keys + p0;
        for (int64_t j = 0; j < width; ++j) out[j] = dots[i][j] * scale;
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {  // softmax over the keys the row sees; the weights of the others stay 0
    float* w = scores.data() + r * keys;
    const int64_t seen = limit[r];
    float peak = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < seen; ++p) peak = std::max(peak, w[p]);
#pragma omp simd
    for (int64_t p = 0; p < seen; ++p) w[p] = expf(w[p] - peak);
    float sum = 0.f;
    for (int64_t p = 0; p < seen; ++p) sum += w[p];
    const float inv = 1.f / sum;
    for (int64_t p = 0; p < seen; ++p) w[p] *= inv;
    for (int64_t p = seen; p < keys; ++p) w[p] = 0.f;
  }
  for (int64_t r0 = 0; r0 < rows; r0 += ROW_BLOCK) {  // weighted values: ROW_BLOCK rows x LANES dimensions at a time
    const int64_t block = std::min(ROW_BLOCK, rows - r0);
    int64_t seen = 0;
    for (int64_t i = 0; i < block; ++i) seen = std::max(seen, limit[r0 + i]);
    const float* w[ROW_BLOCK];  // rows past the block's end read its last row's weights and are not stored
    for (int64_t i = 0; i < ROW_BLOCK; ++i) w[i] = scores.data() + (r0 + std::min(i, block - 1)) * keys;
    for (int64_t d0 = 0; d0 < D; d0 += LANES) {
      if (d0 + LANES <= D) {
        float acc[ROW_BLOCK][LANES] = {};
        for (int64_t p = 0; p < seen; ++p) {
          const float* v = v_all + where[p] * D + d0;
          for (int64_t i = 0; i < ROW_BLOCK; ++i) {
            const float wp = w[i][p];
#pragma omp simd
            for (int64_t j = 0; j < LANES; ++j) acc[i][j] += wp * v[j];
          }
        }
        for (int64_t i = 0; i < block; ++i)
          for (int64_t j = 0; j < LANES; ++j) out_rows[r0 + i][d0 + j] = acc[i][j];
      } else {  // a head size that is not a multiple of LANES: its last dimensions one by one
        for (int64_t i = 0; i < block; ++i)
          for (int64_t d = d0; d < D; ++d) {
            float sum = 0.f;
            for (int64_t p = 0; p < seen; ++p) sum += w[i][p] * v_all[where[p] * D + d];
            out_rows[r0 + i][d] = sum;
          }
      }
    }
  }
}

torch::Tensor paged_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                              torch::Tensor page_table, torch::Tensor slots, torch::Tensor held, torch::Tensor fresh,
                              torch::Tensor starts, double scaling, int64_t page_size, bool causal) {
  for (const auto& t : {query, key_cache, value_cache, page_table, slots, held, fresh, starts})
    TORCH_CHECK(t.device().is_cpu(), "paged_attention (CPU): tensors must be on the CPU");
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && key_cache.scalar_type() == torch::kFloat32 &&
                  value_cache.scalar_type() == torch::kFloat32,
              "paged_attention (CPU): fp32 query and caches only");
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 3 && value_cache.sizes() == key_cache.sizes(),
              "paged_attention (CPU): query [T, H, D], caches [slots, Hkv, D]");
  query = query.contiguous();
  key_cache = key_cache.contiguous();
  value_cache = value_cache.contiguous();
  page_table = page_table.to(torch::kInt64).contiguous();
  slots = slots.to(torch::kInt64).contiguous();
  held = held.to(torch::kInt64).contiguous();
  fresh = fresh.to(torch::kInt64).contiguous();
  starts = starts.to(torch::kInt64).contiguous();
  const int64_t H = query.size(1), D = query.size(2), Hkv = key_cache.size(1);
  TORCH_CHECK(key_cache.size(2) == D && H % Hkv == 0, "paged_attention (CPU): head sizes do not match");
  TORCH_CHECK(Hkv > 0 && page_size > 0 && page_table.dim() == 2, "paged_attention (CPU): bad head or page sizes");
  const int64_t group = H / Hkv, width = page_table.size(1), batch = slots.size(0);
  TORCH_CHECK(held.numel() >= batch && fresh.numel() >= batch && starts.numel() >= batch,
              "paged_attention (CPU): held, new and starts need one entry per sequence");
  {  // every read and write below stays inside its tensor (O(batch) checks; the page ids: O(pages))
    const int64_t* t = page_table.data_ptr<int64_t>();
    const int64_t pool_pages = key_cache.size(0) / page_size;
    for (int64_t i = 0; i < page_table.numel(); ++i)
      TORCH_CHECK(t[i] >= 0 && t[i] < pool_pages, "paged_attention (CPU): a page id outside the pool");
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t s_b = slots.data_ptr<int64_t>()[b], h_b = held.data_ptr<int64_t>()[b];
      const int64_t n_b = fresh.data_ptr<int64_t>()[b], st_b = starts.data_ptr<int64_t>()[b];
      TORCH_CHECK(s_b >= 0 && s_b < page_table.size(0), "paged_attention (CPU): a slot outside the page table");
      TORCH_CHECK(h_b >= 0 && n_b >= 0 && h_b + n_b <= width * page_size,
                  "paged_attention (CPU): a sequence longer than its page-table row");
      TORCH_CHECK(n_b == 0 || (st_b >= 0 && st_b + n_b <= query.size(0)),
                  "paged_attention (CPU): a sequence's new tokens outside the query");
    }
  }
  const float scale = static_cast<float>(scaling);
  auto out = torch::empty_like(query);
  const float* q_all = query.data_ptr<float>();
  const float* k_all = key_cache.data_ptr<float>();
  const float* v_all = value_cache.data_ptr<float>();
  float* o_all = out.data_ptr<float>();
  const int64_t* table = page_table.data_ptr<int64_t>();
  const int64_t* slot_of_row = slots.data_ptr<int64_t>();
  const int64_t* held_of = held.data_ptr<int64_t>();
  const int64_t* new_of = fresh.data_ptr<int64_t>();
  const int64_t* start_of = starts.data_ptr<int64_t>();

  at::parallel_for(0, batch * Hkv, 1, [&](int64_t lo, int64_t hi) {
    std::vector<int64_t> where;  // pool row of each key position of the sequence
    std::vector<float> scores, tile;
    std::vector<const float*> q_rows;
    std::vector<float*> out_rows;
    std::vector<int64_t> limit;
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t b = item / Hkv, kv_head = item % Hkv;
      const int64_t n = new_of[b], before = held_of[b], total = before + n;
      if (n <= 0) continue;
      const int64_t* pages = table + slot_of_row[b] * width;
      where.resize(total);
      for (int64_t p = 0; p < total; ++p) where[p] = (pages[p / page_size] * page_size + p % page_size) * Hkv + kv_head;
      if (n > 1) {  // several new tokens: all their query rows of this KV head at once
        q_rows.resize(n * group);
        out_rows.resize(n * group);
        limit.resize(n * group);
        for (int64_t c = 0; c < n; ++c)
          for (int64_t g = 0; g < group; ++g) {
            const int64_t r = c * group + g, at = (start_of[b] + c) * H + kv_head * group + g;
            q_rows[r] = q_all + at * D;
            out_rows[r] = o_all + at * D;
            limit[r] = causal ? before + c + 1 : total;
          }
        many_rows(n * group, total, D, scale, q_rows.data(), limit.data(), where.data(), k_all, v_all,
                  out_rows.data(), scores, tile);
        continue;
      }
      scores.resize(total);
      for (int64_t c = 0; c < n; ++c) {
        const int64_t keys = causal ? before + c + 1 : total;
        const int64_t token = start_of[b] + c;
        for (int64_t g = 0; g < group; ++g) {
          const int64_t head = kv_head * group + g;
          const float* q = q_all + (token * H + head) * D;
          float peak = -std::numeric_limits<float>::infinity();
          for (int64_t p = 0; p < keys; ++p) {
            const float* k = k_all + where[p] * D;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += q[d] * k[d];
            scores[p] = dot * scale;
            peak = std::max(peak, scores[p]);
          }
          float* e = scores.data();
#pragma omp simd
          for (int64_t p = 0; p < keys; ++p) e[p] = expf(e[p] - peak);
          float sum = 0.f;
          for (int64_t p = 0; p < keys; ++p) sum += e[p];
          float* o = o_all + (token * H + head) * D;
          for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
          const float inv = 1.f / sum;
          for (int64_t p = 0; p < keys; ++p) {
            const float w = scores[p] * inv;
            const float* v = v_all + where[p] * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) o[d] += w * v[d];
          }
        }
      }
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the GIL is released while it runs: a server's HTTP thread keeps going beside the engine's steps
  m.def("paged_attention", &paged_attention, "attention of a packed ragged batch over a paged KV pool (CPU, fp32)",
        py::call_guard<py::gil_scoped_release>());
}
