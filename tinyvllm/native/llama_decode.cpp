// One whole decode step of a Llama-family model in one call (see llama_decode.py).

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <utility>

#include "common.h"

using namespace tv;

// The CPU counterpart of a captured CUDA graph: the runner hands over pointers to every weight
// and KV tensor once, and each decode step is then a single call (no per-op dispatch). Each
// stage calls the same kernels the per-layer path uses, so both give identical bits.

extern "C" {

struct TvLayer {
  const void* in_norm;
  const void* post_norm;
  const void* qkv_w;
  const void* qkv_b;
  const void* o_w;
  const void* o_b;
  const void* gate_up_w;
  const void* gate_up_b;
  const void* down_w;
  const void* down_b;
  const void* q_norm;  // per-head norms (Qwen3), may be null
  const void* k_norm;
  void* kv_cache;  // [2][num_blocks][block_size][hkv][head_dim]
  int64_t window;  // sliding window, 0 = full attention
  int qkv_fmt, o_fmt, gate_up_fmt, down_fmt;  // weight format codes (quant_kernels.cpp)
  // Gemma's sandwich norms (null for Llama): with pre_ff_norm, post_norm normalises the
  // attention output before the residual add and pre_ff_norm the sum; post_ff_norm the MLP's.
  const void* pre_ff_norm;
  const void* post_ff_norm;
  const float* cos_c;  // this layer's rope tables (null: the model's)
  const float* sin_c;
  // kLayerShortConv (LFM2) replaces attention with a gated short convolution: qkv_w holds
  // in_proj (hidden -> B, C, x), o_w out_proj; conv_w [hidden][conv_k] the depthwise kernel,
  // conv_state [slots][hidden][conv_k - 1] each request's last conv_k - 1 inputs B * x.
  int kind;
  int64_t conv_k;
  const void* conv_w;
  const void* conv_b;
  void* conv_state;
};

struct TvModel {
  int dt;  // activation, weight and cache dtype
  int nthreads;
  int64_t num_layers, hidden, hq, hkv, head_dim, rot, inter, num_blocks, block_size;
  float eps, scale;
  const void* embed;  // [vocab][hidden]
  const void* final_norm;
  const float* cos_c;
  const float* sin_c;
  const TvLayer* layers;
  int embed_fmt;
  int act;            // MLP gate activation: 0 SiLU, 1 GeLU-tanh
  float embed_scale;  // embedding rows times this, rounded to dt (Gemma); 1: none
  void* workspace;  // tv_llama_workspace_bytes(B) bytes or more, owned by the caller
  int64_t workspace_bytes;
};

// In-place RMSNorm of every head of strided rows (Qwen3's per-head q/k norms).
void tv_head_norm(void* x, int64_t stride, int64_t heads, int64_t d, const void* w, int dt,
                  int64_t T, float eps) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t o = t * stride + h * d;
      double ss = 0.0;
      for (int64_t i = 0; i < d; ++i) {
        float v = load(x, o + i, dt);
        ss += static_cast<double>(v) * v;
      }
      const float inv = 1.0f / sqrtf(static_cast<float>(ss / d) + eps);
      for (int64_t i = 0; i < d; ++i)
        store(x, o + i, load(w, i, dt) * as_dtype(load(x, o + i, dt) * inv, dt), dt);
    }
}

