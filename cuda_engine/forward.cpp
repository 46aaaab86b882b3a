// One forward pass on the GPU: embedding, attention, the MoE layer and its
// experts, the dense GEMVs, the final norm, lm_head and sampling.
#include "cuda_engine/engine_impl.h"

namespace moe {

Status CudaEngine::Impl::gemv(const DenseW& mat, const bf16* xin, float* y, int n, bool acc, const float* gate,
                              int gate_stride) {
  if (mat.q4) return cuda::dense_gemv_q4(mat.q4, mat.q4m, xin, y, n, acc, gate, gate_stride, st);
  if (mat.q) return cuda::dense_gemv_i8(mat.q, mat.scale, xin, y, n, mat.rows, mat.cols, acc, gate, gate_stride, st);
  return cuda::dense_gemv_bf16(mat.w, xin, y, n, mat.rows, mat.cols, acc, gate, gate_stride, st);
}

Status CudaEngine::Impl::gemv_rmsnorm(const DenseW& mat, const float* xf, const bf16* norm_w, bf16* xn_out, float* y,
                                      int n) {
  if (mat.q4)
    return cuda::dense_gemv_q4_rmsnorm(mat.q4, mat.q4m, xf, norm_w, d.rms_eps, xn_out, y, n, false, nullptr, 0, st);
  if (mat.q)
    return cuda::dense_gemv_i8_rmsnorm(mat.q, mat.scale, xf, norm_w, d.rms_eps, xn_out, y, n, mat.rows, mat.cols, false,
                                       nullptr, 0, st);
  return cuda::dense_gemv_bf16_rmsnorm(mat.w, xf, norm_w, d.rms_eps, xn_out, y, n, mat.rows, mat.cols, false, nullptr, 0, st);
}

Status CudaEngine::Impl::gemv_silu(const DenseW& mat, const float* gu_in, int stride, float* y, int n,
                                   const float* gate) {
  if (mat.q4) return cuda::dense_gemv_q4_silu(mat.q4, mat.q4m, gu_in, stride, y, n, true, gate, stride, st);
  if (mat.q)
    return cuda::dense_gemv_i8_silu(mat.q, mat.scale, gu_in, stride, y, n, mat.rows, mat.cols, true, gate, stride, st);
  return cuda::dense_gemv_bf16_silu(mat.w, gu_in, stride, y, n, mat.rows, mat.cols, true, gate, stride, st);
}

Status CudaEngine::Impl::project(const DenseW& mat, const bf16* xin, float* y, int n, bool acc) {
  if (n <= cuda::kGemvMaxTokens) return gemv(mat, xin, y, n, acc, nullptr, 0);
  const bf16* w = mat.w;
  if (mat.q4) {
    MOE_TRY(cuda::dequantize_q4(mat.q4, mat.q4m, dequant, st));
    w = dequant;
  } else if (mat.q) {
    MOE_TRY(cuda::dequantize_rows_i8(mat.q, mat.scale, mat.rows, mat.cols, dequant, st));
    w = dequant;
  }
  return mm->matmul(xin, w, y, true, n, mat.rows, mat.cols, acc ? 1.f : 0.f, st);
}

Status CudaEngine::Impl::mlp(const DevLayer& L, int n, bool fuse) {
  // SiLU(gate) * up, then down (scaled by the shared expert's gate), added to the residual.
  const bool small = n <= cuda::kGemvMaxTokens;
  const int I = L.mlp_inter;
  const float* gate = L.mlp_gated ? gu + 2 * I : nullptr;
  if (fuse) return gemv_silu(L.mlp_down_w, gu, L.mlp_rows, x, n, gate);
  MOE_TRY(cuda::silu_mul_fused(gu, mh, n, I, st, L.mlp_rows));
  if (small) return gemv(L.mlp_down_w, mh, x, n, true, gate, L.mlp_rows);
  if (gate) {
    MOE_TRY(project(L.mlp_down_w, mh, tmp, n, false));
    return cuda::gated_add(x, tmp, gate, L.mlp_rows, n, hidden, st);
  }
  return project(L.mlp_down_w, mh, x, n, true);
}

cuda::StageArgs CudaEngine::Impl::stage_args(int ml) const {
  cuda::StageArgs a;
  a.guess_ids = guess_ids;
  a.top_k = top_k;
  a.n_experts = n_experts;
  a.layer = ml;
  a.table = blob_tables;
  a.on_gpu = on_gpu;
  a.host_blobs = host_blobs_dev;
  a.slots = stage_slots;
  a.blob_bytes = layout.blob_bytes;
  a.slot_bytes = stage_slot_bytes;
  a.staged = stage_keys;
  a.arrived = stage_arrived;
  a.landed = stage_landed;
  a.reached = stage_reached;
  return a;
}

Status CudaEngine::Impl::stage_next_layer(int ml, int n, const int32_t* positions, const int32_t* routing_seq) {
  // The residual after attention, kept for the side stream (this layer's
  // experts add to x meanwhile); then the fork.
  MOE_TRY(cuda::copy_f32(x, x_snap, size_t(n) * hidden, st, stage_reached, ml));
  MOE_CUDA_TRY(cudaEventRecord(stage_fork[size_t(ml)], st));
  MOE_CUDA_TRY(cudaStreamWaitEvent(side, stage_fork[size_t(ml)], 0));
  if (opts.bench_guess_recall >= 0 && trace_dev) {
    MOE_TRY(cuda::force_guess({positions, routing_seq, ml + 1, opts.uniform_routing_seed ^ 0x6e55, trace_dev,
                               trace_tokens, n_moe_layers},
                              float(opts.bench_guess_recall), guess_ids, n, n_experts, top_k, side));
  } else {
    // The next layer's router rows after its own MLP norm, as copy mode's
    // guess_next_layer; the GEMV helpers enqueue on st, so st is the side
    // stream meanwhile.
    const DevLayer& next = layers[size_t(layer_of_moe[size_t(ml + 1)])];
    const DenseW router = next.router_row >= 0 ? next.mlp_gu_w.slice(next.router_row, n_experts) : next.router_w;
    const cudaStream_t compute = st;  // start_staging checked every layer has router rows
    st = side;
    const Status g = gemv_rmsnorm(router, x_snap, next.post_norm, nullptr, guess_logits, n);
    st = compute;
    MOE_TRY(g);
    MOE_TRY(cuda::router_topk(guess_logits, n, n_experts, top_k, d.moe.norm_topk_prob, d.moe.routed_scaling, guess_ids,
                              guess_w, side));
  }
  return cuda::stage_experts(stage_args(ml + 1), side);
}

Status CudaEngine::Impl::end_staging() {
  MOE_CUDA_TRY(cudaEventRecord(stage_join, side));
  MOE_CUDA_TRY(cudaStreamWaitEvent(st, stage_join, 0));
  return cuda::restore_staged(stage_args(0), st);
}

Status CudaEngine::Impl::moe_layer(const DevLayer& L, int n, bool logits_ready, const int32_t* positions,
                                   const int32_t* routing_seq, bool fuse) {
  const int ml = L.moe_index;
  if (staging && ml + 1 < n_moe_layers) MOE_TRY(stage_next_layer(ml, n, positions, routing_seq));
  // The router's logits: inside the shared projection's output, already
  // made by the fused norm + GEMV, or computed here from xn.
  const float* logits = L.router_row >= 0 ? gu + L.router_row : router_logits;
  const int stride = L.router_row >= 0 ? L.mlp_rows : n_experts;
  if (!logits_ready)
    MOE_TRY(project(L.router_w, xn, router_logits, n, false));
  int32_t* ids = route_ids + size_t(ml) * n * top_k;
  // A shared pass posts the layer's share to the host: the router kernel
  // itself for one token, a kernel of its own after it for more.
  cuda::SharePublishArgs a;
  if (sharing) {
    a.tokens = n;
    a.ids = ids;
    a.route_w = route_w;
    a.on_gpu = on_gpu + size_t(ml) * n_experts;
    a.rows = share_rows;
    a.top_k = top_k;
    a.n_experts = n_experts;
    a.inter = layout.inter;
    a.xn = xn;
    a.hidden = hidden;
    a.slot = share_slots_dev + ml;
    a.x_host = share_x_dev + size_t(ml) * kShareMaxTokens * hidden;
    a.pass = share_pass;
    a.gpu_ids = share_ids;
    a.gpu_split = share_split;
    a.host_count = share_count + ml;
  }
  // Benchmark routing (uniform or a replayed trace): the router's ids
  // overwritten, and the one-token share posted from the forced ids in the
  // router's place.
  const bool forced = opts.uniform_routing_seed != 0 || trace_dev;
  const cuda::SharePublishArgs* publish_one = sharing && n == 1 ? &a : nullptr;
  if (!omit(kOmitRouter))
    MOE_TRY(cuda::router_topk(logits, n, n_experts, top_k, d.moe.norm_topk_prob, d.moe.routed_scaling, ids, route_w,
                              st, stride, forced ? nullptr : publish_one));
  if (forced)
    MOE_TRY(cuda::force_experts({positions, routing_seq, ml, opts.uniform_routing_seed, trace_dev, trace_tokens,
                                 n_moe_layers},
                                ids, n, n_experts, top_k, st, publish_one));
  if (sharing && n > 1)
    MOE_TRY(cuda::share_publish(a, st));
  auto shared = [&]() -> Status { return L.mlp_gu_w ? mlp(L, n, fuse) : Status{}; };
  if (all_resident || streaming) {
    MOE_TRY(shared());
    if (!sharing) return routed_experts(ml, n, ids);
    MOE_TRY(routed_experts(ml, n, share_ids));
    return cuda::share_collect(share_slots_dev + ml, share_sum_dev + size_t(ml) * kShareMaxTokens * hidden, x, n, hidden,
                               share_pass, share_count + ml, kShareTimeoutMs, st);
  }
  // Under a budget the layer's experts are pinned from bind_experts on; they
  // are released whatever happens after, a failure included.
  MOE_TRY(guess_next_layer(ml, n));
  Status s = bind_experts(ml, n, shared);
  if (s) s = routed_experts(ml, n, ids);
  const Status r = release_experts(ml);
  return s ? r : s;
}

Status CudaEngine::Impl::routed_experts(int ml, int n, const int32_t* ids) {
  const bool small = n <= cuda::kGemvMaxTokens;
  cuda::Q4ExpertArgs a;
  a.layout = layout;
  a.blobs = blob_tables + size_t(ml) * n_experts;
  a.n_experts = n_experts;
  a.expert_ids = host_pairs.empty() ? ids : split_ids;  // the host's pairs as -1: skipped
  if (sharing) a.split = share_split;  // the host's rows of each shared miss
  a.route_weights = route_w;
  a.tokens = n;
  a.top_k = top_k;
  // Streamed passes: a miss's pairs read its weights over the link once; the
  // islands' experts stay a block a pair (on_gpu: what the tables name).
  a.group_pairs = streaming;
  if (streaming) a.resident = on_gpu + size_t(ml) * n_experts;
  if (small || !grouped_ok) {
    if (!omit(kOmitGateUp)) MOE_TRY(cuda::q4_expert_gate_up(a, xn, h, st));
    if (!omit(kOmitDown)) MOE_TRY(cuda::q4_expert_down(a, h, x, true, st));
  } else {
    MOE_TRY(cuda::q4_grouped_moe(a, xn, x, grouped_ws, grouped_ws_bytes, st));
  }
  if (!host_pairs.empty()) {
    // The GPU works on the hits and the copied misses meanwhile.
    const auto t0 = std::chrono::steady_clock::now();
    host_x->run(reinterpret_cast<const uint16_t*>(xn_host), n, host_pairs, hsum_host);
    // The split follows what the host really takes (its cores may be busy).
    const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    host_us_token = 0.9 * host_us_token + 0.1 * us / double(host_pairs.size());
    MOE_CUDA_TRY(cudaMemcpyAsync(hsum, hsum_host, size_t(n) * hidden * 4, cudaMemcpyHostToDevice, st));
    return cuda::add_inplace(x, hsum, int64_t(n) * hidden, st);
  }
  return {};
}

Status CudaEngine::Impl::attention_gqa(const DevLayer& L, int n, const int32_t* positions,
                                       const int32_t* seq_of_token, const int32_t* tables) {
  cuda::PagedKvPool kv{L.k_pool,  L.v_pool,  tables,     max_blocks, kBlockTokens, d.n_kv_heads, d.head_dim,
                       kv_dtype,  L.k_codes, L.v_codes, L.k_scales, L.v_scales, L.kv_block_stride,
                       L.kv_scale_block_stride};
  cuda::QkvRopeArgs ra;
  ra.qkv = qkv;
  ra.bias = L.qkv_b;
  ra.q_norm = L.q_norm;
  ra.k_norm = L.k_norm;
  ra.qk_norm_full_width = d.qk_norm == QkNorm::whole;
  ra.eps = d.rms_eps;
  ra.positions = positions;
  ra.seq_of_token = seq_of_token;
  ra.inv_freq = inv_freq;
  ra.attention_factor = attention_factor;
  ra.tokens = n;
  ra.n_heads = d.n_heads;
  ra.q_out = q;
  MOE_TRY(cuda::qkv_rope_store(ra, kv, st));
  cuda::AttentionArgs aa;
  aa.q = q;
  aa.seq_of_token = seq_of_token;
  aa.positions = positions;
  aa.tokens = n;
  aa.n_heads = d.n_heads;
  aa.scale = softmax_scale;
  aa.out = attn;
  aa.shortest_run = pass_shortest_run;  // prompts' passes walk their queries in tiles
  if (n <= cuda::kGemvMaxTokens && pass_attn_splits > 1) {
    aa.max_splits = pass_attn_splits;  // long contexts: each query's keys over several blocks
    aa.split_keys = pass_split_keys;
    aa.partials = attn_partials;
    aa.split_counts = attn_split_counts;
  }
  return cuda::paged_attention(aa, kv, st);
}

// Absorbed (docs/cuda-mla.md): the query's no-RoPE part through W_UK^T per
// head becomes its latent part; attention over the latent rows; W_UV per
// head takes the output out of latent space.
Status CudaEngine::Impl::attention_mla(const DevLayer& L, int n, const int32_t* positions,
                                       const int32_t* seq_of_token, const int32_t* tables) {
  const MlaConfig& m = d.mla;
  const int nh = d.n_heads, R = m.kv_lora_rank, W = latent_width;
  const cuda::PagedLatentPool pool{L.latent, tables, max_blocks, kBlockTokens, R, m.qk_rope_head_dim, L.kv_block_stride};
  cuda::MlaRopeArgs ra;
  ra.proj = qkv;
  ra.row_stride = qkv_width;
  ra.kv_a_norm = L.kv_a_norm;
  ra.eps = d.rms_eps;
  ra.positions = positions;
  ra.seq_of_token = seq_of_token;
  ra.inv_freq = inv_freq;
  ra.attention_factor = attention_factor;
  ra.tokens = n;
  ra.n_heads = nh;
  ra.nope = m.qk_nope_head_dim;
  ra.q_nope = q;
  ra.q_abs = q_abs;
  MOE_TRY(cuda::mla_rope_store(ra, pool, st));
  cuda::HeadGemvArgs uk;
  uk.w = L.uk_t;
  uk.groups = nh;
  uk.rows = R;
  uk.cols = m.qk_nope_head_dim;
  uk.x = q;
  uk.x_token_stride = int64_t(nh) * m.qk_nope_head_dim;
  uk.x_group_stride = m.qk_nope_head_dim;
  uk.out = q_abs;
  uk.out_token_stride = int64_t(nh) * W;
  uk.out_group_stride = W;
  uk.tokens = n;
  MOE_TRY(cuda::head_gemv(uk, st));
  cuda::MlaAttentionArgs aa;
  aa.q_abs = q_abs;
  aa.seq_of_token = seq_of_token;
  aa.positions = positions;
  aa.tokens = n;
  aa.n_heads = nh;
  aa.scale = softmax_scale;
  aa.out = o_lat;
  aa.splits = cuda::mla_splits(n, nh);
  aa.partials = mla_partials;
  MOE_TRY(cuda::mla_attention(aa, pool, st));
  cuda::HeadGemvArgs uv;
  uv.w = L.uv;
  uv.groups = nh;
  uv.rows = m.v_head_dim;
  uv.cols = R;
  uv.x = o_lat;
  uv.x_token_stride = int64_t(nh) * R;
  uv.x_group_stride = R;
  uv.out = attn;
  uv.out_token_stride = int64_t(nh) * m.v_head_dim;
  uv.out_group_stride = m.v_head_dim;
  uv.tokens = n;
  return cuda::head_gemv(uv, st);
}

Status CudaEngine::Impl::fused_pass(const PassPack& pk) {
  cuda::FusedDecodeArgs a = fused;
  a.position = reinterpret_cast<const int32_t*>(pack_dev + pk.positions);
  a.block_table = reinterpret_cast<const int32_t*>(pack_dev + pk.tables);  // the pass's one piece
  a.route.positions = a.position;
  a.route.seq_of_token = reinterpret_cast<const int32_t*>(pack_dev + pk.routing_seq);
  advanced();
  return cuda::fused_decode(a, fused_blocks, st);
}

Status CudaEngine::Impl::forward(const PassPack& pk, int n, int s) {
  const Status f = forward_layers(pk, n, s);
  if (!staging) return f;
  // The side stream's leftovers overlap the final norm, lm_head and
  // sampling; the join comes after them (and after a failure too).
  const Status e = end_staging();
  return f ? e : f;
}

Status CudaEngine::Impl::forward_layers(const PassPack& pk, int n, int s) {
  // Up to this many tokens RMSNorm and SiLU are folded into the GEMVs'
  // staging (fewer launches); above, every block re-reading the f32 inputs
  // costs more than the launches saved (docs/cuda.md).
  const bool fuse = n <= opts.fuse_max_tokens;
  const auto* tokens = reinterpret_cast<const int32_t*>(pack_dev + pk.tokens);
  const auto* positions = reinterpret_cast<const int32_t*>(pack_dev + pk.positions);
  const auto* seq_of_token = reinterpret_cast<const int32_t*>(pack_dev + pk.seq_of_token);
  const auto* routing_seq = reinterpret_cast<const int32_t*>(pack_dev + pk.routing_seq);
  const auto* tables = reinterpret_cast<const int32_t*>(pack_dev + pk.tables);
  const float eps = d.rms_eps;
  MOE_TRY(cuda::embedding_gather(embed, vocab, hidden, tokens, n, x, st));
  if (pass_fused) {
    MOE_TRY(fused_pass(pk));
  } else {
    for (const DevLayer& L : layers) {
      advanced();
      if (omit(kOmitQkv)) {
      } else if (fuse) {
        MOE_TRY(gemv_rmsnorm(L.qkv_w, x, L.in_norm, nullptr, qkv, n));
      } else {
        MOE_TRY(cuda::rmsnorm(x, L.in_norm, xn, n, hidden, eps, st));
        MOE_TRY(project(L.qkv_w, xn, qkv, n, false));
      }
      if (!omit(kOmitAttention))
        MOE_TRY(mla ? attention_mla(L, n, positions, seq_of_token, tables)
                    : attention_gqa(L, n, positions, seq_of_token, tables));
      if (!omit(kOmitO)) MOE_TRY(project(L.o_w, attn, x, n, true));
      // The normed state xn and the first projection after attention: the
      // shared expert's / dense MLP's gate|up (with the router's rows when the
      // layer has both), or the router alone. Small batches norm inside the GEMV.
      bool logits_ready = false;
      if (fuse && (L.mlp_gu_w || L.moe_index >= 0)) {
        const DenseW& w = L.mlp_gu_w ? L.mlp_gu_w : L.router_w;
        if (!omit(kOmitPost)) MOE_TRY(gemv_rmsnorm(w, x, L.post_norm, xn, L.mlp_gu_w ? gu : router_logits, n));
        logits_ready = true;
      } else {
        MOE_TRY(cuda::rmsnorm(x, L.post_norm, xn, n, hidden, eps, st));
        if (L.mlp_gu_w) {
          MOE_TRY(project(L.mlp_gu_w, xn, gu, n, false));
          logits_ready = L.router_row >= 0;
        }
      }
      if (L.moe_index >= 0) {
        // The shared expert runs between the router and the routed experts:
        // under a budget it overlaps the host's wait for the routes and the
        // misses' copies.
        MOE_TRY(moe_layer(L, n, logits_ready, positions, routing_seq, fuse));
      } else if (L.mlp_gu_w) {
        MOE_TRY(mlp(L, n, fuse));
      }
    }
  }
  if (s == 0) return {};
  const auto* rows = reinterpret_cast<const int32_t*>(pack_dev + pk.sample_rows);
  MOE_TRY(cuda::gather_rows_f32(x, rows, s, hidden, xs, st));
  MOE_TRY(cuda::rmsnorm(xs, final_norm, xsn, s, hidden, eps, st));
  if (omit(kOmitLmHead)) {
  } else if (lm_head.quantised()) {
    // The quantised vocabulary projection is too large to turn back into bf16:
    // GEMVs of up to 8 rows.
    for (int r0 = 0; r0 < s; r0 += cuda::kGemvMaxTokens)
      MOE_TRY(gemv(lm_head, xsn + size_t(r0) * hidden, logits + size_t(r0) * vocab,
                          std::min(cuda::kGemvMaxTokens, s - r0), false, nullptr, 0));
  } else {
    MOE_TRY(project(lm_head, xsn, logits, s, false));
  }
  // Always launched (a row without entries returns at once), so a decode
  // graph serves steps with and without adjustments alike.
  if (omit(kOmitSampling)) return {};
  MOE_TRY(cuda::adjust_logits(logits, s, vocab, reinterpret_cast<const AdjustSpan*>(pack_dev + pk.adjust_spans),
                              adjust_entries, adjust_saved, st));
  return cuda::sample_tokens(logits, s, vocab, reinterpret_cast<const SampleDraw*>(pack_dev + pk.params),
                             reinterpret_cast<const int64_t*>(pack_dev + pk.sample_pos), sampled, st,
                             reinterpret_cast<const AdjustSpan*>(pack_dev + pk.adjust_spans), allow_masks);
}

}  // namespace moe
