#include "train/attnpred_trainer.h"

#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <stdexcept>

#include "artifacts/capture_file.h"
#include "artifacts/trained_file.h"
#include "kernels/attnpred/attnpred.h"

namespace kvs::train {
namespace {

namespace ap = kernels::attnpred;

struct CnnImpl : torch::nn::Module {
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::Conv1d conv3{nullptr};
  CnnImpl() {
    conv1 = register_module(
        "conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, ap::kConv1Channels, 3).padding(1)));
    conv2 = register_module(
        "conv2",
        torch::nn::Conv2d(
            torch::nn::Conv2dOptions(ap::kConv1Channels, ap::kConv2Channels, 3).padding(1)));
    conv3 = register_module("conv3",
                            torch::nn::Conv1d(torch::nn::Conv1dOptions(ap::kConv2Channels, 1, 1)));
  }
  // x [N, H, W] -> [N, W]
  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor h = torch::relu(conv1->forward(x.unsqueeze(1)));
    h = torch::relu(conv2->forward(h));
    h = h.mean(2);  // over time: [N, 32, W]
    return conv3->forward(h).squeeze(1);
  }
  std::vector<float> packed() const {
    std::vector<float> p;
    for (const torch::Tensor& t :
         {conv1->weight, conv1->bias, conv2->weight, conv2->bias, conv3->weight, conv3->bias}) {
      torch::Tensor c = t.detach().to(torch::kFloat32).contiguous().flatten();
      p.insert(p.end(), c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
    }
    return p;
  }
};
TORCH_MODULE(Cnn);

// One (capture, sequence, layer)'s attention rows [S, Hq, Wt] and where they start.
struct Rows {
  std::vector<float> data;
  int steps = 0, heads = 0, width = 0, decode_start = 0;
  const float* row(int s, int h) const {
    return data.data() + (size_t(s) * heads + h) * size_t(width);
  }
};

// The rows of a history per kv head: each the largest of its `group` query heads' rows.
Rows group_rows(const Rows& r, int group) {
  Rows g = r;
  g.heads = r.heads / group;
  g.data.assign(size_t(r.steps) * g.heads * r.width, 0.f);
  for (int s = 0; s < r.steps; ++s)
    for (int h = 0; h < r.heads; ++h) {
      const float* src = r.row(s, h);
      float* dst = g.data.data() + (size_t(s) * g.heads + h / group) * size_t(r.width);
      for (int c = 0; c < r.width; ++c) dst[c] = std::max(dst[c], src[c]);
    }
  return g;
}

struct Sample {
  int rows;  // index into the Rows store
  int head, step, c0, c1;
  int width() const { return c1 - c0; }
};

// Input [H, w] and target [w] of a sample.
void fill(const Rows& r, const Sample& s, int H, float* x, float* y) {
  const int w = s.width();
  for (int i = 0; i < H; ++i) {
    const float* src = r.row(s.step - H + 1 + i, s.head);
    std::copy(src + s.c0, src + s.c1, x + size_t(i) * w);
  }
  const float* t = r.row(s.step + 1, s.head);
  std::copy(t + s.c0, t + s.c1, y);
}

// Batches of one width, in a seeded order.
std::vector<std::vector<int>> make_batches(const std::vector<Sample>& samples,
                                           const std::vector<int>& ids, int batch_size,
                                           std::mt19937_64* rng) {
  std::map<int, std::vector<int>> by_width;
  for (int i : ids) by_width[samples[size_t(i)].width()].push_back(i);
  std::vector<std::vector<int>> batches;
  for (auto& [w, list] : by_width) {
    if (rng) std::shuffle(list.begin(), list.end(), *rng);
    for (size_t i = 0; i < list.size(); i += size_t(batch_size))
      batches.emplace_back(list.begin() + i,
                           list.begin() + std::min(list.size(), i + size_t(batch_size)));
  }
  if (rng) std::shuffle(batches.begin(), batches.end(), *rng);
  return batches;
}

}  // namespace

AttnPredTrainResult train_attnpred(const AttnPredTrainConfig& cfg, const TrainProgress& progress) {
  const AttnPredParams& kn = cfg.knobs;
  const ap::Geometry geo{kn.history, kn.block, kn.sink, kn.recent};
  ap::validate(geo);
  if (kn.block != kAttnBlockSize)
    throw std::invalid_argument("kvs-train attnpred: block " + std::to_string(kn.block) +
                                " differs from the capture files' pooling block " +
                                std::to_string(kAttnBlockSize));
  if (cfg.captures.empty()) throw std::invalid_argument("kvs-train attnpred: no capture files");
  if (cfg.epochs < 1 || cfg.batch_size < 1 || !(cfg.learning_rate > 0) ||
      !(cfg.val_fraction > 0 && cfg.val_fraction < 1))
    throw std::invalid_argument(
        "kvs-train attnpred: need epochs >= 1, batch_size >= 1, learning_rate > 0 and "
        "val_fraction in (0, 1)");
  const int H = kn.history;
  const int k_blocks = (kn.budget_tokens - kn.sink - kn.recent) / kn.block;

  AttnPredTrainResult res;
  std::vector<Rows> store;
  std::vector<Sample> samples;
  std::vector<int64_t> unit_of;  // per sample: its (capture, sequence, layer, head) unit
  int64_t units = 0;
  int most_steps = 0;
  for (size_t ci = 0; ci < cfg.captures.size(); ++ci) {
    const CaptureFile cap = CaptureFile::open(cfg.captures[ci]);
    if (!cap.meta().all_heads())
      throw std::invalid_argument(cfg.captures[ci] + ": captured a subset of the KV heads; "
                                  "train from a capture of every head (kvs-capture without --kv-heads)");
    if (ci == 0) {
      res.shape = cap.meta().shape;
    } else if (cap.meta().shape.fingerprint() != res.shape.fingerprint()) {
      throw std::invalid_argument(cfg.captures[ci] + ": captured from another model than " +
                                  cfg.captures[0] + "; differing fields:\n" +
                                  cap.meta().shape.diff(res.shape));
    }
    for (int l : kn.dense_layers)
      if (l < 0 || l >= res.shape.num_layers)
        throw std::invalid_argument("kvs-train attnpred: dense layer " + std::to_string(l) +
                                    " outside the model's " + std::to_string(res.shape.num_layers));
    bool any_layer = false;
    for (int layer : cap.meta().layers) {
      if (std::find(kn.dense_layers.begin(), kn.dense_layers.end(), layer) != kn.dense_layers.end())
        continue;
      any_layer = true;
      for (size_t si = 0; si < cap.sequences().size(); ++si) {
        const CaptureSequence& seq = cap.sequences()[si];
        most_steps = std::max(most_steps, seq.num_steps());
        if (seq.num_steps() < H + 1) continue;
        Rows r;
        r.data = cap.attn_blocks(int(si), layer);
        r.steps = seq.num_steps();
        r.heads = res.shape.num_q_heads;
        r.width = geo.num_blocks(seq.num_tokens);
        if (kn.group_history) r = group_rows(r, res.shape.group_size());
        r.decode_start = seq.decode_start;
        const int ri = int(store.size());
        store.push_back(std::move(r));
        for (int h = 0; h < store.back().heads; ++h, ++units)
          for (int s = H - 1; s + 1 < store.back().steps; ++s) {
            const int n = seq.decode_start + s + 1;  // tokens row s covers
            Sample smp{ri, h, s, geo.candidate_begin(), geo.candidate_end(n)};
            if (smp.width() < 3) continue;
            samples.push_back(smp);
            unit_of.push_back(units);
          }
      }
    }
    if (!any_layer)
      throw std::invalid_argument(cfg.captures[ci] +
                                  ": no captured layer outside the dense "
                                  "layers; capture compressed layers (kvs-capture --layers)");
  }
  if (samples.empty())
    throw std::invalid_argument(
        "kvs-train attnpred: no training sample: history " + std::to_string(H) + " needs " +
        std::to_string(H + 1) + " decode steps per sequence (" + std::to_string(H) +
        " input rows + 1 target), the captures have at most " + std::to_string(most_steps) +
        (most_steps >= H + 1 ? " (but the contexts leave fewer than 3 candidate blocks)" : "") +
        "; capture with more decode steps (kvs-capture --decode-steps " + std::to_string(2 * H) +
        " or more) or longer prompts");
  if (units < 2)
    throw std::invalid_argument(
        "kvs-train attnpred: one (sequence, layer, head) unit only; "
        "a validation split needs at least 2");

  // Split by unit.
  std::mt19937_64 rng(cfg.seed);
  std::vector<int64_t> order(static_cast<size_t>(units));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  const int64_t n_val = std::max<int64_t>(1, int64_t(double(units) * cfg.val_fraction + 0.5));
  std::vector<char> is_val(size_t(units), 0);
  for (int64_t i = 0; i < n_val; ++i) is_val[size_t(order[size_t(i)])] = 1;
  std::vector<int> train_ids, val_ids;
  for (size_t i = 0; i < samples.size(); ++i)
    (is_val[size_t(unit_of[i])] ? val_ids : train_ids).push_back(int(i));
  if (train_ids.empty() || val_ids.empty())
    throw std::invalid_argument(
        "kvs-train attnpred: the split left no training or no validation "
        "sample; give more captures or change val_fraction");
  res.train_samples = int64_t(train_ids.size());
  res.val_samples = int64_t(val_ids.size());

  torch::manual_seed(cfg.seed);
  at::set_num_threads(std::max(1, cfg.threads));
  at::globalContext().setDeterministicAlgorithms(true, false);
  Cnn model;
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(cfg.learning_rate));

