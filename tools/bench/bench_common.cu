#include <cuda_bf16.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <stdexcept>

#include "runtime/eval/report.h"
#include "tools/bench/bench_common.h"

namespace kvs::bench {
namespace {

__global__ void fill_random_bf16(__nv_bfloat16* x, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    x[i] = __float2bfloat16_rn(float(hash_index(i, seed)) * (4.f / 4294967296.f) - 2.f);
  }
}

}  // namespace

void fill_random(bf16* x, size_t n, uint32_t seed) {
  fill_random_bf16<<<2048, 256>>>(reinterpret_cast<__nv_bfloat16*>(x), n, seed);
  KVS_CUDA_CHECK(cudaGetLastError());
}

float median(std::vector<float> v) {
  if (v.empty()) throw std::invalid_argument("bench median: no samples");
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5f * (v[n / 2 - 1] + v[n / 2]);
}

std::vector<int> parse_counts(const std::string& text, const char* option) {
  std::vector<int> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.empty()) continue;
    int64_t mult = 1;
    const char suffix = item.back();
    if (suffix == 'K' || suffix == 'k') mult = 1024;
    if (suffix == 'M' || suffix == 'm') mult = 1024 * 1024;
    if (mult != 1) item.pop_back();
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != item.size() || v <= 0 || v * mult > (1LL << 30))
      throw std::invalid_argument(std::string("--") + option + ": '" + item +
                                  "' is not a positive count (e.g. 8K,32K or 1,8)");
    out.push_back(int(v * mult));
  }
  if (out.empty()) throw std::invalid_argument(std::string("--") + option + " is empty");
  return out;
}

std::string JsonValue::number_text(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.15g", v);
  return buf;
}

JsonValue::JsonValue(const std::string& s) : text_(eval::json_quote(s)) {}

JsonObject& JsonObject::add(std::initializer_list<Field> fields) {
  fields_.insert(fields_.end(), fields.begin(), fields.end());
  return *this;
}

std::string JsonObject::text() const {
  std::string t = "{";
  for (size_t i = 0; i < fields_.size(); ++i)
    t += (i ? ", " : "") + eval::json_quote(fields_[i].key) + ": " + fields_[i].value.text();
  return t + "}";
}

BenchReport::BenchReport(const std::string& impl, const std::string& command, std::string path)
    : path_(std::move(path)) {
  int dev = 0;
  KVS_CUDA_CHECK(cudaGetDevice(&dev));
  cudaDeviceProp prop{};
  KVS_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  meta_.add({{"impl", impl}, {"device", prop.name}, {"command", command}});
}

void BenchReport::add_row(const JsonObject& row) {
  rows_.push_back(row);
  save();
}

void BenchReport::add_skipped(const std::string& note) {
  skipped_.push_back(note);
  save();
}

void BenchReport::save() const {
  if (path_.empty()) return;
  const std::string tmp = path_ + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream js(tmp);
    js << "{\n  \"meta\": " << meta_.text() << ",\n  \"rows\": [";
    for (size_t i = 0; i < rows_.size(); ++i) js << (i ? ",\n    " : "\n    ") << rows_[i].text();
    js << (rows_.empty() ? "],\n" : "\n  ],\n") << "  \"skipped\": [";
    for (size_t i = 0; i < skipped_.size(); ++i)
      js << (i ? ",\n    " : "\n    ") << eval::json_quote(skipped_[i]);
    js << (skipped_.empty() ? "]\n}\n" : "\n  ]\n}\n");
    js.close();
    if (!js) throw std::runtime_error("cannot write --json file " + tmp);
  }
  if (std::rename(tmp.c_str(), path_.c_str()) != 0)
    throw std::runtime_error("cannot rename " + tmp + " to --json file " + path_);
}

}  // namespace kvs::bench
