// The non-expert weights carved from the arena (bf16, INT8 or INT4, quantised
// at load on the host's threads), the workspace, and the experts' host source.
#include "cuda_engine/engine_impl.h"

namespace moe {

namespace {

// Rows of a Linear [out, in] as bf16 bits, appended to `out`.
void append_bf16_rows(const Linear& L, std::vector<uint16_t>& out) {
  const size_t at = out.size();
  out.resize(at + size_t(L.out) * L.in);
  uint16_t* dst = out.data() + at;
  if (L.bf16) {
    std::memcpy(dst, L.bf16, size_t(L.out) * L.in * 2);
    return;
  }
  std::vector<float> row(size_t(L.in));
  for (int r = 0; r < L.out; ++r) {
    L.row(r, row.data());
    for (int c = 0; c < L.in; ++c) dst[size_t(r) * L.in + c] = f32_to_bf16(row[size_t(c)]);
  }
}

// Runs work(r0, n) over slabs of `rows` rows on the host's threads (at
// most 16): quantising a checkpoint's dense matrices at load.
template <typename Work>
void for_row_slabs(int rows, Work work) {
  const int threads = int(std::clamp(std::thread::hardware_concurrency(), 1u, 16u));
  constexpr int kSlab = 256;
  const int slabs = (rows + kSlab - 1) / kSlab;
  std::atomic<int> next{0};
  auto run = [&] {
    for (int i = next++; i < slabs; i = next++) work(i * kSlab, std::min(kSlab, rows - i * kSlab));
  };
  std::vector<std::thread> team;
  for (int t = 1; t < std::min(threads, slabs); ++t) team.emplace_back(run);
  run();
  for (std::thread& t : team) t.join();
}

// Symmetric INT8 per row: q = round(w / scale), scale = max|row| / 127.
void quantize_rows_i8_host(const uint16_t* w, int rows, int cols, int8_t* q, float* scale) {
  for_row_slabs(rows, [&](int r0, int n) {
    for (int r = r0; r < r0 + n; ++r) {
      const uint16_t* row = w + size_t(r) * cols;
      float mx = 0.f;
      for (int c = 0; c < cols; ++c) mx = std::max(mx, std::abs(bf16_to_f32(row[c])));
      const float sc = mx > 0.f ? mx / 127.f : 1.f;
      scale[r] = sc;
      for (int c = 0; c < cols; ++c)
        q[size_t(r) * cols + c] = int8_t(std::lrintf(std::clamp(bf16_to_f32(row[c]) / sc, -127.f, 127.f)));
    }
  });
}

// Quantises bf16 rows into an INT4 matrix (model/int4.h).
void quantize_rows_q4_host(const uint16_t* w, const Q4MatrixLayout& m, uint8_t* blob) {
  for_row_slabs(m.rows, [&](int r0, int n) {
    std::vector<float> f(size_t(n) * m.cols);
    const uint16_t* src = w + size_t(r0) * m.cols;
    for (size_t j = 0; j < f.size(); ++j) f[j] = bf16_to_f32(src[j]);
    q4_quantize_matrix(f.data(), q4_row_slice(m, r0, n), blob);
  });
}

}  // namespace

Status CudaEngine::Impl::carve_weights(Carver& c, bool upload) {
  const ModelWeights& w = *host_weights;
  lm_head = DenseW{};
  bool head_is_embed = false;  // a tied bf16 lm_head is the embedding, stored once
  std::vector<uint16_t> buf;
  auto put = [&](bf16** dst, const std::vector<uint16_t>& data) -> Status {
    *dst = c.take<bf16>(data.size());
    if (upload && !data.empty())
      MOE_CUDA_TRY(cudaMemcpy(*dst, data.data(), data.size() * 2, cudaMemcpyHostToDevice));
    return {};
  };
  // The same sizes in the measuring pass, without converting anything.
  auto reserve = [&](bf16** dst, size_t elems) { *dst = c.take<bf16>(elems); };
  // A dense matrix made of `parts` stacked by rows (+ pad_rows zero rows),
  // in `dense`'s dtype. Matrices whose outputs are compared rather than
  // summed on (`keep_int8`: the router's rows, lm_head) never go below INT8:
  // INT4's rounding would flip which experts a token gets and reorder the
  // vocabulary's close candidates.
  // `keep_int8` 2: the router's rows with --router-weights bf16: never
  // below bf16 (routing left exactly as the checkpoint computes it).
  auto linear_parts = [&](DenseW* dst, const std::vector<const Linear*>& parts, size_t pad_rows,
                          int keep_int8) -> Status {
    *dst = DenseW{};  // nothing of an earlier measuring pass (other dtype) survives
    const int cols = parts.front()->in;
    int rows = int(pad_rows);
    for (const Linear* p : parts) rows += p->out;
    dst->rows = rows;
    dst->cols = cols;
    // The parts' rows as bf16 bits in buf, zero rows after (uploads only).
    auto stack_rows = [&] {
      buf.clear();
      for (const Linear* p : parts) append_bf16_rows(*p, buf);
      buf.resize(dst->elems(), 0);
    };
    // The INT4 GEMV reads 32-input runs of a row, each inside one group, and
    // stages its input in shared memory: a width not a multiple of 32, or
    // too wide for 8 tokens' staging, goes to INT8 instead.
    if (dense == DenseDtype::int4 && !keep_int8 && cols % 32 == 0 &&
        cols <= cuda::dense_gemv_q4_max_k(cuda::kGemvMaxTokens)) {
      dequant_elems = std::max(dequant_elems, dst->elems());
      dst->q4m = q4_matrix_layout(rows, cols, kDenseQ4Group);
      auto* blob = c.take<uint8_t>(q4_matrix_bytes(dst->q4m));
      dst->q4 = blob;
      if (!upload) return {};
      stack_rows();
      std::vector<uint8_t> host(q4_matrix_bytes(dst->q4m));
      quantize_rows_q4_host(buf.data(), dst->q4m, host.data());
      MOE_CUDA_TRY(cudaMemcpy(blob, host.data(), host.size(), cudaMemcpyHostToDevice));
      return {};
    }
    // The INT8 GEMV reads 16-byte runs of a row: a width not a multiple of
    // 16 keeps that matrix in bf16.
    if (dense != DenseDtype::bf16 && keep_int8 != 2 && cols % 16 == 0) {
      dequant_elems = std::max(dequant_elems, dst->elems());
      auto* qd = c.take<int8_t>(dst->elems());
      auto* sd = c.take<float>(size_t(rows));
      dst->q = qd;
      dst->scale = sd;
      if (!upload) return {};
      stack_rows();
      std::vector<int8_t> qh(dst->elems());
      std::vector<float> sh(static_cast<size_t>(rows));
      quantize_rows_i8_host(buf.data(), rows, cols, qh.data(), sh.data());
      MOE_CUDA_TRY(cudaMemcpy(qd, qh.data(), qh.size(), cudaMemcpyHostToDevice));
      MOE_CUDA_TRY(cudaMemcpy(sd, sh.data(), sh.size() * 4, cudaMemcpyHostToDevice));
      return {};
    }
    bf16* wd = nullptr;
    if (!upload) {
      reserve(&wd, dst->elems());
      dst->w = wd;
      return {};
    }
    stack_rows();
    Status st = put(&wd, buf);
    dst->w = wd;
    return st;
  };
  auto linear = [&](DenseW* dst, std::initializer_list<const Linear*> parts, size_t pad_rows,
                    int keep_int8 = 0) -> Status {
    return linear_parts(dst, std::vector<const Linear*>(parts), pad_rows, keep_int8);
  };
  auto vec = [&](bf16** dst, const std::vector<float>& v) -> Status {
    if (v.empty()) {
      *dst = nullptr;
      return {};
    }
    if (!upload) {
      reserve(dst, v.size());
      return {};
    }
    return put(dst, bf16_of(v));
  };

  // MLA attention (docs/cuda-mla.md): the first projection q | kv_a in
  // `dense`'s dtype; the latent's norm; kv_b_proj cut into W_UK^T and W_UV
  // per head, bf16 (2 M weights a layer at V2-Lite's shape).
  auto mla_weights = [&](DevLayer& L, const LayerWeights& lw) -> Status {
    const MlaConfig& m = d.mla;
    const int nh = d.n_heads, R = m.kv_lora_rank, nope = m.qk_nope_head_dim, vd = m.v_head_dim;
    if (!lw.q.present() || !lw.kv_a.present() || !lw.kv_b.present() || lw.kv_a.out != R + m.qk_rope_head_dim ||
        lw.kv_b.out != nh * (nope + vd) || lw.kv_b.in != R)
      return make_error("latent attention weights (q_proj, kv_a_proj_with_mqa, kv_b_proj) missing or mis-shaped");
    MOE_TRY(linear(&L.qkv_w, {&lw.q, &lw.kv_a}, 0));
    MOE_TRY(vec(&L.kv_a_norm, lw.kv_a_norm));
    const size_t uk_elems = size_t(nh) * R * nope, uv_elems = size_t(nh) * vd * R;
    if (!upload) {
      reserve(&L.uk_t, uk_elems);
      reserve(&L.uv, uv_elems);
      return {};
    }
    std::vector<uint16_t> uk(uk_elems), uv(uv_elems);
    std::vector<float> row(static_cast<size_t>(R));
    for (int h = 0; h < nh; ++h)
      for (int r = 0; r < nope + vd; ++r) {
        lw.kv_b.row(h * (nope + vd) + r, row.data());
        for (int c = 0; c < R; ++c) {
          const uint16_t b = f32_to_bf16(row[size_t(c)]);
          if (r < nope)
            uk[(size_t(h) * R + c) * nope + r] = b;
          else
            uv[(size_t(h) * vd + (r - nope)) * R + c] = b;
        }
      }
    MOE_TRY(put(&L.uk_t, uk));
    return put(&L.uv, uv);
  };
  layers.resize(size_t(d.n_layers));
  for (int l = 0; l < d.n_layers; ++l) {
    const LayerWeights& lw = w.layers[size_t(l)];
    DevLayer& L = layers[size_t(l)];
    MOE_TRY(vec(&L.in_norm, lw.attn_norm));
    MOE_TRY(vec(&L.post_norm, lw.mlp_norm));
    if (mla) {
      MOE_TRY(mla_weights(L, lw));
    } else {
      MOE_TRY(linear(&L.qkv_w, {&lw.q, &lw.k, &lw.v}, 0));
      if (d.qkv_bias) {
        std::vector<float> b;
        for (const Linear* p : {&lw.q, &lw.k, &lw.v}) {
          if (p->bias.size() != size_t(p->out)) return make_error("layer " + std::to_string(l) + ": q/k/v bias missing");
          b.insert(b.end(), p->bias.begin(), p->bias.end());
        }
        MOE_TRY(vec(&L.qkv_b, b));
      }
    }
    MOE_TRY(vec(&L.q_norm, lw.q_norm));
    MOE_TRY(vec(&L.k_norm, lw.k_norm));
    MOE_TRY(linear(&L.o_w, {&lw.o}, 0));
    L.moe_index = d.moe_layer_index(l);
    const Mlp* mlp = nullptr;
    if (L.moe_index >= 0) {
      if (lw.shared.gate.present()) mlp = &lw.shared;
      L.mlp_gated = lw.shared_gate.present();
    } else {
      mlp = &lw.dense;
    }
    if (mlp) {
      // One projection of the normed state: gate | up (| gate logit) (|
      // router logits), rows padded to 8 (16-byte aligned output rows).
      L.mlp_inter = mlp->gate.out;
      std::vector<const Linear*> parts = {&mlp->gate, &mlp->up};
      if (L.mlp_gated) parts.push_back(&lw.shared_gate);
      int rows = 2 * L.mlp_inter + (L.mlp_gated ? 1 : 0);
      if (L.moe_index >= 0) {
        L.router_row = rows;
        parts.push_back(&lw.router);
        rows += n_experts;
      }
      L.mlp_rows = int(align_up(size_t(rows), 8));
      MOE_TRY(linear_parts(&L.mlp_gu_w, parts, size_t(L.mlp_rows - rows),
                                  L.router_row >= 0 ? (opts.router_bf16 ? 2 : 1) : 0));
      if (L.router_row >= 0) L.router_w = L.mlp_gu_w.slice(L.router_row, n_experts);
      MOE_TRY(linear(&L.mlp_down_w, {&mlp->down}, 0));
    } else if (L.moe_index >= 0) {
      MOE_TRY(linear(&L.router_w, {&lw.router}, 0, opts.router_bf16 ? 2 : 1));
    }
  }
  // The embedding is gathered by row, never multiplied: it stays bf16. Under
  // a budget it may stay in host memory (embed_host): a step reads one row a
  // token over the link (4 KiB at hidden 2048), and its GiB or so of rows
  // become islands. Not when a bf16 lm_head shares it.
  if (embed_host) {
    if (upload) {
      const size_t bytes = size_t(w.embed.out) * w.embed.in * 2;
      if (!embed_host_buf)
        MOE_CUDA_TRY(cudaHostAlloc(reinterpret_cast<void**>(&embed_host_buf), bytes, cudaHostAllocMapped));
      buf.clear();
      append_bf16_rows(w.embed, buf);
      std::memcpy(static_cast<void*>(embed_host_buf), buf.data(), bytes);
      void* dp = nullptr;
      MOE_CUDA_TRY(cudaHostGetDevicePointer(&dp, embed_host_buf, 0));
      embed = static_cast<bf16*>(dp);
    }
  } else {
    const DenseDtype was = dense;
    dense = DenseDtype::bf16;
    DenseW e;
    MOE_TRY(linear(&e, {&w.embed}, 0));
    embed = const_cast<bf16*>(e.w);
    dense = was;
    if (d.tie_embeddings && dense == DenseDtype::bf16) {
      lm_head = e;
      head_is_embed = true;  // (the measuring carve's pointers are null: test this, not lm_head)
    }
  }
  MOE_TRY(vec(&final_norm, w.final_norm));
  if (!head_is_embed) {
    const size_t before = dequant_elems;  // lm_head runs as GEMVs only
    MOE_TRY(linear(&lm_head, {d.tie_embeddings ? &w.embed : &w.lm_head}, 0, 1));
    dequant_elems = before;
  }
  return {};
}

void CudaEngine::Impl::carve_workspace(Carver& c) {
  x = c.take<float>(size_t(max_pass_tokens) * hidden);
  xn = c.take<bf16>(size_t(max_pass_tokens) * hidden);
  qkv = c.take<float>(size_t(max_pass_tokens) * qkv_width);
  q = c.take<bf16>(size_t(max_pass_tokens) * q_width);
  attn = c.take<bf16>(size_t(max_pass_tokens) * q_width);
  tmp = c.take<float>(size_t(max_pass_tokens) * hidden);
  if (n_moe_layers > 0) {
    router_logits = c.take<float>(size_t(max_pass_tokens) * n_experts);
    route_w = c.take<float>(size_t(max_pass_tokens) * top_k);
    route_ids = c.take<int32_t>(size_t(n_moe_layers) * max_pass_tokens * top_k);
    h = c.take<float>(h_rows * size_t(layout.inter));
    blob_tables = c.take<const uint8_t*>(size_t(n_moe_layers) * n_experts);
    if (grouped_ok) grouped_ws = c.take<uint8_t>(grouped_ws_bytes);
    hsum = c.take<float>(size_t(cuda::kGemvMaxTokens) * hidden);
    split_ids = c.take<int32_t>(size_t(cuda::kGemvMaxTokens) * top_k);
    guess_logits = c.take<float>(size_t(cuda::kGemvMaxTokens) * n_experts);
    guess_w = c.take<float>(size_t(cuda::kGemvMaxTokens) * top_k);
    guess_ids = c.take<int32_t>(size_t(cuda::kGemvMaxTokens) * top_k);
    on_gpu = c.take<uint8_t>(size_t(n_moe_layers) * n_experts);
    if (opts.stream_ahead && opts.misses == MissMode::stream) {
      stage_slot_bytes = align_up(layout.blob_bytes, 256);
      stage_slots = c.take<uint8_t>(size_t(2 * top_k) * stage_slot_bytes);
      host_blobs_dev = c.take<const uint8_t*>(size_t(n_moe_layers) * n_experts);
      stage_keys = c.take<int2>(size_t(2 * top_k));
      stage_arrived = c.take<uint32_t>(size_t(2 * top_k));
      stage_landed = c.take<uint32_t>(1);
      x_snap = c.take<float>(size_t(hidden));
      stage_reached = c.take<int32_t>(1);
    }
    share_rows = c.take<uint16_t>(size_t(kShareMaxTokens) * top_k + 1);
    share_split = c.take<int32_t>(size_t(kShareMaxTokens) * top_k);
    share_pass = c.take<uint32_t>(1);
    share_count = c.take<uint32_t>(size_t(n_moe_layers));
    share_ids = c.take<int32_t>(size_t(kShareMaxTokens) * top_k);
  }
  if (mlp_inter_max > 0) {
    gu = c.take<float>(size_t(max_pass_tokens) * gu_stride);
    mh = c.take<bf16>(size_t(max_pass_tokens) * mlp_inter_max);
  }
  xs = c.take<float>(size_t(kMaxSampleRows) * hidden);
  xsn = c.take<bf16>(size_t(kMaxSampleRows) * hidden);
  logits = c.take<float>(size_t(kMaxSampleRows) * vocab);
  sampled = c.take<int32_t>(kMaxSampleRows);
  adjust_entries = c.take<TokenAdjust>(kMaxPassAdjust);
  adjust_saved = c.take<float>(kMaxPassAdjust);
  mask_words = (vocab + 31) / 32;
  allow_masks = c.take<uint32_t>(size_t(kMaxSampleRows) * size_t(mask_words));
  inv_freq = c.take<float>(size_t(rot_dim / 2));
  if (mla) {
    q_abs = c.take<bf16>(size_t(max_pass_tokens) * d.n_heads * latent_width);
    o_lat = c.take<bf16>(size_t(max_pass_tokens) * d.n_heads * d.mla.kv_lora_rank);
    size_t partials = 0;
    for (int n = 1; n <= max_pass_tokens; ++n)  // at most 2,048 (token, head)s split: 512 blocks of 4 heads
      partials = std::max(partials, cuda::mla_partials_floats(n, d.n_heads, cuda::mla_splits(n, d.n_heads),
                                                              d.mla.kv_lora_rank));
    mla_partials = c.take<float>(std::max<size_t>(partials, 1));
  } else {
    // Decode attention over long contexts: key splits' states and counts.
    attn_partials = c.take<float>(cuda::attention_partials_floats(cuda::kGemvMaxTokens, d.n_heads,
                                                                  cuda::kAttentionMaxSplits, d.head_dim));
    attn_split_counts = c.take<uint32_t>(size_t(cuda::kGemvMaxTokens) * d.n_heads);
  }
  // The fused decode pass's room (~2 MiB at the Qwen3-30B shape and 32 K
  // keys), only where it is asked for: off, it costs no island.
  if (opts.fused_decode && !mla && n_moe_layers > 0 && n_moe_layers == d.n_layers) {
    const int blocks = std::max(1, sm_count);
    fused_layers = c.take<cuda::FusedLayer>(size_t(d.n_layers));
    fused.attn = c.take<float>(size_t(q_width));
    fused.max_splits = cuda::fused_decode_max_splits(max_context, d.n_kv_heads, blocks);
    fused.partials = c.take<float>(cuda::fused_decode_partials_floats(max_context, d.n_kv_heads, d.n_heads,
                                                                     d.head_dim, blocks));
    fused.counts = c.take<uint32_t>(size_t(d.n_kv_heads));
    fused.barrier = c.take<uint32_t>(1);
    fused.h = c.take<float>(size_t(top_k) * layout.inter);
    if (opts.bench_fused_stamps) fused.stamps = c.take<uint64_t>(1 + size_t(d.n_layers) * cuda::kFusedPhases * 2);
  }
  pack_dev = c.take<uint8_t>(pack_bytes);
  trace_dev = trace_host.empty() ? nullptr : c.take<int16_t>(trace_host.size());
  dequant = dense != DenseDtype::bf16 ? c.take<bf16>(dequant_elems) : nullptr;
}

// Lets go of the process' pages of a mapped range it has read (a file
// mapping: they stay in the page cache, reclaimable, and fault back in if
// touched again), so that reading a checkpoint does not add it to the RSS.
static void release_mapped(const void* p, size_t n) {
  if (!p || n == 0) return;
  const uintptr_t page = uintptr_t(sysconf(_SC_PAGESIZE));
  const uintptr_t lo = uintptr_t(p) / page * page, hi = (uintptr_t(p) + n + page - 1) / page * page;
  (void)::madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);
}

