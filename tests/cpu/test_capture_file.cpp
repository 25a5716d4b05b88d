// The capture-file schema: written by CaptureWriter, read back and validated by CaptureFile.
#include <gtest/gtest.h>
#include <hdf5.h>

#include <cmath>
#include <random>
#include <vector>

#include "artifacts/capture_file.h"
#include "tests/cpu/h5_test_support.h"

namespace kvs {
namespace {

using testing_h5::TempDir;

CaptureMeta small_meta() {
  CaptureMeta m;
  m.shape.name = "tiny";
  m.shape.num_layers = 3;
  m.shape.num_q_heads = 4;
  m.shape.num_kv_heads = 2;
  m.shape.head_dim = 8;
  m.shape.max_position = 1024;
  m.shape.rope.theta = 10000;
  m.vocab_size = 256;
  m.layers = {2, 0};
  return m;
}

std::vector<bf16> ramp(size_t n, float base) {
  std::vector<bf16> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = float_to_bf16(base + float(i % 97) * 0.25f);
  return v;
}

// Writes one sequence of T tokens, decode steps from decode_start, in two q/k/v appends.
void write_sequence(CaptureWriter& w, const CaptureMeta& m, int T, int decode_start) {
  std::vector<int32_t> tokens(static_cast<size_t>(T));
  for (int t = 0; t < T; ++t) tokens[size_t(t)] = t % 256;
  w.begin_sequence(tokens, decode_start, "unit-test");
  const int hq = m.shape.num_q_heads, hkv = m.shape.num_kv_heads, d = m.shape.head_dim;
  const int nb = (T + kAttnBlockSize - 1) / kAttnBlockSize;
  for (int layer : m.layers) {
    const int first = T / 3;
    for (auto [start, n] : {std::pair<int, int>{0, first}, {first, T - first}}) {
      const auto q = ramp(size_t(n) * hq * d, float(layer + start));
      const auto k = ramp(size_t(n) * hkv * d, float(-layer - start));
      const auto v = ramp(size_t(n) * hkv * d, 0.5f * float(start));
      w.append_qkv(layer, n, q.data(), k.data(), v.data());
    }
    for (int s = decode_start; s < T; ++s) {
      std::vector<float> row(size_t(hq) * nb, float(s) / float(T));
      w.append_attn_row(layer, row.data());
    }
  }
}

TEST(CaptureFile, RoundTripsEveryArray) {
  TempDir dir;
  const std::string path = dir.path("cap.h5");
  const CaptureMeta m = small_meta();
  {
    CaptureWriter w(path, m);
    EXPECT_EQ(w.meta().layers, (std::vector<int>{0, 2}));  // sorted
    write_sequence(w, m, 40, 30);
    write_sequence(w, m, 17, 1);
    w.commit();
  }
  const CaptureFile f = CaptureFile::open(path);
  EXPECT_EQ(f.meta().shape.fingerprint(), m.shape.fingerprint());
  EXPECT_EQ(f.meta().layers, (std::vector<int>{0, 2}));
  EXPECT_EQ(f.meta().tokenizer, "bytes");
  ASSERT_EQ(f.sequences().size(), 2u);
  EXPECT_EQ(f.sequences()[0].num_tokens, 40);
  EXPECT_EQ(f.sequences()[0].num_steps(), 10);
  EXPECT_EQ(f.sequences()[1].decode_start, 1);
  EXPECT_TRUE(f.has_layer(2));
  EXPECT_FALSE(f.has_layer(1));
  EXPECT_EQ(f.tokens(0)[39], 39);
  // The second append of layer 2 starts at row 13 (40 / 3) with base 2 + 13.
  const auto q = f.q_pre(0, 2);
  ASSERT_EQ(q.size(), size_t(40) * 4 * 8);
  EXPECT_EQ(bf16_to_float(q[size_t(13) * 4 * 8]), 15.0f);
  EXPECT_EQ(f.k_pre(1, 0).size(), size_t(17) * 2 * 8);
  EXPECT_EQ(f.v(1, 0).size(), size_t(17) * 2 * 8);
  const auto a = f.attn_blocks(0, 0);
  ASSERT_EQ(a.size(), size_t(10) * 4 * 3);
  EXPECT_FLOAT_EQ(a.back(), 39.0f / 40.0f);
  EXPECT_THROW(f.q_pre(0, 1), std::out_of_range);
  EXPECT_THROW(f.v(2, 0), std::out_of_range);
}

TEST(CaptureFile, IncompleteSequenceIsRefusedAndLeavesNoFile) {
  TempDir dir;
  const std::string path = dir.path("cap.h5");
  const CaptureMeta m = small_meta();
  {
    CaptureWriter w(path, m);
    std::vector<int32_t> tokens(20, 5);
    w.begin_sequence(tokens, 10, "unit-test");
    const auto q = ramp(size_t(20) * 4 * 8, 0), k = ramp(size_t(20) * 2 * 8, 0);
    w.append_qkv(0, 20, q.data(), k.data(), k.data());  // layer 2 never written
    try {
      w.commit();
      FAIL() << "commit of an incomplete sequence";
    } catch (const std::logic_error& e) {
      EXPECT_NE(std::string(e.what()).find("layer0 has 0 attention rows, expected 10"), std::string::npos)
          << e.what();
    }
  }
  EXPECT_NE(access(path.c_str(), F_OK), 0) << "an uncommitted capture must not appear";
  CaptureWriter w(path, m);
  EXPECT_THROW(w.begin_sequence({1, 2, 3}, 0, "x"), std::invalid_argument);
  EXPECT_THROW(w.begin_sequence({1, 2, 3}, 4, "x"), std::invalid_argument);
  CaptureMeta bad = m;
  bad.layers = {3};
  EXPECT_THROW(CaptureWriter(dir.path("bad.h5"), bad), std::invalid_argument);
}

TEST(CaptureFile, DamagedOrForeignFilesNameWhatIsWrong) {
  TempDir dir;
  const CaptureMeta m = small_meta();
  // A dataset of the wrong shape (as if written by a model with another head_dim).
  const std::string path = dir.path("cap.h5");
  {
    CaptureWriter w(path, m);
    write_sequence(w, m, 20, 18);
    w.commit();
  }
  {
    h5::AtomicWriter w(dir.path("other.h5"));
    w.root().set_attr_string("kind", "something-else");
    w.commit();
  }
  const std::string foreign = testing_h5::error_of([&] { CaptureFile::open(dir.path("other.h5")); });
  EXPECT_NE(foreign.find("not a kvsparse capture file"), std::string::npos) << foreign;

  // The same file with its head_dim attribute changed to 16: every array now has the wrong
  // shape for the model it claims, and opening must say which dataset and both shapes.
  {
    const hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    ASSERT_GE(f, 0);
    const hid_t a = H5Aopen(f, "head_dim", H5P_DEFAULT);
    ASSERT_GE(a, 0);
    const int64_t sixteen = 16;
    ASSERT_GE(H5Awrite(a, H5T_NATIVE_INT64, &sixteen), 0);
    H5Aclose(a);
    H5Fclose(f);
  }
  const std::string shape = testing_h5::error_of([&] { CaptureFile::open(path); });
  EXPECT_NE(shape.find("/seq0/layer0/q_pre has shape [20,4,8], expected [20,4,16]"), std::string::npos)
      << shape;
  EXPECT_THROW(CaptureFile::open(dir.path("missing.h5")), h5::Error);
}

TEST(CaptureFile, PoolingTakesTheBlockMaximum) {
  std::vector<float> probs(35);
  for (int t = 0; t < 35; ++t) probs[size_t(t)] = float(t % 16) / 100.f;
  probs[20] = 0.9f;
  std::vector<float> pooled(4, -1.f);  // width 50 tokens -> 4 blocks; block 3 is past len
  pool_attention_row(probs.data(), 35, 50, pooled.data());
  EXPECT_FLOAT_EQ(pooled[0], 0.15f);
  EXPECT_FLOAT_EQ(pooled[1], 0.9f);
  EXPECT_FLOAT_EQ(pooled[2], 0.02f);  // tokens 32..34
  EXPECT_FLOAT_EQ(pooled[3], 0.f);
}

}  // namespace
}  // namespace kvs

