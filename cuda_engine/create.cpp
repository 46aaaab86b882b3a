// CudaEngine::create: the budget measured against the process, the plan, the
// arena, the weights uploaded, the experts placed.
#include "cuda_engine/engine_impl.h"
#include "replay/routing_trace.h"

namespace moe {

Status CudaEngine::Impl::load_routing_trace(const std::string& path) {
  auto tr = read_routing_trace(path, "routing_topk");
  if (!tr) return make_error("routing trace " + path + ": " + tr.error());
  const std::string shape = std::to_string(n_moe_layers) + " MoE layers, top-" + std::to_string(top_k) + " of " +
                            std::to_string(n_experts) + " experts";
  if (n_moe_layers == 0) return make_error("routing trace " + path + ": the model has no MoE layers");
  if (tr->n_layers != n_moe_layers || tr->top_k != top_k || tr->n_experts > n_experts)
    return make_error("routing trace " + path + " holds " + std::to_string(tr->n_layers) + " layers, top-" +
                      std::to_string(tr->top_k) + " of " + std::to_string(tr->n_experts) +
                      " experts; this model has " + shape + " (bench/e2e/traces/ maps recordings onto a shape)");
  if (tr->steps.size() % size_t(n_moe_layers) != 0 || tr->steps.empty())
    return make_error("routing trace " + path + ": every token needs a step at each layer");
  trace_tokens = int(tr->steps.size() / size_t(n_moe_layers));
  trace_host.assign(size_t(trace_tokens) * n_moe_layers * top_k, 0);
  for (size_t i = 0; i < tr->steps.size(); ++i) {
    const RoutingStep& s = tr->steps[i];
    const size_t t = i / size_t(n_moe_layers);
    if (s.layer != int(i % size_t(n_moe_layers)) || int(s.experts.size()) != top_k)
      return make_error("routing trace " + path + ": step " + std::to_string(i) +
                        " is not token-major with top-k experts at every layer");
    for (int j = 0; j < top_k; ++j) {
      const int e = s.experts[size_t(j)];
      if (e < 0 || e >= n_experts) return make_error("routing trace " + path + ": expert out of range");
      trace_host[(t * n_moe_layers + size_t(s.layer)) * top_k + j] = int16_t(e);
    }
  }
  std::fprintf(stderr, "moe-worker: routing replayed from %s (%d tokens of %s)\n", path.c_str(), trace_tokens,
               shape.c_str());
  return {};
}

Result<std::string> cuda_device_summary(int index) {
  // Nothing here makes a context: what the process holds is measured before
  // one exists (CudaEngine::create).
  MOE_TRY(check_cuda_device(index));
  cudaDeviceProp prop{};
  MOE_CUDA_TRY(cudaGetDeviceProperties(&prop, index));
  return std::string(prop.name) + " (sm_" + std::to_string(prop.major) + std::to_string(prop.minor) + ", " +
         format_bytes(prop.totalGlobalMem) + ")";
}

int cuda_device_count() {
  // cudaGetDeviceCount makes no context (cudaSetDevice would, since CUDA 12).
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

Status check_cuda_device(int index) {
  const int n = cuda_device_count();
  if (n == 0) return make_error("no CUDA device");
  if (index < 0 || index >= n) {
    const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
    return make_error("--device " + std::to_string(index) + ": this process sees " + std::to_string(n) +
                      " CUDA device" + (n == 1 ? "" : "s") + " (0 to " + std::to_string(n - 1) + ")" +
                      (visible ? std::string(", CUDA_VISIBLE_DEVICES=") + visible : std::string()));
  }
  return {};
}

std::string CudaEngine::model_refusal(const ModelDesc& d, const CudaEngineOptions& opts) {
  if (d.attention == AttentionKind::mla) {
    const MlaConfig& m = d.mla;
    if (!cuda::mla_shape_supported(m.kv_lora_rank, m.qk_rope_head_dim))
      return "the cuda backend's latent attention is built for (kv_lora_rank, qk_rope_head_dim) (512, 64), every "
             "published DeepSeek-V2, and (32, 8), not (" + std::to_string(m.kv_lora_rank) + ", " +
             std::to_string(m.qk_rope_head_dim) + "); use --backend cpu";
    if (m.q_lora_rank > 0)
      return "the cuda backend does not run a compressed query (q_lora_rank " + std::to_string(m.q_lora_rank) +
             ", DeepSeek-V2 236B); DeepSeek-V2-Lite has none; use --backend cpu";
    // head_gemv reads bf16 pairs of at most 1,024 columns; o_proj's GEMV
    // reads runs of 8 of n_heads * v_head_dim.
    if (m.qk_nope_head_dim <= 0 || m.qk_nope_head_dim % 2 || m.qk_nope_head_dim > 1024 || m.v_head_dim <= 0 ||
        (d.n_heads * m.v_head_dim) % 8)
      return "the cuda backend cannot run this latent attention's head widths; use --backend cpu";
    if (opts.kv_dtype == KvDtypeChoice::int8 || opts.kv_dtype == KvDtypeChoice::fp8)
      return "--kv-dtype int8 and fp8 are not built for latent attention (DeepSeek-V2) on the cuda backend: its "
             "latent rows are bf16 (9x smaller than expanded K and V already); use auto or bf16, or --backend cpu";
  }
  if (d.moe.topk_method != "greedy")
    return "the cuda backend has no group-limited expert selection (" + d.moe.topk_method + ")";
  return "";
}

Result<std::unique_ptr<CudaEngine>> CudaEngine::create(std::shared_ptr<ModelFiles> files,
                                                       const CudaEngineOptions& opts) {
  auto dev = cuda_device_summary(opts.device);
  if (!dev) return make_error("the cuda backend needs a CUDA device: " + dev.error());
  const ModelDesc& d = files->desc();
  if (const std::string refusal = model_refusal(d, opts); !refusal.empty()) return make_error(refusal);
  if (opts.max_step_tokens < 1 || opts.max_step_tokens > 8192)
    return make_error("max_step_tokens must be in [1, 8192]");
  if (opts.fuse_max_tokens < 0 || opts.fuse_max_tokens > cuda::kGemvMaxTokens)
    return make_error("fuse_max_tokens must be in [0, 8]");
  if (opts.attention_split_keys != 0 && (opts.attention_split_keys < 32 || opts.attention_split_keys % 32 != 0))
    return make_error("attention_split_keys must be 0 (by the pass) or a positive multiple of 32");

  std::unique_ptr<CudaEngine> eng(new CudaEngine());
  eng->impl_ = std::make_unique<Impl>();
  Impl& m = *eng->impl_;
  m.files = std::move(files);
  m.d = d;
  m.opts = opts;
  m.hidden = d.hidden_size;
  m.mla = d.attention == AttentionKind::mla;
  if (m.mla) {
    // The first projection is q | kv_a (the latent, then the shared key);
    // q holds the query's no-RoPE part, attn the heads' outputs.
    const MlaConfig& ml = d.mla;
    m.latent_width = ml.kv_lora_rank + ml.qk_rope_head_dim;
    m.qkv_width = d.n_heads * (ml.qk_nope_head_dim + ml.qk_rope_head_dim) + m.latent_width;
    m.q_width = d.n_heads * std::max(ml.qk_nope_head_dim, ml.v_head_dim);
    m.rot_dim = ml.qk_rope_head_dim;
  } else {
    m.q_width = d.n_heads * d.head_dim;
    m.qkv_width = (d.n_heads + 2 * d.n_kv_heads) * d.head_dim;
    m.rot_dim = d.head_dim;
  }
  m.softmax_scale = attention_softmax_scale(d);
  m.n_experts = d.moe.n_experts;
  m.top_k = d.moe.top_k;
  m.n_moe_layers = d.n_moe_layers();
  m.vocab = d.vocab_size;
  m.max_pass_tokens = opts.max_step_tokens;
  m.max_context = opts.max_context > 0 ? opts.max_context : std::min(d.max_position > 0 ? d.max_position : 4096, 32768);
  m.max_blocks = (m.max_context + kBlockTokens - 1) / kBlockTokens;

  auto w = load_weights(*m.files, /*convert_f32=*/false, /*use_q4=*/m.files->experts_q4());
  if (!w) return make_error(w.error());
  m.host_weights = std::move(*w);
  if (m.n_moe_layers > 0) {
    m.layout = m.host_weights->experts_q4 ? m.host_weights->q4_layout
                                          : expert_layout(m.hidden, d.moe.expert_intermediate, opts.q4_group);
    m.grouped_ok = cuda::q4_grouped_supported(m.layout);
    m.h_rows = size_t(m.grouped_ok ? std::min(m.max_pass_tokens, cuda::kGemvMaxTokens) : m.max_pass_tokens) * m.top_k;
    if (m.grouped_ok) m.grouped_ws_bytes = cuda::q4_grouped_workspace_bytes(m.layout, m.max_pass_tokens, m.top_k, m.n_experts);
  }
  for (int l = 0; l < d.n_layers; ++l) {
    const LayerWeights& lw = m.host_weights->layers[size_t(l)];
    const Mlp* mlp = d.moe_layer_index(l) >= 0 ? (lw.shared.gate.present() ? &lw.shared : nullptr) : &lw.dense;
    if (!mlp) continue;
    m.mlp_inter_max = std::max(m.mlp_inter_max, mlp->gate.out);
    const int rows = 2 * mlp->gate.out + (lw.shared_gate.present() ? 1 : 0) + (d.moe_layer_index(l) >= 0 ? m.n_experts : 0);
    m.gu_stride = std::max(m.gu_stride, int(align_up(size_t(rows), 8)));
  }
  m.pack_bytes = m.pack_layout(m.max_pass_tokens, kMaxSampleRows, m.max_pass_tokens).bytes;
  if (!opts.routing_trace.empty()) MOE_TRY(m.load_routing_trace(opts.routing_trace));

  // The budget is the whole process's, as nvidia-smi shows it: first what
  // the process holds without the arena (the context with its modules, the
  // stream, cuBLASLt's handle and workspace), measured; the arena gets the
  // rest, less a reserve for the CUDA graphs instantiated later.
  const int dev_index = opts.device;
  char bus[32] = {};
  MOE_CUDA_TRY(cudaDeviceGetPCIBusId(bus, int(sizeof(bus)), dev_index));
  m.pci_bus_id = bus;
  auto meter = NvmlCard::open(bus);
  std::optional<uint64_t> used_before;
  if (meter) {
    if (auto u = (*meter)->device_used_bytes()) used_before = *u;
  }
  MOE_CUDA_TRY(cudaSetDevice(dev_index));  // the context, now (this thread's device from here on)
  MOE_CUDA_TRY(cudaFree(nullptr));
  MOE_CUDA_TRY(cudaDeviceGetAttribute(&m.sm_count, cudaDevAttrMultiProcessorCount, dev_index));
  MOE_CUDA_TRY(cudaStreamCreateWithFlags(&m.st, cudaStreamNonBlocking));
  MOE_CUDA_TRY(cudaEventCreateWithFlags(&m.routes_ready, cudaEventDisableTiming));
  {
    auto cm = cuda::CublasLtMatmul::create();
    if (!cm) return make_error(cm.error());
    m.mm.reset(cm.value());
  }
  MOE_CUDA_TRY(cudaDeviceSynchronize());
  size_t free_b = 0, total_b = 0;
  MOE_CUDA_TRY(cudaMemGetInfo(&free_b, &total_b));
  // This process in NVML's list, else the device's use since before the
  // context (nothing else runs on a worker's device), else a fixed guess.
  std::string held_how;
  if (meter) {
    if (auto b = (*meter)->process_bytes()) {
      m.base_device_bytes = *b;
      held_how = "as NVML lists this process";
    } else if (used_before) {
      if (auto u = (*meter)->device_used_bytes(); u && *u >= *used_before) {
        m.base_device_bytes = *u - *used_before;
        held_how = "the device's use since before the context";
      }
    }
  }
  if (held_how.empty()) {
    m.base_device_bytes = kContextGuess;
    held_how = std::string("a guess: ") + (meter ? "NVML does not list this process" : meter.error());
  }
  m.meter = meter ? std::move(*meter) : nullptr;
  size_t budget = opts.vram_budget ? opts.vram_budget
                                   : (free_b > kDefaultMargin ? free_b - kDefaultMargin + m.base_device_bytes : 0);
  if (opts.arena_budget) budget = opts.arena_budget + m.base_device_bytes + kGraphReserve;
  if (!opts.arena_budget && opts.vram_budget && budget > free_b + m.base_device_bytes)
    return make_error("--vram-budget " + format_bytes(budget) + " exceeds what the device has for this process (" +
                      format_bytes(free_b + m.base_device_bytes) + ")");
  // Nothing left for the arena at all: said here; too little for the model
  // is the plan's to say (with what would fit).
  if (budget <= m.base_device_bytes + kGraphReserve)
    return make_error("--vram-budget " + format_bytes(budget) + " leaves nothing for the model: the CUDA context and "
                      "libraries hold " + format_bytes(m.base_device_bytes) + " (" + held_how + "), and " +
                      format_bytes(kGraphReserve) + " is kept for CUDA graphs; the model's own part needs more (a "
                      "larger budget says how much)");
  m.budget_bytes = budget;
  const size_t arena_budget = budget - m.base_device_bytes - kGraphReserve;
  std::fprintf(stderr, "moe-worker: the budget %s holds the CUDA context and libraries, %s (%s), %s kept for CUDA "
               "graphs, and an arena of at most %s\n", format_bytes(budget).c_str(),
               format_bytes(m.base_device_bytes).c_str(), held_how.c_str(), format_bytes(kGraphReserve).c_str(),
               format_bytes(arena_budget).c_str());
  m.kv_dtype = opts.kv_dtype == KvDtypeChoice::int8  ? KvDtype::int8
               : opts.kv_dtype == KvDtypeChoice::fp8 ? KvDtype::fp8
                                                     : KvDtype::bf16;
  auto plan_for = [&](DenseDtype dt) -> Result<IslandPlan> {
    m.dense = dt;
    m.dequant_elems = 0;
    Carver measure_w, measure_ws;
    MOE_TRY(m.carve_weights(measure_w, false));
    m.carve_workspace(measure_ws);
    IslandPlanRequest req;
    req.budget_bytes = arena_budget;
    req.nonexpert_bytes = measure_w.used;
    req.workspace_bytes = measure_ws.used;
    req.kv_bytes_per_block = m.kv_block_bytes();
    // Blocks the operator asked for are exactly what the pool gets.
    req.kv_blocks_min = opts.kv_blocks > 0 ? opts.kv_blocks : std::max(opts.kv_blocks_min, 1);
    req.kv_blocks_wanted = req.kv_blocks_min;
    req.expert_blob_bytes = m.n_moe_layers > 0 ? m.layout.blob_bytes : kAlign;
    req.n_total_experts = int64_t(m.n_moe_layers) * m.n_experts;
    req.min_islands = m.n_moe_layers > 0 ? m.n_experts : 0;  // a prompt may route to every expert of a layer at once
    auto plan = plan_islands(req);
    if (!plan) return make_error(plan.error());
    if (opts.kv_blocks == 0) {
      // Unasked, KV takes what the experts leave, up to 8 GiB.
      const size_t left = req.budget_bytes - plan->arena_bytes;
      const int64_t extra = int64_t(std::min(left, size_t(8) << 30) / plan->kv_block_stride);
      if (extra > 0) {
        req.kv_blocks_wanted = plan->kv_blocks + extra;
        plan = plan_islands(req);
      }
    }
    return plan;
  };
  const int64_t all_experts = int64_t(m.n_moe_layers) * m.n_experts;
  // A plan in one dtype. Under a budget the embedding may stay in host
  // memory, its bytes going to islands (not when a bf16 lm_head shares it).
  auto plan_dtype = [&](DenseDtype dt) -> Result<IslandPlan> {
    m.embed_host = false;
    auto p = plan_for(dt);
    const bool embed_may_leave = !(d.tie_embeddings && dt == DenseDtype::bf16);
    if (opts.host_embedding && embed_may_leave && m.n_moe_layers > 0 && !(p && p->n_islands >= all_experts)) {
      m.embed_host = true;
      auto ph = plan_for(dt);
      if (ph && (!p || ph->n_islands > p->n_islands)) return ph;
      m.embed_host = false;  // the measure's other results do not depend on it
    }
    return p;
  };
  // auto: bf16 when it leaves every expert resident, else INT8. Never INT4
  // unless asked: on the demo model's held-out text INT4 attention moves
  // 3.6 % of the top-k routing choices and perplexity by 0.8 %, INT8 0.56 %
  // and 0.02 % (bench/results/gpu-quality-2026-12-02.txt), for 3.5 % more
  // islands (the Qwen3-30B shape at 12 GiB).
  DenseDtype chosen = DenseDtype::bf16;
  if (opts.dense_weights == DenseWeights::int8) chosen = DenseDtype::int8;
  if (opts.dense_weights == DenseWeights::int4) chosen = DenseDtype::int4;
  if (opts.dense_weights == DenseWeights::automatic) {
    Result<IslandPlan> best = make_error("no plan");
    for (DenseDtype dt : {DenseDtype::bf16, DenseDtype::int8}) {
      auto p = plan_dtype(dt);
      // With no plan at all, the narrowest dtype's refusal is the one to show.
      if (!best || (p && p->n_islands > best->n_islands)) {
        best = std::move(p);
        chosen = dt;
      }
      if (best && best->n_islands >= all_experts) break;
    }
    // INT4 only when INT8 leaves no room at all (it says so at start).
    if (!best) {
      if (auto p = plan_dtype(DenseDtype::int4)) {
        chosen = DenseDtype::int4;
        std::fprintf(stderr, "moe-worker: INT8 non-expert weights leave no room in this budget; INT4 instead "
                             "(about 0.8 %% perplexity, docs/cuda-worker.md)\n");
      }
    }
  }
  // Measured again for the chosen dtype: the upload carve follows this one.
  Result<IslandPlan> plan = plan_dtype(chosen);
  // KV rows in a byte under a budget (auto): the plan again with their room.
  if (opts.kv_dtype == KvDtypeChoice::automatic && !m.mla && m.n_moe_layers > 0 && plan &&
      plan->n_islands < all_experts) {
    m.kv_dtype = KvDtype::int8;
    auto coded = plan_dtype(chosen);
    if (coded) {
      plan = std::move(coded);
    } else {
      m.kv_dtype = KvDtype::bf16;
      plan = plan_dtype(chosen);  // the carve follows the last plan made: make the bf16 one again
    }
  }
  if (!plan) return make_error(plan.error());
  m.plan = *plan;
  m.kv_blocks = int(std::min<int64_t>(m.plan.kv_blocks, INT32_MAX));
  m.all_resident = m.n_moe_layers == 0 || m.plan.n_islands >= int64_t(m.n_moe_layers) * m.n_experts;

  ExpertHostSource src;
  if (m.n_moe_layers > 0) {
    MOE_TRY(m.expert_source(src));
  } else {
    // A dense model: the arena still needs a source; one dummy layer.
    src.n_layers = 1;
    src.n_experts = 1;
    src.blob_bytes = kAlign;
    static const uint8_t zero[kAlign] = {};
    src.blobs = {zero};
  }
  auto arena = IslandArena::create(m.plan, src);
  if (!arena) return make_error(arena.error());
  m.arena = std::move(*arena);

  Carver cw{m.arena->region(m.plan.nonexpert)};
  MOE_TRY(m.carve_weights(cw, true));
  Carver cs{m.arena->region(m.plan.workspace)};
  m.carve_workspace(cs);
  if (m.trace_dev)
    MOE_CUDA_TRY(cudaMemcpy(m.trace_dev, m.trace_host.data(), m.trace_host.size() * 2, cudaMemcpyHostToDevice));
  if (m.attn_split_counts)
    MOE_CUDA_TRY(cudaMemset(m.attn_split_counts, 0, size_t(cuda::kGemvMaxTokens) * d.n_heads * sizeof(uint32_t)));
  // KV, block-major from the arena's top down (docs/kv-islands-trade.md):
  // block b holds every layer's K then V rows at kv_block_offset(b), so the
  // pool can grow into the islands below without moving a block. A layer's
  // part of a block is its bf16 rows, or its codes then (16-byte aligned)
  // their scales; its kernels see block 0's rows and a negative block stride.
  const size_t part = m.kv_part_bytes();
  const size_t rows = size_t(kBlockTokens) * d.n_kv_heads;
  const size_t codes_bytes = align_up(rows * d.head_dim, 16);
  uint8_t* block0 = m.arena->base() + m.plan.kv_block_offset(0);
  const int64_t stride = int64_t(m.plan.kv_block_stride);
  const bool coded = kv_coded(m.kv_dtype);
  for (int l = 0; l < d.n_layers; ++l) {
    auto& L = m.layers[size_t(l)];
    if (m.mla) {
      L.latent = reinterpret_cast<bf16*>(block0 + size_t(l) * part);
      L.kv_block_stride = -stride / 2;
      continue;
    }
    uint8_t* kp = block0 + size_t(2 * l) * part;
    uint8_t* vp = block0 + size_t(2 * l + 1) * part;
    L.kv_block_stride = coded ? -stride : -stride / 2;  // codes, or bf16 elements
    L.kv_scale_block_stride = -stride / int64_t(sizeof(float));
    if (coded) {
      L.k_codes = kp;
      L.v_codes = vp;
      L.k_scales = reinterpret_cast<float*>(kp + codes_bytes);
      L.v_scales = reinterpret_cast<float*>(vp + codes_bytes);
    } else {
      L.k_pool = reinterpret_cast<bf16*>(kp);
      L.v_pool = reinterpret_cast<bf16*>(vp);
    }
  }
  m.kv_pool = std::make_unique<KvBlockPool>(m.kv_blocks, kBlockTokens);

  // RoPE table, as the CPU engine computes it.
  {
    const std::vector<float> inv = rope_frequencies(d, &m.attention_factor);
    MOE_CUDA_TRY(cudaMemcpy(m.inv_freq, inv.data(), inv.size() * 4, cudaMemcpyHostToDevice));
  }

  MOE_CUDA_TRY(cudaMallocHost(reinterpret_cast<void**>(&m.pack_host), m.pack_bytes));
  MOE_CUDA_TRY(cudaMallocHost(reinterpret_cast<void**>(&m.sampled_host), kMaxSampleRows * 4));
  MOE_CUDA_TRY(cudaMallocHost(reinterpret_cast<void**>(&m.logits_host), size_t(kMaxSampleRows) * m.vocab * 4));
  MOE_CUDA_TRY(cudaMallocHost(reinterpret_cast<void**>(&m.adjust_host), kMaxPassAdjust * sizeof(TokenAdjust)));
  MOE_CUDA_TRY(cudaMallocHost(reinterpret_cast<void**>(&m.saved_host), kMaxPassAdjust * sizeof(float)));
  MOE_CUDA_TRY(cudaMallocHost(reinterpret_cast<void**>(&m.masks_host), size_t(kMaxSampleRows) * size_t(m.mask_words) * 4));
  if (m.n_moe_layers > 0) {
    MOE_CUDA_TRY(cudaMallocHost(reinterpret_cast<void**>(&m.tables_host), size_t(m.n_moe_layers) * m.n_experts * sizeof(void*)));
    MOE_CUDA_TRY(cudaMallocHost(reinterpret_cast<void**>(&m.ids_host), size_t(m.n_moe_layers) * m.max_pass_tokens * m.top_k * 4));
    std::memset(m.tables_host, 0, size_t(m.n_moe_layers) * m.n_experts * sizeof(void*));
    std::unique_ptr<EvictionPolicy> pol;
    switch (opts.policy) {
      case EvictionKind::lru: pol = std::make_unique<LruPolicy>(); break;
      case EvictionKind::lfu: pol = std::make_unique<LfuDecayPolicy>(); break;
      case EvictionKind::ours: pol = std::make_unique<OursPolicy>(); break;
    }
    m.map = std::make_unique<ResidencyMap>(m.n_moe_layers, m.n_experts, m.plan.n_islands, m.layout.blob_bytes, std::move(pol));
    m.predictor = std::make_unique<ExpertPredictor>(m.n_moe_layers, m.n_experts);
    m.bound.resize(size_t(m.n_moe_layers));
    MOE_CUDA_TRY(cudaMallocHost(reinterpret_cast<void**>(&m.on_gpu_host), size_t(m.n_moe_layers) * m.n_experts));
    MOE_CUDA_TRY(cudaMallocHost(reinterpret_cast<void**>(&m.guess_ids_host), size_t(cuda::kGemvMaxTokens) * m.top_k * 4));
    for (int l = 0; l < d.n_layers; ++l)
      if (d.moe_layer_index(l) >= 0) m.layer_of_moe.push_back(l);
    if (!m.all_resident && m.stage_slots) MOE_TRY(m.start_staging());
    if (!m.all_resident && opts.host_experts != HostShareMode::off) {
      // Copy mode splits a layer's misses on the host's clock; streamed
      // passes hand the host its share through mapped memory.
      MOE_TRY(opts.misses == MissMode::copy ? m.start_host_experts() : m.start_host_share());
    }
    if (m.all_resident) {
      // Every expert into its island now; the pointer tables never change.
      for (int ml = 0; ml < m.n_moe_layers; ++ml)
        for (int e = 0; e < m.n_experts; ++e) {
          auto p = m.arena->request(*m.map, ml, e, m.st);
          if (!p) return make_error(p.error());
          m.tables_host[size_t(ml) * m.n_experts + e] = *p;
          MOE_TRY(m.arena->release(*m.map, ml, e, m.st));
        }
      MOE_CUDA_TRY(cudaMemcpyAsync(m.blob_tables, m.tables_host, size_t(m.n_moe_layers) * m.n_experts * sizeof(void*),
                                   cudaMemcpyHostToDevice, m.st));
      ++m.residency_version;
    }
  }
  // Under a budget the pool may grow into the islands above one layer's
  // experts (docs/kv-islands-trade.md).
  m.kv_floor = m.kv_blocks;
  m.kv_trade = opts.kv_trade && !m.all_resident && m.map;
  m.kv_reachable = m.kv_trade ? std::min<int64_t>(m.plan.kv_blocks_reachable(m.n_experts), INT32_MAX / 2) : m.kv_blocks;
  MOE_TRY(m.setup_fused());
  MOE_TRY(m.arena->synchronize());
  MOE_CUDA_TRY(cudaStreamSynchronize(m.st));
  if (m.meter) (void)eng->device_memory();  // the peak starts at the ready state
  std::fprintf(stderr, "moe-worker: cuda backend on %s; %s; dense weights %s%s; KV rows %s; experts %s\n",
               dev->c_str(), m.plan.describe().c_str(), dense_name(m.dense),
               m.embed_host ? ", embedding in host memory" : "",
               m.kv_dtype == KvDtype::bf16 ? "bf16" : m.kv_dtype == KvDtype::int8 ? "int8" : "fp8",
               m.all_resident ? "all resident" : "under the budget (islands < experts)");
  if (m.kv_trade)
    std::fprintf(stderr, "moe-worker: the KV cache may grow from %d to %lld blocks (%lld tokens) by taking expert "
                 "islands (keeping at least %d), and gives them back after %d s mostly idle\n", m.kv_blocks,
                 (long long)m.kv_reachable, (long long)m.kv_reachable * kBlockTokens, m.n_experts,
                 opts.kv_give_back_s);
  return Result<std::unique_ptr<CudaEngine>>(std::move(eng));
}

size_t CudaEngine::Impl::kv_part_bytes() const {
  if (mla) return size_t(kBlockTokens) * size_t(latent_width) * 2;
  return kv_pool_bytes(1, kv_dtype, d.n_kv_heads, d.head_dim);
}

size_t CudaEngine::Impl::kv_block_bytes() const { return size_t(mla ? 1 : 2) * d.n_layers * kv_part_bytes(); }

CudaEngine::~CudaEngine() = default;

Status CudaEngine::Impl::setup_fused() {
  const bool int8 = !layers.empty() && layers[0].qkv_w.q != nullptr;  // every dense matrix alike, checked below
  // Why the fused pass cannot serve this engine, or "" (then it is set up).
  auto why_not = [&]() -> std::string {
    if (!opts.fused_decode) return "off";
    if (mla) return "off: latent attention";
    if (n_moe_layers != d.n_layers) return "off: a layer without routed experts";
    if (!fused_layers) return "off: no workspace for it";
    if (!all_resident) return "off: under a budget (it serves passes with every expert resident)";
    if (opts.bench_omit) return "off: kernels left out (benchmark)";
    if (kv_dtype != KvDtype::bf16) return "off: KV rows not in bf16";
    if (dense == DenseDtype::int4) return "off: INT4 dense weights";
    for (const DevLayer& L : layers) {
      if (L.mlp_gu_w) return "off: a shared expert";
      if (!L.router_w || L.router_row >= 0) return "off: the router's rows are not a matrix of their own";
      for (const DenseW* w : {&L.qkv_w, &L.o_w, &L.router_w})
        if (w->q4 || (w->q != nullptr) != int8 || (!w->q && !w->w)) return "off: dense matrices of mixed dtypes";
    }
    return {};
  };
  fused_why = why_not();
  if (!fused_why.empty()) return {};
  fused.n_layers = d.n_layers;
  fused.hidden = hidden;
  fused.n_heads = d.n_heads;
  fused.n_kv = d.n_kv_heads;
  fused.head_dim = d.head_dim;
  fused.n_experts = n_experts;
  fused.top_k = top_k;
  fused.int8 = int8;
  fused.eps = d.rms_eps;
  fused.qk_norm_full_width = d.qk_norm == QkNorm::whole;
  fused.renormalize = d.moe.norm_topk_prob;
  fused.routed_scaling = d.moe.routed_scaling;
  fused.inv_freq = inv_freq;
  fused.attention_factor = attention_factor;
  fused.softmax_scale = softmax_scale;
  fused.layout = layout;
  fused.block_tokens = kBlockTokens;
  fused.forced = opts.uniform_routing_seed != 0 || trace_dev;
  fused.route.seed = opts.uniform_routing_seed;
  fused.route.trace = trace_dev;
  fused.route.trace_tokens = trace_tokens;
  fused.route.trace_layers = n_moe_layers;
  fused.x = x;
  fused.qkv = qkv;
  fused.logits = router_logits;
  int device = 0;
  MOE_CUDA_TRY(cudaGetDevice(&device));
  fused_why = cuda::fused_decode_unsupported(fused, device);
  if (!fused_why.empty()) {
    fused_why = "off: " + fused_why;
    std::fprintf(stderr, "moe-worker: decode passes of one token run as a chain of kernels (the fused pass is %s)\n",
                 fused_why.c_str());
    return {};
  }
  std::vector<cuda::FusedLayer> fl(size_t(d.n_layers));
  auto matrix = [](const DenseW& w) { return cuda::FusedMatrix{w.w, w.q, w.scale}; };
  for (int l = 0; l < d.n_layers; ++l) {
    const DevLayer& L = layers[size_t(l)];
    cuda::FusedLayer& f = fl[size_t(l)];
    f.in_norm = L.in_norm;
    f.post_norm = L.post_norm;
    f.qkv_b = L.qkv_b;
    f.q_norm = L.q_norm;
    f.k_norm = L.k_norm;
    f.qkv = matrix(L.qkv_w);
    f.o = matrix(L.o_w);
    f.router = matrix(L.router_w);
    f.k_pool = L.k_pool;
    f.v_pool = L.v_pool;
    f.kv_block_stride = L.kv_block_stride;
    f.blobs = blob_tables + size_t(L.moe_index) * n_experts;
    f.ids = route_ids + size_t(L.moe_index) * top_k;  // a pass of one token: layer ml's ids at ml * top_k
  }
  MOE_CUDA_TRY(cudaMemcpy(fused_layers, fl.data(), fl.size() * sizeof(cuda::FusedLayer), cudaMemcpyHostToDevice));
  MOE_CUDA_TRY(cudaMemset(fused.counts, 0, size_t(d.n_kv_heads) * sizeof(uint32_t)));
  fused.layers = fused_layers;
  fused_blocks = cuda::fused_decode_blocks(device);
  fused_ok = fused_blocks > 0;
  if (!fused_ok) fused_why = "off: the device's multiprocessors could not be counted";
  else std::fprintf(stderr, "moe-worker: decode passes of one token run every layer in one launch (%d blocks)\n", fused_blocks);
  return {};
}

Status CudaEngine::Impl::start_staging() {
  // What the kernels need; without it the passes run as before, said once.
  bool routers = true;
  for (int ml = 1; ml < n_moe_layers; ++ml) {
    const DevLayer& L = layers[size_t(layer_of_moe[size_t(ml)])];
    routers = routers && (L.router_row >= 0 ? bool(L.mlp_gu_w) : bool(L.router_w));
  }
  if (!routers || top_k > 256 || layout.blob_bytes % 16 != 0 || n_moe_layers < 2) {
    std::fprintf(stderr, "moe-worker: layer-ahead staging off: it needs a router for every MoE layer, top-k <= 256 "
                 "and two MoE layers or more\n");
    return {};
  }
  MOE_CUDA_TRY(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  stage_fork.assign(size_t(n_moe_layers), nullptr);
  for (cudaEvent_t& e : stage_fork) MOE_CUDA_TRY(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  MOE_CUDA_TRY(cudaEventCreateWithFlags(&stage_join, cudaEventDisableTiming));
  MOE_CUDA_TRY(cudaMallocHost(reinterpret_cast<void**>(&stage_landed_host), sizeof(uint32_t)));
  *stage_landed_host = 0;
  std::vector<const uint8_t*> blobs(size_t(n_moe_layers) * n_experts);
  for (int ml = 0; ml < n_moe_layers; ++ml)
    for (int e = 0; e < n_experts; ++e) blobs[size_t(ml) * n_experts + e] = arena->host_blob_on_device({ml, e});
  MOE_CUDA_TRY(cudaMemcpy(host_blobs_dev, blobs.data(), blobs.size() * sizeof(void*), cudaMemcpyHostToDevice));
  MOE_CUDA_TRY(cudaMemset(stage_keys, 0xff, size_t(2 * top_k) * sizeof(int2)));  // (-1, -1): empty
  MOE_CUDA_TRY(cudaMemset(stage_arrived, 0, size_t(2 * top_k) * sizeof(uint32_t)));
  MOE_CUDA_TRY(cudaMemset(stage_landed, 0, sizeof(uint32_t)));
  MOE_CUDA_TRY(cudaMemset(stage_reached, 0, sizeof(int32_t)));
  std::fprintf(stderr, "moe-worker: layer-ahead staging in streamed passes of one token (%d slots, %.1f MiB)\n",
               2 * top_k, double(2 * top_k) * double(stage_slot_bytes) / (1 << 20));
  return {};
}

}  // namespace moe