Status CudaEngine::Impl::expert_source(ExpertHostSource& src) {
  src.n_layers = n_moe_layers;
  src.n_experts = n_experts;
  src.blob_bytes = layout.blob_bytes;
  src.blobs.resize(size_t(n_moe_layers) * n_experts);
  if (host_weights->experts_q4) {
    for (int l = 0; l < d.n_layers; ++l)
      if (const int ml = d.moe_layer_index(l); ml >= 0)
        for (int e = 0; e < n_experts; ++e) src.blobs[size_t(ml) * n_experts + e] = host_weights->layers[size_t(l)].experts[size_t(e)].q4;
    return {};
  }
  // A checkpoint with float experts: quantised now, on every core, into one
  // page-locked block for all of them (the arena uses it where it lies, no
  // second copy); each layer's float pages are let go once read, so the host
  // holds the INT4 experts and about one layer of the float model at a time.
  const size_t total = size_t(n_moe_layers) * n_experts * layout.blob_bytes;
  MOE_CUDA_TRY(cudaHostAlloc(reinterpret_cast<void**>(&pinned_experts), total,
                             cudaHostAllocPortable | cudaHostAllocMapped));
  src.pinned_base = pinned_experts;
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  const auto t0 = std::chrono::steady_clock::now();
  double last_said = -10;
  int done_layers = 0;
  for (int l = 0; l < d.n_layers; ++l) {
    const int ml = d.moe_layer_index(l);
    if (ml < 0) continue;
    const LayerWeights& lw = host_weights->layers[size_t(l)];
    std::atomic<int> next{0};
    auto work = [&] {
      std::vector<float> g;
      for (int e = next++; e < n_experts; e = next++) {
        const Mlp& m = lw.experts[size_t(e)];
        uint8_t* blob = pinned_experts + (size_t(ml) * n_experts + e) * layout.blob_bytes;
        std::memset(blob, 0, layout.blob_bytes);
        for (auto [lin, ml_layout] : {std::pair{&m.gate, &layout.gate}, std::pair{&m.up, &layout.up},
                                      std::pair{&m.down, &layout.down}}) {
          g.resize(size_t(lin->out) * lin->in);
          for (int row = 0; row < lin->out; ++row) lin->row(row, g.data() + size_t(row) * lin->in);
          q4_quantize_matrix(g.data(), *ml_layout, blob);
          release_mapped(lin->bf16 ? static_cast<const void*>(lin->bf16) : lin->f32,
                         size_t(lin->out) * lin->in * (lin->bf16 ? 2 : 4));
        }
        src.blobs[size_t(ml) * n_experts + e] = blob;
      }
    };
    std::vector<std::thread> team;
    for (unsigned t = 1; t < threads; ++t) team.emplace_back(work);
    work();
    for (auto& t : team) t.join();
    ++done_layers;
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s - last_said >= 2.0 || done_layers == n_moe_layers) {
      last_said = s;
      std::fprintf(stderr, "moe-worker: experts to INT4 (group %d): %d of %d layers (%d %%), %.1f s\n",
                   layout.group, done_layers, n_moe_layers, done_layers * 100 / n_moe_layers, s);
    }
  }
  return {};
}

}  // namespace moe
