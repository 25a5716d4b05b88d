#include "capture/safetensors.h"

#include "artifacts/model_shape.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <boost/property_tree/json_parser.hpp>
#include <boost/property_tree/ptree.hpp>
#include <cerrno>
#include <cstring>
#include <limits>
#include <sstream>
#include <stdexcept>

#include "kernels/common/bf16.h"

namespace kvs {

namespace pt = boost::property_tree;

namespace {

struct DtypeName {
  StDtype dtype;
  const char* name;
  size_t size;
};

constexpr DtypeName kDtypes[] = {
    {StDtype::BOOL, "BOOL", 1}, {StDtype::U8, "U8", 1},           {StDtype::I8, "I8", 1},
    {StDtype::I16, "I16", 2},   {StDtype::U16, "U16", 2},         {StDtype::F16, "F16", 2},
    {StDtype::BF16, "BF16", 2}, {StDtype::I32, "I32", 4},         {StDtype::U32, "U32", 4},
    {StDtype::F32, "F32", 4},   {StDtype::F64, "F64", 8},         {StDtype::I64, "I64", 8},
    {StDtype::U64, "U64", 8},   {StDtype::F8_E4M3, "F8_E4M3", 1}, {StDtype::F8_E5M2, "F8_E5M2", 1},
};

// The format's reference implementation refuses headers above 100 MB; so do we, so that a
// corrupt length cannot make us allocate gigabytes.
constexpr uint64_t kMaxHeaderBytes = 100u * 1000u * 1000u;

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw std::runtime_error("safetensors '" + path + "': " + what);
}

// A JSON number as PropertyTree keeps it (text): a non-negative integer, nothing else.
bool parse_u64(const std::string& s, uint64_t* out) {
  if (s.empty() || s.size() > 20) return false;
  uint64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    const uint64_t d = uint64_t(c - '0');
    if (v > (std::numeric_limits<uint64_t>::max() - d) / 10) return false;
    v = v * 10 + d;
  }
  *out = v;
  return true;
}

// PropertyTree stores a JSON array as children with empty keys, and an empty array as a
// childless node with empty data: both read back here as a list of integers.
bool parse_u64_array(const pt::ptree& node, std::vector<uint64_t>* out) {
  out->clear();
  if (node.empty()) return node.data().empty();
  for (const auto& child : node) {
    if (!child.first.empty() || !child.second.empty()) return false;
    uint64_t v;
    if (!parse_u64(child.second.data(), &v)) return false;
    out->push_back(v);
  }
  return true;
}

float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (mant << 13);  // inf / NaN
  } else if (exp != 0) {
    u = sign | ((exp + 112u) << 23) | (mant << 13);  // rebias 15 -> 127
  } else if (mant == 0) {
    u = sign;
  } else {
    // Subnormal half: normalize into an fp32 normal number.
    int e = -1;
    do {
      ++e;
      mant <<= 1;
    } while ((mant & 0x400u) == 0);
    u = sign | (uint32_t(112 - e) << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

std::string join_path(const std::string& folder, const std::string& name) {
  if (folder.empty() || folder.back() == '/') return folder + name;
  return folder + "/" + name;
}

bool file_exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

}  // namespace

const char* to_string(StDtype dtype) {
  for (const auto& d : kDtypes)
    if (d.dtype == dtype) return d.name;
  return "?";
}

size_t dtype_size(StDtype dtype) {
  for (const auto& d : kDtypes)
    if (d.dtype == dtype) return d.size;
  return 0;
}

bool is_float_dtype(StDtype dtype) {
  return dtype == StDtype::BF16 || dtype == StDtype::F16 || dtype == StDtype::F32;
}

int64_t StTensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string shape_to_string(const std::vector<int64_t>& shape) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < shape.size(); ++i) s << (i ? ", " : "") << shape[i];
  s << "]";
  return s.str();
}

void convert_to_f32(StDtype dtype, const uint8_t* src, size_t count, float* dst) {
  switch (dtype) {
    case StDtype::F32:
      std::memcpy(dst, src, count * sizeof(float));
      return;
    case StDtype::BF16:
      for (size_t i = 0; i < count; ++i) {
        bf16 v;
        std::memcpy(&v.bits, src + 2 * i, 2);
        dst[i] = bf16_to_float(v);
      }
      return;
    case StDtype::F16:
      for (size_t i = 0; i < count; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        dst[i] = half_to_float(h);
      }
      return;
    default:
      throw std::invalid_argument(std::string("convert_to_f32: dtype ") + to_string(dtype) +
                                  " is not a float weight dtype (BF16, F16, F32)");
  }
}