namespace kvs {
namespace {

TEST(CaptureFile, AHeadSubsetStoresOnlyThoseHeads) {
  testing_h5::TempDir dir;
  const std::string path = dir.path("cap.h5");
  CaptureMeta m = small_meta();  // Hq 4, Hkv 2: group 2
  m.kv_heads = {1};
  const ModelShape cs = m.captured_shape();
  EXPECT_EQ(cs.num_kv_heads, 1);
  EXPECT_EQ(cs.num_q_heads, 2);
  {
    CaptureWriter w(path, m);
    std::vector<int32_t> tokens(12, 7);
    w.begin_sequence(tokens, 10, "unit-test");
    for (int layer : w.meta().layers) {
      const auto q = ramp(size_t(12) * 2 * 8, 1), k = ramp(size_t(12) * 1 * 8, 2);
      w.append_qkv(layer, 12, q.data(), k.data(), k.data());
      std::vector<float> row(size_t(2) * 1, 0.5f);
      w.append_attn_row(layer, row.data());
      w.append_attn_row(layer, row.data());
    }
    w.commit();
  }
  const CaptureFile f = CaptureFile::open(path);
  EXPECT_EQ(f.meta().kv_heads, (std::vector<int>{1}));
  EXPECT_FALSE(f.meta().all_heads());
  EXPECT_EQ(f.meta().shape.num_q_heads, 4);  // the model's shape is kept as it is
  EXPECT_EQ(f.q_pre(0, 2).size(), size_t(12) * 2 * 8);
  EXPECT_EQ(f.k_pre(0, 0).size(), size_t(12) * 1 * 8);
  m.kv_heads = {2};
  EXPECT_THROW(CaptureWriter(dir.path("bad.h5"), m), std::invalid_argument);
  m.kv_heads = {1, 1};
  EXPECT_THROW(CaptureWriter(dir.path("bad2.h5"), m), std::invalid_argument);
}

}  // namespace
}  // namespace kvs
