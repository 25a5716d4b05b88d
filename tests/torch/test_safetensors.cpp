#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "capture/safetensors.h"
#include "kernels/common/bf16.h"
#include "tests/torch/test_util.h"

namespace kvs {
namespace {

using testing::TempDir;
using testing::write_file;

std::string le64(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[size_t(i)] = char((n >> (8 * i)) & 0xff);
  return s;
}

// header_len_override >= 0 writes that length instead of the real one.
std::string st_bytes(const std::string& header, const std::string& data,
                     int64_t header_len_override = -1) {
  const uint64_t n = header_len_override >= 0 ? uint64_t(header_len_override) : header.size();
  return le64(n) + header + data;
}

template <class T>
std::string bytes_of(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

// Expects constructing a SafetensorsFile on `bytes` to throw with every one of `needles` in
// the message.
void expect_open_error(const std::string& bytes, const std::vector<std::string>& needles) {
  TempDir dir;
  const std::string path = dir.file("bad.safetensors");
  write_file(path, bytes);
  try {
    SafetensorsFile f(path);
    ADD_FAILURE() << "opened a corrupt file without error";
  } catch (const std::runtime_error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(path), std::string::npos) << "message does not name the file: " << msg;
    for (const auto& n : needles)
      EXPECT_NE(msg.find(n), std::string::npos) << "'" << n << "' not in: " << msg;
  }
}

// A well-formed file: F32 [2,3], BF16 [4], F16 [3], F32 scalar, I64 [2], metadata.
struct GoodFile {
  std::vector<float> a{1.f, -2.f, 3.5f, 0.f, 1e-3f, -7.25f};
  std::vector<float> b_values{1.f, -0.5f, 3.140625f, 65280.f};  // exact in bf16
  std::vector<uint16_t> c_half{0x3c00, 0xc000, 0x0001};         // 1, -2, smallest subnormal
  float scalar = 42.f;
  std::vector<int64_t> ids{7, -9};

  std::string bytes() const {
    std::vector<uint16_t> b;
    for (float f : b_values) b.push_back(float_to_bf16(f).bits);
    const std::string data = bytes_of(a) + bytes_of(b) + bytes_of(c_half) +
                             bytes_of(std::vector<float>{scalar}) + bytes_of(ids);
    const std::string header = R"({"__metadata__":{"format":"pt"},)"
                               R"("layer.a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},)"
                               R"("layer.b":{"dtype":"BF16","shape":[4],"data_offsets":[24,32]},)"
                               R"("c":{"dtype":"F16","shape":[3],"data_offsets":[32,38]},)"
                               R"("s":{"dtype":"F32","shape":[],"data_offsets":[38,42]},)"
                               R"("ids":{"dtype":"I64","shape":[2],"data_offsets":[42,58]}})";
    // The format pads headers with spaces to 8-byte alignment; exercise that too.
    std::string padded = header;
    while ((padded.size() + 8) % 8 != 0) padded += ' ';
    return st_bytes(padded, data);
  }
};

TEST(Safetensors, ReadsGoodFile) {
  TempDir dir;
  const std::string path = dir.file("good.safetensors");
  const GoodFile g;
  write_file(path, g.bytes());
  const SafetensorsFile f(path);
  EXPECT_EQ(f.names(), (std::vector<std::string>{"c", "ids", "layer.a", "layer.b", "s"}));
  EXPECT_EQ(f.metadata().at("format"), "pt");

  EXPECT_EQ(f.info("layer.a").shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(f.read_f32("layer.a"), g.a);
  EXPECT_EQ(f.info("layer.b").dtype, StDtype::BF16);
  EXPECT_EQ(f.read_f32("layer.b"), g.b_values);
  const auto c = f.read_f32("c");
  ASSERT_EQ(c.size(), 3u);
  EXPECT_EQ(c[0], 1.f);
  EXPECT_EQ(c[1], -2.f);
  EXPECT_EQ(c[2], std::ldexp(1.f, -24));
  EXPECT_TRUE(f.info("s").shape.empty());
  EXPECT_EQ(f.info("s").numel(), 1);
  EXPECT_EQ(f.read_f32("s"), std::vector<float>{g.scalar});
  const auto& ids = f.info("ids");
  int64_t raw[2];
  std::memcpy(raw, f.data(ids), sizeof raw);
  EXPECT_EQ(raw[0], 7);
  EXPECT_EQ(raw[1], -9);

  EXPECT_NO_THROW(f.require("layer.a", {2, 3}));
  try {
    f.require("layer.a", {3, 2});
    ADD_FAILURE() << "shape mismatch not detected";
  } catch (const std::runtime_error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    EXPECT_NE(msg.find("layer.a"), std::string::npos) << msg;
    EXPECT_NE(msg.find("[2, 3]"), std::string::npos) << msg;
    EXPECT_NE(msg.find("[3, 2]"), std::string::npos) << msg;
  }
  try {
    f.info("model.norm.weight");
    ADD_FAILURE() << "missing tensor not detected";
  } catch (const std::runtime_error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    EXPECT_NE(msg.find("missing tensor 'model.norm.weight'"), std::string::npos) << msg;
  }
  try {
    f.read_f32("ids");
    ADD_FAILURE() << "I64 read as float";
  } catch (const std::runtime_error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'ids'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("I64"), std::string::npos) << msg;
  }
}