namespace {

constexpr int kOk = 0;
constexpr int kErrWorkspace = 1;  // abi.STATUS_WORKSPACE_TOO_SMALL
constexpr int kErrNoStateSlots = 2;  // abi.STATUS_NO_STATE_SLOTS
constexpr int kLayerShortConv = 1;   // abi.LAYER_SHORT_CONV (0: attention)

int64_t align64(int64_t n) { return (n + 63) / 64 * 64; }

// Norms, SiLU * up and rope run the kernels the model's layers run on the same rows (the
// Python side, NativeCpuOps, takes the AVX-512 row kernels wherever they run): the program
// stays bit-identical to the layers, and a 40-row step's SiLU takes 0.05 ms, not 0.4.
bool row_kernels() {
  static const bool ok = tv_rows_supported() != 0;
  return ok;
}

void rms_norm(const TvModel* m, const void* x, void* residual, const void* w, void* out,
              int64_t B) {
  if (row_kernels())
    tv_rows_rms_norm(x, residual, w, out, m->dt, B, m->hidden, m->eps, m->nthreads, nullptr);
  else
    tv_rms_norm(x, residual, w, out, m->dt, B, m->hidden, m->eps);
}

void silu_mul(const TvModel* m, const void* x, void* out, int64_t B) {
  if (row_kernels())
    tv_rows_silu_mul(x, out, m->dt, B, m->inter, m->nthreads, nullptr);
  else
    tv_silu_mul(x, out, m->dt, B, m->inter);
}

void rope(const TvModel* m, const TvLayer& L, void* q, void* k, int64_t W, int64_t B,
          const int64_t* positions) {
  const float* c = L.cos_c ? L.cos_c : m->cos_c;
  const float* s = L.sin_c ? L.sin_c : m->sin_c;
  if (row_kernels())
    tv_rows_rope(q, W, m->hq, k, W, m->hkv, m->dt, B, m->head_dim, m->rot, positions, c, s,
                 m->nthreads, nullptr);
  else
    tv_rope(q, W, m->hq, k, W, m->hkv, m->dt, B, m->head_dim, m->rot, positions, c, s);
}

// Widths of the mixer's input (qkv, or a short conv's B, C, x) and output (attn) buffers.
int64_t mixer_in_width(const TvModel* m) {
  const int64_t w = (m->hq + 2 * m->hkv) * m->head_dim;
  return w > 3 * m->hidden ? w : 3 * m->hidden;
}

int64_t mixer_out_width(const TvModel* m) {
  const int64_t w = m->hq * m->head_dim;
  return w > m->hidden ? w : m->hidden;
}

// Bytes of the activation buffers of a B-token step (one slab: hidden, residual, normed, qkv,
// attn, gate_up, act), then the per-token index arrays, each 64-byte aligned.
int64_t activation_bytes(const TvModel* m, int64_t B) {
  const int64_t elem = m->dt ? 2 : 4;
  return align64(elem * B * (3 * m->hidden + mixer_in_width(m) + mixer_out_width(m) +
                             3 * m->inter));
}

// LFM2's gated short conv over the B, C, x rows of `bcx` (stride `stride`) of R requests, each
// request's tokens in order: y = C * conv(B * x), the conv reading the request's state slot
// (zeroed first when the request starts from scratch) and leaving its last K - 1 inputs there.
// Rounds as ShortConv's torch path: B * x and the fp32 tap sum (taps in order, then the bias)
// to the dtype, then C * y.
void short_conv(const TvLayer& L, int dt, int64_t H, int64_t R, const int32_t* query_start_loc,
                const int64_t* state_slots, const uint8_t* has_initial, const void* bcx,
                int64_t stride, void* out, int64_t out_stride) {
  const int64_t K = L.conv_k, S = K - 1, elem = dt ? 2 : 4;
  for (int64_t r = 0; r < R; ++r) {
    void* state = static_cast<char*>(L.conv_state) + state_slots[r] * H * S * elem;
    if (!has_initial[r]) memset(state, 0, H * S * elem);
    for (int64_t t = query_start_loc[r]; t < query_start_loc[r + 1]; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t row = t * stride;
        const float bx = as_dtype(load(bcx, row + h, dt) * load(bcx, row + 2 * H + h, dt), dt);
        const int64_t s = h * S, w = h * K;
        float acc = load(state, s, dt) * load(L.conv_w, w, dt);
        for (int64_t k = 1; k < S; ++k) acc += load(state, s + k, dt) * load(L.conv_w, w + k, dt);
        acc += bx * load(L.conv_w, w + S, dt);
        if (L.conv_b) acc += load(L.conv_b, h, dt);
        for (int64_t k = 0; k + 1 < S; ++k) store(state, s + k, load(state, s + k + 1, dt), dt);
        store(state, s + S - 1, bx, dt);
        const float c = load(bcx, row + H + h, dt);
        store(out, t * out_stride + h, c * as_dtype(acc, dt), dt);
      }
  }
}

// A layer's attention: normed -> qkv (per-head norms, rope) -> paged KV -> attn -> o_proj into
// `hidden`.
void attention(const TvModel* m, const TvLayer& L, int64_t B, const void* normed,
               const int64_t* positions, const int64_t* slots, const int64_t* tok,
               const int64_t* tok_row, const int32_t* tok_len, const int32_t* block_table,
               int64_t bt_stride, void* qkv, void* attn, void* hidden) {
  const int dt = m->dt, nt = m->nthreads;
  const int64_t elem = dt ? 2 : 4, H = m->hidden, D = m->head_dim;
  const int64_t qs = m->hq * D, kvs = m->hkv * D, W = qs + 2 * kvs;
  tv_linear_any(normed, dt, L.qkv_w, L.qkv_fmt, L.qkv_b, dt, qkv, B, W, H, nt);
  char* q = static_cast<char*>(qkv);
  char* k = q + qs * elem;
  char* v = k + kvs * elem;
  if (L.q_norm) tv_head_norm(q, W, m->hq, D, L.q_norm, dt, B, m->eps);
  if (L.k_norm) tv_head_norm(k, W, m->hkv, D, L.k_norm, dt, B, m->eps);
  rope(m, L, q, k, W, B, positions);
  char* cache = static_cast<char*>(L.kv_cache);
  const int64_t half = m->num_blocks * m->block_size * kvs * elem;
  tv_store_kv(k, W, v, W, B, kvs, static_cast<int>(elem), cache, cache + half, slots);
  tv_paged_decode(q, W, attn, dt, B, tok, tok_row, tok_len, nullptr, block_table, bt_stride,
                  cache, m->num_blocks, m->block_size, m->hq, m->hkv, D, m->scale, L.window,
                  0.0f, nt);
  tv_linear_any(attn, dt, L.o_w, L.o_fmt, L.o_b, dt, hidden, B, H, qs, nt);
}

}  // namespace

