#include "train/saap_trainer.h"

#include <cstdint>  // before Faiss: its 1.7 headers use uint8_t without including <cstdint>
#include <faiss/Clustering.h>
#include <faiss/IndexFlat.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <stdexcept>

#include "artifacts/capture_file.h"
#include "artifacts/trained_file.h"
#include "kernels/common/rope.h"
#include "kernels/saap/saap.h"

namespace kvs::train {
namespace {

std::string str(int64_t x) { return std::to_string(x); }

// One sequence of one layer: pre-RoPE and RoPE'd q [T, Hq, d] and k [T, Hkv, d], fp32.
struct SeqLayer {
  int T = 0;
  std::vector<float> q_pre, q_rope, k_pre, k_rope;
};

std::vector<float> widen(const std::vector<bf16>& x) {
  std::vector<float> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = bf16_to_float(x[i]);
  return out;
}

// Rows [T, H, d] of head h as a [T, d] tensor on `device`.
torch::Tensor head_rows(const std::vector<float>& x, int T, int H, int d, int h,
                        const torch::Device& device) {
  torch::Tensor all = torch::from_blob(const_cast<float*>(x.data()), {T, H, d}, torch::kFloat32);
  return all.select(1, h).contiguous().to(device);
}

uint64_t mix(uint64_t seed, uint64_t a, uint64_t b) {
  uint64_t h = seed ^ (a * 0x9E3779B97F4A7C15ull) ^ (b * 0xC2B2AE3D27D4EB4Full);
  h ^= h >> 31;
  h *= 0xBF58476D1CE4E5B9ull;
  return h ^ (h >> 29);
}

// The share of each query's attention (over keys [sink, pos + 1 - recent)) in each bucket:
// [B, C]. Two chunked passes over the keys (log-sum-exp, then scatter-add of probabilities),
// so memory is B x chunk whatever the context.
torch::Tensor bucket_targets(const torch::Tensor& q_rope, const torch::Tensor& pos,
                             const torch::Tensor& keys, const torch::Tensor& assign, int sink,
                             int recent, int C, double scale, int chunk) {
  const int64_t B = q_rope.size(0);
  const torch::Tensor limit = pos + 1 - recent;  // exclusive end of each query's keys
  const int64_t end = limit.max().item<int64_t>();
  const auto opts = q_rope.options();
  torch::Tensor lse = torch::full({B}, -std::numeric_limits<float>::infinity(), opts);
  auto chunk_logits = [&](int64_t j0, int64_t j1) {
    torch::Tensor logits = torch::matmul(q_rope, keys.slice(0, j0, j1).t()) * scale;
    const torch::Tensor j = torch::arange(j0, j1, pos.options()).unsqueeze(0);
    return logits.masked_fill(j >= limit.unsqueeze(1), -std::numeric_limits<float>::infinity());
  };
  for (int64_t j0 = sink; j0 < end; j0 += chunk)
    lse = torch::logaddexp(
        lse, torch::logsumexp(chunk_logits(j0, std::min<int64_t>(j0 + chunk, end)), 1));
  torch::Tensor target = torch::zeros({B, C}, opts);
  for (int64_t j0 = sink; j0 < end; j0 += chunk) {
    const int64_t j1 = std::min<int64_t>(j0 + chunk, end);
    const torch::Tensor probs = torch::exp(chunk_logits(j0, j1) - lse.unsqueeze(1));
    target.index_add_(1, assign.slice(0, j0, j1), probs);
  }
  return target;
}

double kl_of(const torch::Tensor& logits, const torch::Tensor& target) {
  const torch::Tensor logp = torch::log_softmax(logits, 1);
  return ((torch::xlogy(target, target) - target * logp).sum() / double(target.size(0)))
      .item<double>();
}

}  // namespace

std::vector<float> kmeans(const float* x, int64_t n, int d, const KMeansOptions& o,
                          const std::string& what) {
  if (o.num_clusters < 1 || o.iterations < 1 || d < 1)
    throw std::invalid_argument("k-means of " + what + ": num_clusters " + str(o.num_clusters) +
                                ", iterations " + str(o.iterations) + " and d " + str(d) +
                                " must all be >= 1");
  if (n < o.num_clusters)
    throw std::invalid_argument("k-means of " + what + ": " + str(n) + " training keys for " +
                                str(o.num_clusters) +
                                " clusters; need at least as many keys as clusters (lower "
                                "--clusters or add capture data)");
  faiss::ClusteringParameters cp;
  cp.niter = o.iterations;
  cp.spherical = o.spherical;
  cp.seed = o.seed;
  cp.max_points_per_centroid = o.max_points_per_centroid;
  cp.verbose = false;
  faiss::Clustering clustering(d, o.num_clusters, cp);
  // As faiss.Kmeans does: inner-product search for spherical k-means, L2 otherwise.
  std::unique_ptr<faiss::Index> index;
  if (o.spherical)
    index = std::make_unique<faiss::IndexFlatIP>(d);
  else
    index = std::make_unique<faiss::IndexFlatL2>(d);
  clustering.train(n, x, *index);  // idx_t is int64_t in every Faiss version
  return clustering.centroids;
}

torch::nn::Sequential make_query_model(int head_dim, int hidden, int num_clusters) {
  return torch::nn::Sequential(torch::nn::Linear(head_dim, hidden), torch::nn::BatchNorm1d(hidden),
                               torch::nn::ReLU(), torch::nn::Linear(hidden, num_clusters));
}

void export_query_model(torch::nn::Sequential& model, SaapParts& parts, int slot, int q_head) {
  if (slot < 0 || slot >= int(parts.per_layer.size()) || q_head < 0 || q_head >= parts.num_q_heads)
    throw std::out_of_range("export_query_model: slot " + str(slot) + " or query head " +
                            str(q_head) + " outside the parts");
  SaapLayerParts& p = parts.per_layer[size_t(slot)];
  const size_t H = size_t(parts.hidden_dim), d = size_t(parts.head_dim);
  const size_t C = size_t(parts.num_clusters), h = size_t(q_head);
  auto put = [](const torch::Tensor& t, std::vector<float>& dst, size_t offset, size_t count) {
    const torch::Tensor c = t.detach().to(torch::kCPU, torch::kFloat32).contiguous();
    if (size_t(c.numel()) != count)
      throw std::invalid_argument("export_query_model: tensor of " + str(c.numel()) +
                                  " values, the parts expect " + str(int64_t(count)));
    std::copy(c.data_ptr<float>(), c.data_ptr<float>() + count, dst.begin() + long(offset));
  };
  auto* lin1 = model[0]->as<torch::nn::Linear>();
  auto* bn = model[1]->as<torch::nn::BatchNorm1d>();
  auto* lin2 = model[3]->as<torch::nn::Linear>();
  if (!lin1 || !bn || !lin2)
    throw std::invalid_argument("export_query_model: not a make_query_model() network");
  put(lin1->weight, p.w1, h * H * d, H * d);
  put(lin1->bias, p.b1, h * H, H);
  put(bn->running_mean, p.bn_mean, h * H, H);
  put(bn->running_var, p.bn_var, h * H, H);
  put(bn->weight, p.bn_weight, h * H, H);
  put(bn->bias, p.bn_bias, h * H, H);
  put(lin2->weight, p.w2, h * C * H, C * H);
  put(lin2->bias, p.b2, h * C, C);
  parts.bn_eps = bn->options.eps();
}

SaapTrainResult train_saap(const std::vector<std::string>& paths, const SaapTrainOptions& o,
                           const SaapProgress& progress) {
  if (paths.empty()) throw std::invalid_argument("kvs-train saap: no capture files");
  if (o.batch < 2)
    throw std::invalid_argument("batch must be >= 2 (batch norm), got " + str(o.batch));
  if (o.iterations < 1) throw std::invalid_argument("iterations must be >= 1");
  if (!(o.val_fraction > 0.0 && o.val_fraction < 1.0))
    throw std::invalid_argument("val_fraction must be in (0, 1), got " +
                                std::to_string(o.val_fraction));
  if (o.sink < 0 || o.recent < 1) throw std::invalid_argument("sink must be >= 0 and recent >= 1");
  if (o.hidden < 8 || o.hidden % 8 != 0)
    throw std::invalid_argument("hidden must be a positive multiple of 8, got " + str(o.hidden));
  if (o.lr <= 0.0 || o.key_chunk < 1 || o.max_val_queries < 1)
    throw std::invalid_argument("lr, key_chunk and max_val_queries must be positive");
  const torch::Device device(o.device);
  std::vector<CaptureFile> caps;
  for (const std::string& p : paths) caps.push_back(CaptureFile::open(p));
  const ModelShape shape = caps[0].meta().shape;
  for (const CaptureFile& c : caps) {
    if (!c.meta().all_heads())
      throw std::invalid_argument(c.path() + ": captured a subset of the KV heads; train from a "
                                  "capture of every head (kvs-capture without --kv-heads)");
    if (c.meta().shape.fingerprint() != shape.fingerprint())
      throw std::invalid_argument(c.path() + ": captured from another model than " +
                                  caps[0].path() + "; differing fields:\n" +
                                  c.meta().shape.diff(shape));
  }
  const int hq = shape.num_q_heads, hkv = shape.num_kv_heads, d = shape.head_dim;
  const int g = shape.group_size(), C = o.kmeans.num_clusters;
  auto is_dense = [&](int l) {
    return std::find(o.dense_layers.begin(), o.dense_layers.end(), l) != o.dense_layers.end();
  };
  std::vector<int> layers = o.layers;
  if (layers.empty()) {
    for (int l : caps[0].meta().layers) {
      bool everywhere = true;
      for (const CaptureFile& c : caps) everywhere = everywhere && c.has_layer(l);
      if (everywhere && !is_dense(l)) layers.push_back(l);
    }
  }
  std::sort(layers.begin(), layers.end());
  layers.erase(std::unique(layers.begin(), layers.end()), layers.end());
  if (layers.empty())
    throw std::invalid_argument("no layer to train (all captured layers are dense)");
  for (int l : layers) {
    if (is_dense(l))
      throw std::invalid_argument("layer " + str(l) + " is in dense_layers; it is never indexed");
    for (const CaptureFile& c : caps)
      if (!c.has_layer(l))
        throw std::invalid_argument(c.path() + ": layer " + str(l) + " was not captured");
  }

  SaapTrainResult res;
  res.shape = shape;
  SaapParts& parts = res.parts;
  parts.num_clusters = C;
  parts.hidden_dim = o.hidden;
  parts.head_dim = d;
  parts.num_q_heads = hq;
  parts.num_kv_heads = hkv;
  parts.spherical = o.kmeans.spherical;
  parts.probes = std::min(o.probes, C);
  parts.sink_tokens = o.sink;
  parts.recent_tokens = o.recent;
  parts.dense_layers = o.dense_layers;
  parts.layers = layers;
  parts.allocate();
  const int eval_every = o.eval_every > 0 ? o.eval_every : std::max(1, o.iterations / 10);
  res.val_steps.push_back(0);
  for (int s = eval_every; s < o.iterations; s += eval_every) res.val_steps.push_back(s);
  res.val_steps.push_back(o.iterations);
  const std::vector<float> inv_freq = rope_inv_freq(shape.rope, d);
  const double scale = shape.scale();

  for (size_t slot = 0; slot < layers.size(); ++slot) {
    const int layer = layers[slot];
    std::vector<SeqLayer> seqs;
    for (const CaptureFile& c : caps)
      for (int si = 0; si < int(c.sequences().size()); ++si) {
        SeqLayer s;
        s.T = c.sequences()[size_t(si)].num_tokens;
        s.q_pre = widen(c.q_pre(si, layer));
        s.k_pre = widen(c.k_pre(si, layer));
        std::vector<int32_t> positions(static_cast<size_t>(s.T));
        std::iota(positions.begin(), positions.end(), 0);
        s.q_rope = s.q_pre;
        s.k_rope = s.k_pre;
        kernels::rope_cpu(s.q_rope.data(), s.T, hq, d, positions.data(), inv_freq.data(), false);
        kernels::rope_cpu(s.k_rope.data(), s.T, hkv, d, positions.data(), inv_freq.data(), false);
        seqs.push_back(std::move(s));
      }
    SaapLayerParts& lp = parts.per_layer[slot];
    for (int kvh = 0; kvh < hkv; ++kvh) {
      const std::string what = "layer " + str(layer) + " kv head " + str(kvh);
      if (progress) progress(what + " k-means", 0, 1, 0.0);
      std::vector<float> train_keys;
      for (const SeqLayer& s : seqs)
        for (int t = o.sink; t < s.T; ++t) {
          const float* k = s.k_pre.data() + (size_t(t) * hkv + kvh) * d;
          train_keys.insert(train_keys.end(), k, k + d);
        }
      KMeansOptions km = o.kmeans;
      km.seed = int(mix(uint64_t(o.kmeans.seed), uint64_t(layer), uint64_t(kvh)) & 0x7fffffff);
      const std::vector<float> cent =
          kmeans(train_keys.data(), int64_t(train_keys.size() / d), d, km, what);
      std::copy(cent.begin(), cent.end(), lp.centroids.begin() + long(size_t(kvh) * C * d));
      std::vector<float> norms(static_cast<size_t>(C));
      for (int c = 0; c < C; ++c) {
        double s2 = 0.0;
        for (int k = 0; k < d; ++k) s2 += double(cent[size_t(c) * d + k]) * cent[size_t(c) * d + k];
        norms[size_t(c)] = float(s2);
      }
      // Bucket of every key with the runtime's own rule (kernels/saap), so that the targets
      // describe exactly the buckets the engine will probe.
      std::vector<torch::Tensor> assign_t, keys_t;
      std::vector<double> bucket(static_cast<size_t>(C), 0.0);
      double total = 0.0;
      for (const SeqLayer& s : seqs) {
        std::vector<int64_t> a(static_cast<size_t>(s.T), 0);
#pragma omp parallel for schedule(static)
        for (int t = o.sink; t < s.T; ++t)
          a[size_t(t)] = kernels::saap::nearest_centroid_cpu(
              s.k_pre.data() + (size_t(t) * hkv + kvh) * d, cent.data(), norms.data(), C, d);
        for (int t = o.sink; t < s.T; ++t) {
          if (a[size_t(t)] < 0)
            throw std::runtime_error(
                "kvs-train saap: layer " + str(layer) + " kv head " + str(kvh) +
                ": the key at "
                "token " +
                str(t) + " of sequence " + str(&s - seqs.data()) +
                " scores NaN against every centroid (a NaN or inf in the capture's keys)");
          bucket[size_t(a[size_t(t)])] += 1.0;
          total += 1.0;
        }
        assign_t.push_back(torch::from_blob(a.data(), {s.T}, torch::kInt64).clone().to(device));
        keys_t.push_back(head_rows(s.k_rope, s.T, hkv, d, kvh, device));
      }
      double sq = 0.0;
      for (double n : bucket) sq += n * n;
      const double imbalance = total > 0 ? C * sq / (total * total) : 0.0;

      for (int j = 0; j < g; ++j) {
        const int qh = kvh * g + j;
        const std::string head = "layer " + str(layer) + " head " + str(qh);
        SaapHeadReport rep;
        rep.layer = layer;
        rep.q_head = qh;
        rep.kmeans_imbalance = imbalance;
        // Eligible positions (at least one key before the dense window), split per sequence.
        std::vector<std::vector<int64_t>> train_pos(seqs.size());
        std::vector<std::pair<int, int64_t>> val_all;
        for (size_t si = 0; si < seqs.size(); ++si) {
          std::vector<int64_t> el;
          for (int p = o.sink + o.recent; p < seqs[si].T; ++p) el.push_back(p);
          const size_t n_val = size_t(std::floor(double(el.size()) * o.val_fraction));
          train_pos[si].assign(el.begin(), el.end() - long(n_val));
          for (size_t i = el.size() - n_val; i < el.size(); ++i)
            val_all.push_back({int(si), el[i]});
          rep.train_queries += int(train_pos[si].size());
        }
        std::vector<size_t> usable;
        for (size_t si = 0; si < seqs.size(); ++si)
          if (train_pos[si].size() >= 2) usable.push_back(si);
        if (usable.empty() || val_all.empty())
          throw std::invalid_argument(
              head + ": no sequence has enough queries beyond the dense window (sink " +
              str(o.sink) + " + recent " + str(o.recent) + " tokens) for training (>= 2) and " +
              "validation; capture longer sequences or lower --recent");
        std::vector<std::pair<int, int64_t>> val;
        const size_t nv = std::min(val_all.size(), size_t(o.max_val_queries));
        for (size_t i = 0; i < nv; ++i) val.push_back(val_all[i * val_all.size() / nv]);
        rep.val_queries = int(val.size());
        std::vector<torch::Tensor> qpre_t, qrope_t;
        for (const SeqLayer& s : seqs) {
          qpre_t.push_back(head_rows(s.q_pre, s.T, hq, d, qh, device));
          qrope_t.push_back(head_rows(s.q_rope, s.T, hq, d, qh, device));
        }
        auto batch_of = [&](size_t si, const std::vector<int64_t>& pos, torch::Tensor& x,
                            torch::Tensor& target) {
          const torch::Tensor p = torch::from_blob(const_cast<int64_t*>(pos.data()),
                                                   {int64_t(pos.size())}, torch::kInt64)
                                      .clone()
                                      .to(device);
          x = qpre_t[si].index_select(0, p);
          target = bucket_targets(qrope_t[si].index_select(0, p), p, keys_t[si], assign_t[si],
                                  o.sink, o.recent, C, scale, o.key_chunk);
        };
        std::vector<torch::Tensor> val_x, val_target;
        for (size_t i = 0; i < val.size();) {
          size_t k = i;
          std::vector<int64_t> pos;
          while (k < val.size() && val[k].first == val[i].first && pos.size() < size_t(o.batch))
            pos.push_back(val[k++].second);
          torch::Tensor x, t;
          batch_of(size_t(val[i].first), pos, x, t);
          val_x.push_back(x);
          val_target.push_back(t);
          i = k;
        }
        const torch::Tensor vx = torch::cat(val_x), vt = torch::cat(val_target);

        const uint64_t head_seed = mix(o.seed, uint64_t(layer), uint64_t(qh));
        torch::manual_seed(head_seed);
        torch::nn::Sequential model = make_query_model(d, o.hidden, C);
        model->to(device);
        torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(o.lr));
        auto validate = [&]() {
          torch::NoGradGuard no_grad;
          model->eval();
          return kl_of(model->forward(vx), vt);
        };
        rep.val_kl_init = validate();
        rep.val_kl.push_back(float(rep.val_kl_init));
        std::mt19937_64 rng(head_seed);
        std::vector<int64_t> pick;
        for (int it = 0; it < o.iterations; ++it) {
          const size_t si = usable[size_t(rng() % usable.size())];
          pick = train_pos[si];
          if (pick.size() > size_t(o.batch)) {
            for (size_t i = 0; i < size_t(o.batch); ++i)  // partial Fisher-Yates
              std::swap(pick[i], pick[i + size_t(rng() % (pick.size() - i))]);
            pick.resize(size_t(o.batch));
          }
          torch::Tensor x, target;
          batch_of(si, pick, x, target);
          model->train();
          const torch::Tensor logp = torch::log_softmax(model->forward(x), 1);
          const torch::Tensor loss = torch::nn::functional::kl_div(
              logp, target, torch::nn::functional::KLDivFuncOptions().reduction(torch::kBatchMean));
          opt.zero_grad();
          loss.backward();
          opt.step();
          rep.loss.push_back(loss.item<float>());
          if ((it + 1) % eval_every == 0 || it + 1 == o.iterations) {
            if (int(rep.val_kl.size()) < int(res.val_steps.size()))
              rep.val_kl.push_back(float(validate()));
          }
          if (progress) progress(head, it + 1, o.iterations, rep.loss.back());
        }
        rep.val_kl_final = rep.val_kl.back();
        model->eval();
        export_query_model(model, parts, int(slot), qh);
        res.heads.push_back(std::move(rep));
      }
    }
  }
  parts.validate(&shape);
  return res;
}