// ---------------------------------------------------------------------------------------------

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(path, std::string("cannot open: ") + std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    fail(path, std::string("cannot stat: ") + std::strerror(err));
  }
  map_size_ = size_t(st.st_size);
  if (map_size_ < 8) {
    ::close(fd);
    fail(path, "truncated file: " + std::to_string(map_size_) +
                   " bytes, shorter than the 8-byte header length");
  }
  void* m = ::mmap(nullptr, map_size_, PROT_READ, MAP_PRIVATE, fd, 0);
  const int err = errno;
  ::close(fd);  // the mapping keeps the file alive
  if (m == MAP_FAILED) fail(path, std::string("cannot mmap: ") + std::strerror(err));
  map_ = static_cast<const uint8_t*>(m);

  try {
    uint64_t header_len = 0;
    for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | map_[i];
    if (header_len > map_size_ - 8)
      fail(path, "header length " + std::to_string(header_len) +
                     " runs past the end of the file (" + std::to_string(map_size_) +
                     " bytes): truncated or not a safetensors file");
    if (header_len > kMaxHeaderBytes)
      fail(path, "header length " + std::to_string(header_len) + " exceeds the 100 MB limit");
    if (header_len < 2) fail(path, "bad header: length " + std::to_string(header_len));
    data_ = map_ + 8 + header_len;
    data_size_ = map_size_ - 8 - header_len;
    parse_header(std::string(reinterpret_cast<const char*>(map_ + 8), size_t(header_len)));
  } catch (...) {
    ::munmap(const_cast<uint8_t*>(map_), map_size_);
    map_ = nullptr;
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() {
  if (map_) ::munmap(const_cast<uint8_t*>(map_), map_size_);
}

void SafetensorsFile::parse_header(const std::string& header) {
  if (header[0] != '{') fail(path_, "bad header: the JSON header must start with '{'");
  pt::ptree root;
  try {
    std::istringstream in(header);
    pt::read_json(in, root);
  } catch (const pt::json_parser_error& e) {
    fail(path_,
         "bad header: invalid JSON (" + e.message() + " at line " + std::to_string(e.line()) + ")");
  }

  for (const auto& [name, node] : root) {
    if (name == "__metadata__") {
      for (const auto& [key, value] : node) {
        if (!value.empty())
          fail(path_, "bad header: __metadata__ value '" + key + "' is not a string");
        metadata_[key] = value.data();
      }
      continue;
    }
    auto bad = [&](const std::string& what) {
      fail(path_, "bad header: tensor '" + name + "': " + what);
    };
    if (name.empty()) bad("the header must be a JSON object keyed by tensor name");
    if (tensors_.count(name)) bad("listed twice");

    StTensorInfo info;
    info.name = name;
    const auto dtype_node = node.get_child_optional("dtype");
    if (!dtype_node || !dtype_node->empty()) bad("missing or non-string 'dtype'");
    const std::string dtype_name = dtype_node->data();
    bool known = false;
    for (const auto& d : kDtypes)
      if (dtype_name == d.name) info.dtype = d.dtype, known = true;
    if (!known) bad("unknown dtype '" + dtype_name + "'");

    const auto shape_node = node.get_child_optional("shape");
    std::vector<uint64_t> dims, offsets;
    if (!shape_node || !parse_u64_array(*shape_node, &dims))
      bad("missing 'shape' or it is not a list of non-negative integers");
    const auto off_node = node.get_child_optional("data_offsets");
    if (!off_node || !parse_u64_array(*off_node, &offsets) || offsets.size() != 2)
      bad("missing 'data_offsets' or it is not [begin, end]");

    // numel * size with overflow checks: a corrupt shape must not wrap around to a match.
    uint64_t bytes = dtype_size(info.dtype);
    for (uint64_t d : dims) {
      if (d > uint64_t(std::numeric_limits<int64_t>::max())) bad("dimension out of range");
      if (d != 0 && bytes > std::numeric_limits<uint64_t>::max() / d) bad("shape overflows");
      bytes *= d;
      info.shape.push_back(int64_t(d));
    }
    info.begin = offsets[0];
    info.end = offsets[1];
    if (info.begin > info.end)
      bad("data_offsets [" + std::to_string(info.begin) + ", " + std::to_string(info.end) +
          "] are reversed");
    if (info.end > data_size_)
      bad("data_offsets [" + std::to_string(info.begin) + ", " + std::to_string(info.end) +
          "] run past the data area (" + std::to_string(data_size_) + " bytes): truncated file");
    if (info.end - info.begin != bytes)
      bad("data_offsets span " + std::to_string(info.end - info.begin) + " bytes but dtype " +
          dtype_name + " x shape " + shape_to_string(info.shape) + " needs " +
          std::to_string(bytes));
    tensors_.emplace(name, std::move(info));
  }

  // Tensors may not share bytes (the format lays them out back to back).
  std::vector<const StTensorInfo*> by_offset;
  for (const auto& [name, info] : tensors_)
    if (info.nbytes() > 0) by_offset.push_back(&info);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const StTensorInfo* a, const StTensorInfo* b) { return a->begin < b->begin; });
  for (size_t i = 1; i < by_offset.size(); ++i)
    if (by_offset[i]->begin < by_offset[i - 1]->end)
      fail(path_, "bad header: tensors '" + by_offset[i - 1]->name + "' and '" +
                      by_offset[i]->name + "' overlap");
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  for (const auto& kv : tensors_) out.push_back(kv.first);
  return out;
}

