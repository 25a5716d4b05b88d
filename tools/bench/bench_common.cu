#include <cuda_bf16.h>

#include <iostream>
#include <sstream>
#include <stdexcept>

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

bool parse_options(int argc, char** argv, const boost::program_options::options_description& desc) {
  namespace po = boost::program_options;
  po::variables_map vm;
  po::store(po::parse_command_line(argc, argv, desc), vm);
  if (vm.count("help")) {
    std::cout << desc << "\n";
    return false;
  }
  po::notify(vm);
  return true;
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

}  // namespace kvs::bench
