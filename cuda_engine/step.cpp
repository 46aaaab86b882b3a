// CudaEngine::step and the sequence calls: KV blocks, packing passes, CUDA
// graphs of decode passes, outputs.
#include "cuda_engine/engine_impl.h"

namespace moe {

Result<std::vector<SeqOutput>> CudaEngine::step(std::span<const SeqInput> inputs) {
  Impl& m = *impl_;
  const ModelDesc& d = m.d;
  // Check everything first: a refused step changes nothing. The blocks may
  // count those the pool can take from the islands; it grows before
  // anything else changes.
  int net_blocks = 0;
  const Status checked =
      check_step_inputs(inputs, *m.kv_pool, d.vocab_size, m.max_context, m.kv_growable(), &net_blocks);
  if (!checked.ok()) return make_error(checked.error());
  // The net counts the restarts' blocks as given back: grow against the
  // free count before they are (and before anything changes).
  if (net_blocks > m.kv_pool->free()) MOE_TRY(m.grow_kv(net_blocks - m.kv_pool->free()));
  m.kv_pool->release_restarts(inputs);
  // Fresh prompts that start with cached blocks compute only the rest.
  std::vector<SeqInput> reused;
  std::vector<int> skipped;
  if (m.opts.prefix_cache) inputs = m.kv_pool->reuse_prefixes(inputs, &reused, &skipped);
  for (const SeqInput& in : inputs)
    m.kv_pool->extend(in.seq_id, in.start_pos, in.start_pos + int(in.tokens.size()), in.tokens);

  const size_t per_seq = size_t(m.n_moe_layers) * m.n_experts;
  std::vector<SeqOutput> out(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    out[i].seq_id = inputs[i].seq_id;
    out[i].expert_counts.assign(per_seq, 0);
    if (!skipped.empty()) out[i].cached_tokens = skipped[i];
  }

  // Pieces: runs of one sequence's tokens, packed into passes of at most max_pass_tokens
  // tokens and kMaxSampleRows sampled rows.
  struct Piece {
    size_t input;
    int begin, count;
    bool sample;
  };
  std::vector<std::vector<Piece>> passes(1);
  int pass_tokens = 0, pass_samples = 0;
  size_t pass_adjust = 0;  // token adjustments of the pass's sampled rows
  for (size_t i = 0; i < inputs.size(); ++i) {
    const SeqInput& in = inputs[i];
    if (in.sampling.adjust.size() > kMaxPassAdjust)
      return make_error("sequence " + std::to_string(in.seq_id) + ": more than " + std::to_string(kMaxPassAdjust) +
                        " token adjustments");
    int done = 0;
    const int total = int(in.tokens.size());
    while (done < total) {
      if (pass_tokens == m.max_pass_tokens) {
        passes.emplace_back();
        pass_tokens = pass_samples = 0;
        pass_adjust = 0;
      }
      const int c = std::min(total - done, m.max_pass_tokens - pass_tokens);
      const bool last = done + c == total;
      const bool sample = last && in.sample;
      if (sample && (pass_samples == kMaxSampleRows || pass_adjust + in.sampling.adjust.size() > kMaxPassAdjust)) {
        passes.emplace_back();
        pass_tokens = pass_samples = 0;
        pass_adjust = 0;
        continue;
      }
      passes.back().push_back({i, done, c, sample});
      pass_tokens += c;
      pass_samples += sample ? 1 : 0;
      if (sample) pass_adjust += in.sampling.adjust.size();
      done += c;
    }
  }

  for (const std::vector<Piece>& pass : passes) {
    if (pass.empty()) continue;
    int n = 0, s = 0;
    for (const Piece& p : pass) {
      n += p.count;
      s += p.sample ? 1 : 0;
    }
    const int pieces = int(pass.size());
    m.pass_shortest_run = n;
    for (const Piece& p : pass) m.pass_shortest_run = std::min(m.pass_shortest_run, p.count);
    const Impl::PassPack pk = m.pack_layout(n, s, pieces);
    auto* tok = reinterpret_cast<int32_t*>(m.pack_host + pk.tokens);
    auto* pos = reinterpret_cast<int32_t*>(m.pack_host + pk.positions);
    auto* sot = reinterpret_cast<int32_t*>(m.pack_host + pk.seq_of_token);
    auto* rsq = reinterpret_cast<int32_t*>(m.pack_host + pk.routing_seq);
    auto* rows = reinterpret_cast<int32_t*>(m.pack_host + pk.sample_rows);
    auto* spos = reinterpret_cast<int64_t*>(m.pack_host + pk.sample_pos);
    auto* prm = reinterpret_cast<SampleDraw*>(m.pack_host + pk.params);
    auto* spans = reinterpret_cast<AdjustSpan*>(m.pack_host + pk.adjust_spans);
    uint32_t n_adjust = 0;
    int mask_rows = 0;  // rows [0, mask_rows) hold the pass's masks
    auto* tab = reinterpret_cast<int32_t*>(m.pack_host + pk.tables);
    std::vector<size_t> sample_input;  // [s]: the input each sampled row answers
    int t = 0;
    bool pure_decode = n <= cuda::kGemvMaxTokens;
    for (int pi = 0; pi < pieces; ++pi) {
      const Piece& p = pass[size_t(pi)];
      const SeqInput& in = inputs[p.input];
      const std::vector<int32_t>& blocks = m.kv_pool->table(in.seq_id);
      std::fill(tab + size_t(pi) * m.max_blocks, tab + size_t(pi + 1) * m.max_blocks, 0);
      std::copy(blocks.begin(), blocks.end(), tab + size_t(pi) * m.max_blocks);
      for (int j = 0; j < p.count; ++j, ++t) {
        tok[t] = in.tokens[size_t(p.begin + j)];
        pos[t] = in.start_pos + p.begin + j;
        sot[t] = pi;
        rsq[t] = int32_t(uint32_t(in.seq_id ^ (in.seq_id >> 32)));  // benchmark routing: the sequence, not its slot
      }
      pure_decode = pure_decode && p.count == 1 && p.sample;
      if (p.sample) {
        const int r = int(sample_input.size());
        rows[r] = t - 1;
        spos[r] = int64_t(in.start_pos) + int64_t(in.tokens.size());
        prm[r] = in.sampling;  // the draw, as the kernel reads it
        const std::vector<TokenAdjust>& adj = in.sampling.adjust;
        spans[r] = {n_adjust, uint32_t(adj.size()), in.sampling.penalties, kNoMask};
        std::copy(adj.begin(), adj.end(), m.adjust_host + n_adjust);
        n_adjust += uint32_t(adj.size());
        if (!in.sampling.allowed.empty()) {  // its size was checked against the vocabulary
          spans[r].mask = uint32_t(r) * uint32_t(m.mask_words);
          std::copy(in.sampling.allowed.begin(), in.sampling.allowed.end(), m.masks_host + spans[r].mask);
          mask_rows = r + 1;
        }
        sample_input.push_back(p.input);
      }
    }
    MOE_CUDA_TRY(cudaMemcpyAsync(m.pack_dev, m.pack_host, pk.bytes, cudaMemcpyHostToDevice, m.st));
    if (n_adjust > 0)
      MOE_CUDA_TRY(cudaMemcpyAsync(m.adjust_entries, m.adjust_host, size_t(n_adjust) * sizeof(TokenAdjust),
                                   cudaMemcpyHostToDevice, m.st));
    if (mask_rows > 0)
      MOE_CUDA_TRY(cudaMemcpyAsync(m.allow_masks, m.masks_host, size_t(mask_rows) * size_t(m.mask_words) * 4,
                                   cudaMemcpyHostToDevice, m.st));

    // Resident decode steps replay a graph captured for their batch size
    // (from the second step of that size: the first runs eagerly and sets up
    // the kernels' attributes).
    // Decode attention over long contexts splits each query's keys over
    // several blocks, by the size class of the pass's longest query.
    m.pass_attn_splits = 1;
    if (n <= cuda::kGemvMaxTokens && m.attn_partials) {
      int keys = 0;
      for (int i = 0; i < n; ++i) keys = std::max(keys, pos[i] + 1);
      m.pass_split_keys = m.opts.attention_split_keys > 0
                              ? m.opts.attention_split_keys
                              : cuda::attention_split_keys_for(n * m.d.n_heads, m.sm_count);
      m.pass_attn_splits = cuda::attention_splits_for(keys, m.pass_split_keys);
    }
    // Resident decode of one token: every layer in one launch.
    m.pass_fused = m.fused_ok && pure_decode && n == 1 && m.all_resident;
    if (m.pass_fused) ++m.fused_passes;
    m.streaming = m.stream_pass(n);
    if (m.streaming)
      MOE_TRY(m.prepare_streamed_pass());
    // Layer-ahead staging: one token a pass (expert_stage.cuh), a fork per MoE layer but the last.
    m.staging = m.streaming && n == 1 && m.side && m.n_moe_layers > 1;
    // The host's share: its threads serve this pass's layers as the GPU
    // posts them; on every way out of the pass they are done with it (or
    // abandon it when the pass failed).
    m.sharing = m.streaming && m.share && n <= kShareMaxTokens && m.share_misses[size_t(n)] >= Impl::kShareMinMisses;
    struct ShareScope {  // left with s set only when the pass failed
      HostShare* s = nullptr;
      ~ShareScope() {
        if (s) s->end(false);
      }
    } share_scope;
    if (m.sharing) {
      if (++m.share_pass_no == 0) ++m.share_pass_no;  // 0 is what fresh slots hold
      *m.pass_host = m.share_pass_no;
      MOE_CUDA_TRY(cudaMemcpyAsync(m.share_pass, m.pass_host, sizeof(uint32_t), cudaMemcpyHostToDevice, m.st));
      m.share->begin(m.share_pass_no);
      share_scope.s = m.share.get();
    }
    Impl::Graph* g = nullptr;
    if (pure_decode && (m.all_resident || m.streaming) && m.opts.graphs) {
      const int key = 2 * n + (m.sharing ? 1 : 0);
      g = &m.graphs[key * 32 + m.pass_attn_splits];
      if (!g->exec && g->seen++ >= 1) {
        // One class's graph a (size, share) at a time, so the graphs stay
        // within kGraphReserve; contexts cross a class rarely.
        for (int other : {1, cuda::kAttentionMaxSplits}) {
          auto it = m.graphs.find(key * 32 + other);
          if (other == m.pass_attn_splits || it == m.graphs.end() || !it->second.exec) continue;
          MOE_CUDA_TRY(cudaGraphExecDestroy(it->second.exec));
          it->second = Impl::Graph{};
        }
        cudaGraph_t graph = nullptr;
        MOE_CUDA_TRY(cudaStreamBeginCapture(m.st, cudaStreamCaptureModeThreadLocal));
        const Status fs = m.forward(pk, n, s);
        const cudaError_t ce = cudaStreamEndCapture(m.st, &graph);
        if (!fs) return make_error(fs.error());
        MOE_CUDA_TRY(ce);
        const cudaError_t ie = cudaGraphInstantiate(&g->exec, graph, 0);
        cudaGraphDestroy(graph);
        MOE_CUDA_TRY(ie);
      }
    }
    if (g && g->exec) {
      MOE_CUDA_TRY(cudaGraphLaunch(g->exec, m.st));
    } else if (Status fs = m.forward(pk, n, s); !fs) {
      return make_error(fs.error());
    }

    if (s > 0) MOE_CUDA_TRY(cudaMemcpyAsync(m.sampled_host, m.sampled, size_t(s) * 4, cudaMemcpyDeviceToHost, m.st));
    // Rows whose log probabilities are reported come back whole, and with
    // adjustments, the logits those replaced (put back below: raw values).
    auto wants_row = [&](int r) {
      const SeqInput& in = inputs[sample_input[size_t(r)]];
      return in.sampling.logprobs || in.sampling.top_logprobs > 0 || in.score_token >= 0;
    };
    bool restore = false;
    for (int r = 0; r < s; ++r) {
      if (!wants_row(r)) continue;
      MOE_CUDA_TRY(cudaMemcpyAsync(m.logits_host + size_t(r) * m.vocab, m.logits + size_t(r) * m.vocab, size_t(m.vocab) * 4,
                                   cudaMemcpyDeviceToHost, m.st));
      restore = restore || spans[r].count > 0;
    }
    if (restore)
      MOE_CUDA_TRY(cudaMemcpyAsync(m.saved_host, m.adjust_saved, size_t(n_adjust) * 4, cudaMemcpyDeviceToHost, m.st));
    if (m.n_moe_layers > 0 && (m.all_resident || m.streaming))
      MOE_CUDA_TRY(cudaMemcpyAsync(m.ids_host, m.route_ids, size_t(m.n_moe_layers) * n * m.top_k * 4, cudaMemcpyDeviceToHost, m.st));
    if (m.staging)
      MOE_CUDA_TRY(cudaMemcpyAsync(m.stage_landed_host, m.stage_landed, sizeof(uint32_t), cudaMemcpyDeviceToHost, m.st));
    MOE_CUDA_TRY(cudaStreamSynchronize(m.st));
    if (m.staging) {
      m.experts_staged += uint32_t(*m.stage_landed_host - m.stage_landed_seen);
      m.stage_landed_seen = *m.stage_landed_host;
    }
    m.advanced();
    if (share_scope.s) {
      share_scope.s->end(true);
      share_scope.s = nullptr;
    }
    if (m.streaming)
      MOE_TRY(m.after_streamed_pass(n));

    // Expert use per sequence (the ids of each MoE layer, token by token).
    t = 0;
    for (const Piece& p : pass) {
      uint16_t* counts = out[p.input].expert_counts.data();
      for (int j = 0; j < p.count; ++j, ++t)
        for (int ml = 0; ml < m.n_moe_layers; ++ml) {
          const int32_t* r = m.ids_host + (size_t(ml) * n + size_t(t)) * m.top_k;
          for (int k = 0; k < m.top_k; ++k)
            if (r[k] >= 0 && r[k] < m.n_experts) {
              uint16_t& c = counts[size_t(ml) * m.n_experts + size_t(r[k])];
              if (c < UINT16_MAX) ++c;
            }
        }
    }
    for (int r = 0; r < s; ++r) {
      const size_t i = sample_input[size_t(r)];
      SeqOutput& o = out[i];
      o.token = m.sampled_host[r];
      const SamplingParams& sp = inputs[i].sampling;
      float* row = m.logits_host + size_t(r) * m.vocab;
      if (restore && wants_row(r))
        for (uint32_t e = spans[r].first; e < spans[r].first + spans[r].count; ++e)
          row[m.adjust_host[e].token] = m.saved_host[e];
      if (sp.logprobs || sp.top_logprobs > 0) o.logprob = cpu::token_logprob(row, m.vocab, o.token);
      if (sp.top_logprobs > 0) o.top = cpu::top_logprobs(row, m.vocab, sp.top_logprobs);
      if (const int32_t st = inputs[i].score_token; st >= 0 && st < m.vocab) o.score_logprob = cpu::token_logprob(row, m.vocab, st);
    }
  }
  // Now and then: nothing may have been allocated on the device since the
  // start (the budget is the whole process's).
  if (m.meter && ++m.steps_since_check >= 256) {
    m.steps_since_check = 0;
    const DeviceMemory dm = device_memory();
    if (dm.measured && dm.now > m.budget_bytes && !m.over_budget_said) {
      m.over_budget_said = true;
      std::fprintf(stderr, "moe-worker: the process holds %s on the device, over its budget of %s\n",
                   format_bytes(dm.now).c_str(), format_bytes(m.budget_bytes).c_str());
    }
  }
  m.kv_after_step();
  return out;
}

void CudaEngine::set_progress(std::atomic<uint64_t>* progress) { impl_->progress = progress; }

const std::string& CudaEngine::pci_bus_id() const { return impl_->pci_bus_id; }

DeviceMemory CudaEngine::device_memory() const {
  Impl& m = *impl_;
  DeviceMemory d;
  d.budget = m.budget_bytes;
  d.base = m.base_device_bytes;
  d.arena = m.plan.arena_bytes;
  if (m.meter) {
    if (auto b = m.meter->process_bytes()) {
      d.now = *b;
      d.measured = true;
      m.peak_device_bytes = std::max(m.peak_device_bytes, *b);
    }
  }
  d.peak = m.peak_device_bytes;
  return d;
}

void CudaEngine::release(uint64_t seq_id) { impl_->kv_pool->release(seq_id); }
const KvBlockPool& CudaEngine::kv_pool() const { return *impl_->kv_pool; }
int CudaEngine::max_context() const { return impl_->max_context; }
const ModelDesc& CudaEngine::desc() const { return impl_->d; }
const IslandPlan& CudaEngine::plan() const { return impl_->plan; }

}  // namespace moe