  auto batch_tensors = [&](const std::vector<int>& ids) {
    const int w = samples[size_t(ids[0])].width();
    torch::Tensor x = torch::empty({int64_t(ids.size()), H, w});
    torch::Tensor y = torch::empty({int64_t(ids.size()), w});
    for (size_t i = 0; i < ids.size(); ++i) {
      const Sample& s = samples[size_t(ids[i])];
      fill(store[size_t(s.rows)], s, H, x.data_ptr<float>() + i * size_t(H) * w,
           y.data_ptr<float>() + i * size_t(w));
    }
    return std::make_pair(x, y);
  };
  const auto val_batches = make_batches(samples, val_ids, cfg.batch_size, nullptr);
  double best_recovery = -1, best_val_loss = 0;
  if (progress) {
    std::ostringstream os;
    os << "attnpred: " << res.train_samples << " training and " << res.val_samples
       << " validation samples (" << units << " units, " << n_val << " held out), " << cfg.epochs
       << " epochs";
    progress(os.str());
  }
  for (int epoch = 1; epoch <= cfg.epochs; ++epoch) {
    model->train();
    auto batches = make_batches(samples, train_ids, cfg.batch_size, &rng);
    double loss_sum = 0;
    int64_t seen = 0;
    for (const auto& ids : batches) {
      if (cfg.max_samples > 0 && seen >= cfg.max_samples) break;
      auto [x, y] = batch_tensors(ids);
      opt.zero_grad();
      torch::Tensor loss = torch::mse_loss(model->forward(x), y);
      loss.backward();
      opt.step();
      loss_sum += loss.item<double>() * double(ids.size());
      seen += int64_t(ids.size());
    }
    model->eval();
    torch::NoGradGuard ng;
    double vloss = 0, vrec = 0;
    for (const auto& ids : val_batches) {
      auto [x, y] = batch_tensors(ids);
      torch::Tensor p = model->forward(x);
      vloss += torch::mse_loss(p, y).item<double>() * double(ids.size());
      const int w = int(x.size(2));
      for (int64_t i = 0; i < p.size(0); ++i) {
        const float* pi = p[i].contiguous().data_ptr<float>();
        const float* yi = y.data_ptr<float>() + i * w;
        const double total = std::accumulate(yi, yi + w, 0.0);
        if (k_blocks >= w || total <= 0) {
          vrec += 1.0;
          continue;
        }
        std::vector<uint8_t> flags(size_t(w), 0);
        ap::select_top_blocks_cpu(pi, w, k_blocks, 0, flags.data());
        double got = 0;
        for (int j = 0; j < w; ++j)
          if (flags[size_t(j)]) got += yi[j];
        vrec += got / total;
      }
    }
    AttnPredEpoch e{epoch, seen ? loss_sum / double(seen) : 0.0, vloss / double(val_ids.size()),
                    vrec / double(val_ids.size())};
    res.curve.push_back(e);
    if (e.val_recovery > best_recovery ||
        (e.val_recovery == best_recovery && e.val_loss < best_val_loss)) {
      best_recovery = e.val_recovery;
      best_val_loss = e.val_loss;
      res.best_epoch = epoch;
      res.params = kn;
      res.params.cnn = model->packed();
    }
    if (progress) {
      std::ostringstream os;
      os << "attnpred: epoch " << epoch << "/" << cfg.epochs << "  train mse " << e.train_loss
         << "  val mse " << e.val_loss << "  val recovery " << e.val_recovery
         << (res.best_epoch == epoch ? "  (best)" : "");
      progress(os.str());
    }
  }
  return res;
}

void write_attnpred_trained(const std::string& path, const AttnPredTrainConfig& cfg,
                            const AttnPredTrainResult& res) {
  TrainedFileWriter w(path, "attnpred", res.shape);
  const h5::Group g = w.group();
  write_attnpred_params(g, res.params);
  std::vector<double> curve;
  for (const AttnPredEpoch& e : res.curve)
    curve.insert(curve.end(), {double(e.epoch), e.train_loss, e.val_loss, e.val_recovery});
  h5::write_dataset(g, "loss_curve", curve, {int64_t(res.curve.size()), 4});
  g.set_attr_string("loss_curve_columns", "epoch,train_mse,val_mse,val_recovery");
  g.set_attr_int("best_epoch", res.best_epoch);
  g.set_attr_int("epochs", cfg.epochs);
  g.set_attr_int("batch_size", cfg.batch_size);
  g.set_attr_double("learning_rate", cfg.learning_rate);
  g.set_attr_double("val_fraction", cfg.val_fraction);
  g.set_attr_int("seed", int64_t(cfg.seed));
  g.set_attr_int("train_samples", res.train_samples);
  g.set_attr_int("val_samples", res.val_samples);
  w.commit();
}

}  // namespace kvs::train