TEST(Safetensors, RejectsTruncatedData) {
  const std::string good = GoodFile().bytes();
  // Cut into the last tensor: the header now points past the end of the data area.
  expect_open_error(good.substr(0, good.size() - 5), {"'ids'", "truncated"});
}

TEST(Safetensors, RejectsFileShorterThanLength) {
  expect_open_error(std::string("\x10\x00\x00", 3), {"truncated", "8-byte"});
}

TEST(Safetensors, RejectsHeaderLengthBeyondFile) {
  const std::string header = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  expect_open_error(st_bytes(header, std::string(4, '\0'), 1 << 20),
                    {"header length 1048576", "past the end"});
  // A huge length must not wrap around in the bounds arithmetic.
  expect_open_error(st_bytes(header, std::string(4, '\0'), int64_t(0x7fffffffffffffffll)),
                    {"past the end"});
}

TEST(Safetensors, RejectsOffsetsOutOfRange) {
  const std::string header = R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})";
  expect_open_error(st_bytes(header, std::string(8, '\0')), {"'w'", "past the data area"});
}

TEST(Safetensors, RejectsOffsetsInconsistentWithShape) {
  const std::string header = R"({"w":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,8]}})";
  expect_open_error(st_bytes(header, std::string(16, '\0')), {"'w'", "needs 12"});
}

TEST(Safetensors, RejectsReversedAndOverlappingOffsets) {
  expect_open_error(
      st_bytes(R"({"w":{"dtype":"U8","shape":[0],"data_offsets":[4,0]}})", std::string(8, '\0')),
      {"'w'", "reversed"});
  expect_open_error(st_bytes(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                             R"("y":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                             std::string(12, '\0')),
                    {"'x'", "'y'", "overlap"});
}

TEST(Safetensors, RejectsUnknownDtype) {
  expect_open_error(
      st_bytes(R"({"w":{"dtype":"Q4_K","shape":[2],"data_offsets":[0,2]}})", std::string(2, '\0')),
      {"'w'", "unknown dtype 'Q4_K'"});
}

TEST(Safetensors, RejectsBadHeaders) {
  expect_open_error(st_bytes(R"({"w":{"dtype":"F32",)", ""), {"bad header", "invalid JSON"});
  expect_open_error(st_bytes(R"([1,2,3])", ""), {"bad header"});
  expect_open_error(
      st_bytes(R"({"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", std::string(4, '\0')),
      {"'w'", "shape"});
  expect_open_error(st_bytes(R"({"w":{"dtype":"F32","shape":[1]}})", std::string(4, '\0')),
                    {"'w'", "data_offsets"});
}

TEST(Safetensors, MissingFileNamesIt) {
  try {
    SafetensorsFile f("/nonexistent/model.safetensors");
    ADD_FAILURE();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/model.safetensors"), std::string::npos);
  }
}

TEST(Safetensors, ShardedModelFolder) {
  TempDir dir;
  write_file(dir.file("s1.safetensors"),
             st_bytes(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
                      bytes_of(std::vector<float>{1.5f})));
  write_file(dir.file("s2.safetensors"),
             st_bytes(R"({"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
                      bytes_of(std::vector<float>{2.f, 3.f})));
  write_file(
      dir.file("model.safetensors.index.json"),
      R"({"metadata":{"total_size":12},"weight_map":{"a":"s1.safetensors","b":"s2.safetensors"}})");
  const SafetensorsModel m(dir.path());
  EXPECT_EQ(m.files().size(), 2u);
  EXPECT_EQ(m.names(), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(m.file_of("b").read_f32("b"), (std::vector<float>{2.f, 3.f}));
  EXPECT_THROW(m.info("c"), std::runtime_error);

  // The index names a tensor its shard does not hold.
  write_file(dir.file("model.safetensors.index.json"),
             R"({"weight_map":{"a":"s1.safetensors","c":"s2.safetensors"}})");
  try {
    SafetensorsModel bad(dir.path());
    ADD_FAILURE();
  } catch (const std::runtime_error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'c'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("s2.safetensors"), std::string::npos) << msg;
  }
  // The index names a shard that does not exist.
  write_file(dir.file("model.safetensors.index.json"), R"({"weight_map":{"a":"s9.safetensors"}})");
  try {
    SafetensorsModel bad(dir.path());
    ADD_FAILURE();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("s9.safetensors"), std::string::npos) << e.what();
  }
}

TEST(Safetensors, SingleFileModelFolderAndEmptyFolder) {
  TempDir dir;
  EXPECT_THROW(SafetensorsModel m(dir.path()), std::runtime_error);
  write_file(dir.file("model.safetensors"),
             st_bytes(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
                      bytes_of(std::vector<float>{1.5f})));
  const SafetensorsModel m(dir.path());
  EXPECT_EQ(m.file_of("a").read_f32("a"), std::vector<float>{1.5f});
}

TEST(Safetensors, TinyModelShards) {
  const SafetensorsModel m(testing::tiny_model_dir());
  EXPECT_EQ(m.files().size(), 2u);
  // 4 layers x 9 tensors + embed + norm + lm_head.
  EXPECT_EQ(m.names().size(), 39u);
  EXPECT_EQ(m.info("lm_head.weight").dtype, StDtype::BF16);
  EXPECT_EQ(m.info("model.layers.3.self_attn.k_proj.weight").shape,
            (std::vector<int64_t>{256, 512}));
}

}  // namespace
}  // namespace kvs