int tv_abi_version(void) { return TV_ABI_VERSION; }

// The workspace a B-token step needs (the caller allocates it once per program and grows it
// when batches grow): the step's own buffers are never allocated per call; the kernels it
// runs take small scratch through checked_malloc / checked_aligned_alloc (common.h).
int64_t tv_llama_workspace_bytes(const TvModel* m, int64_t B) {
  return activation_bytes(m, B) + align64(sizeof(int64_t) * 2 * B) + align64(sizeof(int32_t) * B);
}

// B flattened tokens of R requests (query_start_loc [R + 1]); every token attends causally up
// to its own position, so decode, K + 1 verify and short prefill chunks all fit.
// hidden_out [B][hidden] receives the final normed hidden states. Short-conv layers read
// request r's state from slot state_slots[r], zeroed first unless has_initial[r]. Returns kOk,
// kErrWorkspace (nothing computed) when m->workspace is smaller than B tokens need, or
// kErrNoStateSlots (nothing computed) when a model with short-conv layers gets no slots.
int tv_llama_decode(const TvModel* m, int64_t B, int64_t R, const int64_t* input_ids,
                    const int64_t* positions, const int64_t* slots,
                    const int32_t* query_start_loc, const int32_t* block_table,
                    int64_t bt_stride, const int64_t* state_slots, const uint8_t* has_initial,
                    void* hidden_out) {
  if (m->workspace == nullptr || m->workspace_bytes < tv_llama_workspace_bytes(m, B))
    return kErrWorkspace;
  for (int64_t l = 0; l < m->num_layers; ++l)
    if (m->layers[l].kind == kLayerShortConv && (!state_slots || !has_initial))
      return kErrNoStateSlots;
  const int dt = m->dt, nt = m->nthreads;
  const int64_t elem = dt ? 2 : 4, H = m->hidden;
  const int64_t in_w = mixer_in_width(m), out_w = mixer_out_width(m);
  char* buf = static_cast<char*>(m->workspace);
  void* hidden = buf;
  void* residual = buf + elem * B * H;
  void* normed = buf + elem * B * 2 * H;
  void* qkv = buf + elem * B * 3 * H;
  void* attn = static_cast<char*>(qkv) + elem * B * in_w;
  void* gate_up = static_cast<char*>(attn) + elem * B * out_w;
  void* act = static_cast<char*>(gate_up) + elem * B * 2 * m->inter;
  int64_t* tok = reinterpret_cast<int64_t*>(buf + activation_bytes(m, B));
  int64_t* tok_row = tok + B;
  int32_t* tok_len = reinterpret_cast<int32_t*>(buf + activation_bytes(m, B) +
                                                align64(sizeof(int64_t) * 2 * B));
  for (int64_t r = 0; r < R; ++r)
    for (int64_t t = query_start_loc[r]; t < query_start_loc[r + 1]; ++t) tok_row[t] = r;
  for (int64_t b = 0; b < B; ++b) {
    tok[b] = b;
    tok_len[b] = static_cast<int32_t>(positions[b] + 1);
  }
  tv_embedding_any(m->embed, m->embed_fmt, input_ids, B, H, residual, dt);
  if (m->embed_scale != 1.0f) {
    // As HF: the scale rounded to the dtype first, then one rounded product.
    const float scale = as_dtype(m->embed_scale, dt);
    for (int64_t i = 0; i < B * H; ++i) store(residual, i, load(residual, i, dt) * scale, dt);
  }
  for (int64_t l = 0; l < m->num_layers; ++l) {
    const TvLayer& L = m->layers[l];
    // The first layer's residual is the embedding itself: normalise without the add.
    if (l == 0)
      rms_norm(m, residual, nullptr, L.in_norm, normed, B);
    else
      rms_norm(m, hidden, residual, L.in_norm, normed, B);
    if (L.kind == kLayerShortConv) {
      tv_linear_any(normed, dt, L.qkv_w, L.qkv_fmt, L.qkv_b, dt, qkv, B, 3 * H, H, nt);
      short_conv(L, dt, H, R, query_start_loc, state_slots, has_initial, qkv, 3 * H, attn, H);
      tv_linear_any(attn, dt, L.o_w, L.o_fmt, L.o_b, dt, hidden, B, H, H, nt);
    } else {
      attention(m, L, B, normed, positions, slots, tok, tok_row, tok_len, block_table,
                bt_stride, qkv, attn, hidden);
    }
    if (L.pre_ff_norm) {
      rms_norm(m, hidden, nullptr, L.post_norm, normed, B);
      rms_norm(m, normed, residual, L.pre_ff_norm, hidden, B);
      std::swap(hidden, normed);  // normed: the MLP input; hidden: free for its output
    } else {
      rms_norm(m, hidden, residual, L.post_norm, normed, B);
    }
    tv_linear_any(normed, dt, L.gate_up_w, L.gate_up_fmt, L.gate_up_b, dt, gate_up, B,
                  2 * m->inter, H, nt);
    if (m->act == 1)
      tv_gelu_tanh_mul(gate_up, act, dt, B, m->inter);
    else
      silu_mul(m, gate_up, act, B);
    tv_linear_any(act, dt, L.down_w, L.down_fmt, L.down_b, dt, hidden, B, H, m->inter, nt);
    if (L.post_ff_norm) {
      rms_norm(m, hidden, nullptr, L.post_ff_norm, normed, B);
      std::swap(hidden, normed);
    }
  }
  rms_norm(m, hidden, residual, m->final_norm, hidden_out, B);
  return kOk;
}

}  // extern "C"
