// Reader for the safetensors format (https://github.com/huggingface/safetensors): an 8-byte
// little-endian header length N, N bytes of JSON header, then the raw little-endian tensor
// bytes, each tensor at [data_offsets[0], data_offsets[1]) relative to the end of the header.
//
// Plain C++ (no torch), so tools that only need shapes or weights as floats can use it. Files
// are memory-mapped read-only; every header entry is validated when the file is opened, so a
// truncated or corrupt file fails at open with the file name and the offending tensor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace kvs {

// Every dtype the format defines, so that a file holding e.g. an I64 buffer still opens and
// is bounds-checked; only BF16, F16 and F32 can be read as weights (is_float_dtype).
enum class StDtype {
  BOOL,
  U8,
  I8,
  I16,
  U16,
  F16,
  BF16,
  I32,
  U32,
  F32,
  F64,
  I64,
  U64,
  F8_E4M3,
  F8_E5M2
};

const char* to_string(StDtype dtype);
size_t dtype_size(StDtype dtype);
bool is_float_dtype(StDtype dtype);  ///< BF16, F16 or F32: the weight dtypes we read

struct StTensorInfo {
  std::string name;
  StDtype dtype = StDtype::F32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  ///< byte offset inside the data area
  uint64_t end = 0;    ///< one past the last byte inside the data area

  int64_t numel() const;
  uint64_t nbytes() const { return end - begin; }
};

std::string shape_to_string(const std::vector<int64_t>& shape);

// One .safetensors file, memory-mapped for the lifetime of the object.
class SafetensorsFile {
 public:
  // Throws std::runtime_error naming `path` (and the tensor) on any I/O or format problem.
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }
  std::vector<std::string> names() const;  ///< sorted
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // Throws naming the file and tensor when it is absent.
  const StTensorInfo& info(const std::string& name) const;
  // info() plus a check that the shape is `expected`.
  const StTensorInfo& require(const std::string& name, const std::vector<int64_t>& expected) const;

  // The tensor's bytes inside the mapping (no alignment guarantee: copy before typed access).
  const uint8_t* data(const StTensorInfo& info) const { return data_ + info.begin; }

  // The tensor converted to fp32 (from BF16, F16 or F32; other dtypes throw, naming both).
  std::vector<float> read_f32(const std::string& name) const;

 private:
  void parse_header(const std::string& header);

  std::string path_;
  const uint8_t* map_ = nullptr;  ///< whole file
  size_t map_size_ = 0;
  const uint8_t* data_ = nullptr;  ///< start of the data area
  uint64_t data_size_ = 0;
  std::map<std::string, StTensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// The weights of a Hugging Face model folder: either `model.safetensors` or the shards listed
// in `model.safetensors.index.json` (its weight_map). Tensor names are unique across shards.
class SafetensorsModel {
 public:
  // `folder` holds the model; throws naming the folder when neither layout is present, and
  // naming the index when a listed shard is missing or does not hold the tensor it should.
  explicit SafetensorsModel(const std::string& folder);

  const std::string& folder() const { return folder_; }
  bool contains(const std::string& name) const { return where_.count(name) != 0; }
  std::vector<std::string> names() const;  ///< sorted
  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return files_; }

  const SafetensorsFile& file_of(const std::string& name) const;  ///< throws when absent

  // hash64 over every tensor's name, dtype, shape and bytes, in name order: the model's
  // weights_hash (part of its fingerprint, so a bundle made for other weights of the same
  // shape is refused). Reads every weight once (about a second per GB).
  std::string weights_hash() const;
  const StTensorInfo& info(const std::string& name) const { return file_of(name).info(name); }
  const StTensorInfo& require(const std::string& name, const std::vector<int64_t>& expected) const {
    return file_of(name).require(name, expected);
  }

 private:
  std::string folder_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const SafetensorsFile*> where_;
};

// Converts `count` little-endian values of `dtype` (BF16, F16, F32) at `src` to fp32.
void convert_to_f32(StDtype dtype, const uint8_t* src, size_t count, float* dst);

}  // namespace kvs