const StTensorInfo& SafetensorsFile::info(const std::string& name) const {
  const auto it = tensors_.find(name);
  if (it == tensors_.end()) fail(path_, "missing tensor '" + name + "'");
  return it->second;
}

const StTensorInfo& SafetensorsFile::require(const std::string& name,
                                             const std::vector<int64_t>& expected) const {
  const StTensorInfo& i = info(name);
  if (i.shape != expected)
    fail(path_, "tensor '" + name + "' has shape " + shape_to_string(i.shape) + ", expected " +
                    shape_to_string(expected));
  return i;
}

std::vector<float> SafetensorsFile::read_f32(const std::string& name) const {
  const StTensorInfo& i = info(name);
  if (!is_float_dtype(i.dtype))
    fail(path_, "tensor '" + name + "' has dtype " + to_string(i.dtype) +
                    "; only BF16, F16 and F32 weights are supported");
  std::vector<float> out(size_t(i.numel()));
  convert_to_f32(i.dtype, data(i), out.size(), out.data());
  return out;
}

// ---------------------------------------------------------------------------------------------

SafetensorsModel::SafetensorsModel(const std::string& folder) : folder_(folder) {
  const std::string single = join_path(folder, "model.safetensors");
  const std::string index = join_path(folder, "model.safetensors.index.json");
  if (file_exists(index)) {
    pt::ptree root;
    try {
      pt::read_json(index, root);
    } catch (const pt::json_parser_error& e) {
      throw std::runtime_error("safetensors index '" + index + "': invalid JSON (" + e.message() +
                               " at line " + std::to_string(e.line()) + ")");
    }
    const auto map = root.get_child_optional("weight_map");
    if (!map || map->empty())
      throw std::runtime_error("safetensors index '" + index + "': missing or empty 'weight_map'");
    std::map<std::string, const SafetensorsFile*> by_shard;
    for (const auto& [name, shard_node] : *map) {
      const std::string shard = shard_node.data();
      if (shard.empty() || !shard_node.empty() || shard.find('/') != std::string::npos)
        throw std::runtime_error("safetensors index '" + index + "': tensor '" + name +
                                 "' maps to '" + shard + "', expected a file name in the folder");
      auto it = by_shard.find(shard);
      if (it == by_shard.end()) {
        const std::string shard_path = join_path(folder, shard);
        if (!file_exists(shard_path))
          throw std::runtime_error("safetensors index '" + index + "': shard '" + shard_path +
                                   "' (for tensor '" + name + "') does not exist");
        files_.push_back(std::make_unique<SafetensorsFile>(shard_path));
        it = by_shard.emplace(shard, files_.back().get()).first;
      }
      if (!it->second->contains(name))
        throw std::runtime_error("safetensors index '" + index + "' maps tensor '" + name +
                                 "' to '" + it->second->path() + "', which does not hold it");
      if (!where_.emplace(name, it->second).second)
        throw std::runtime_error("safetensors index '" + index + "': tensor '" + name +
                                 "' listed twice");
    }
  } else if (file_exists(single)) {
    files_.push_back(std::make_unique<SafetensorsFile>(single));
    for (const auto& name : files_.back()->names()) where_.emplace(name, files_.back().get());
  } else {
    throw std::runtime_error("model folder '" + folder +
                             "' has neither model.safetensors nor model.safetensors.index.json");
  }
}

std::string SafetensorsModel::weights_hash() const {
  uint64_t h = kHashSeed;
  for (const std::string& name : names()) {
    const SafetensorsFile& f = file_of(name);
    const StTensorInfo& t = f.info(name);
    const std::string head = name + ":" + std::to_string(int(t.dtype)) + ":" + shape_to_string(t.shape);
    h = hash64(head.data(), head.size(), h);
    h = hash64(f.data(t), size_t(t.nbytes()), h);
  }
  return hash_hex(h);
}

std::vector<std::string> SafetensorsModel::names() const {
  std::vector<std::string> out;
  for (const auto& kv : where_) out.push_back(kv.first);
  return out;
}

const SafetensorsFile& SafetensorsModel::file_of(const std::string& name) const {
  const auto it = where_.find(name);
  if (it == where_.end())
    throw std::runtime_error("model '" + folder_ + "': missing tensor '" + name + "'");
  return *it->second;
}

}  // namespace kvs