void write_saap_trained(const std::string& path, const SaapTrainResult& r,
                        const SaapTrainOptions& o) {
  TrainedFileWriter w(path, "saap", r.shape);
  write_saap_parts(w.group(), r.parts);
  const h5::Group t = w.root().create_group("training");
  const int64_t n = int64_t(r.heads.size());
  const int64_t iters = n ? int64_t(r.heads[0].loss.size()) : 0;
  const int64_t evals = int64_t(r.val_steps.size());
  std::vector<int32_t> heads, train_q, val_q;
  std::vector<float> loss, val, init, fin, imb;
  for (const SaapHeadReport& h : r.heads) {
    heads.push_back(h.layer);
    heads.push_back(h.q_head);
    loss.insert(loss.end(), h.loss.begin(), h.loss.end());
    val.insert(val.end(), h.val_kl.begin(), h.val_kl.end());
    init.push_back(float(h.val_kl_init));
    fin.push_back(float(h.val_kl_final));
    imb.push_back(float(h.kmeans_imbalance));
    train_q.push_back(h.train_queries);
    val_q.push_back(h.val_queries);
  }
  h5::write_dataset(t, "heads", heads, {n, 2});
  h5::write_dataset(t, "loss", loss, {n, iters});
  h5::write_dataset(t, "val_kl", val, {n, evals});
  h5::write_dataset(t, "val_steps", std::vector<int32_t>(r.val_steps.begin(), r.val_steps.end()),
                    {evals});
  h5::write_dataset(t, "val_kl_init", init, {n});
  h5::write_dataset(t, "val_kl_final", fin, {n});
  h5::write_dataset(t, "kmeans_imbalance", imb, {n});
  h5::write_dataset(t, "train_queries", train_q, {n});
  h5::write_dataset(t, "val_queries", val_q, {n});
  t.set_attr_int("iterations", o.iterations);
  t.set_attr_int("batch", o.batch);
  t.set_attr_double("lr", o.lr);
  t.set_attr_int("kmeans_iterations", o.kmeans.iterations);
  t.set_attr_int("kmeans_seed", o.kmeans.seed);
  t.set_attr_int("seed", int64_t(o.seed & 0x7fffffffffffffffull));
  t.set_attr_double("val_fraction", o.val_fraction);
  t.set_attr_string("targets",
                    "decode-faithful: keys [sink, p + 1 - recent), causal, "
                    "normalised over those keys");
  w.commit();
}

}  // namespace kvs::train
