// ModelShape attributes and the per-model bundle: round trip, refusal of another model,
// another format_version or a modified file, with messages that say which. Also writes the
// fixture that tests/python/check_h5py.py reads with h5py (KVS_H5PY_FIXTURE).
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "artifacts/bundle.h"
#include "artifacts/model_io.h"
#include "tests/cpu/h5_test_support.h"

namespace kvs {
namespace {

using testing_h5::error_of;
using testing_h5::TempDir;

ModelShape tiny_shape() {
  ModelShape s;
  s.name = "kvs-tiny-a";
  s.num_layers = 4;
  s.num_q_heads = 8;
  s.num_kv_heads = 2;
  s.head_dim = 128;
  s.max_position = 4096;
  s.rope.theta = 500000.0;
  s.rope.type = RopeType::Llama3;
  s.rope.factor = 8.0;
  s.rope.low_freq_factor = 1.0;
  s.rope.high_freq_factor = 4.0;
  s.rope.original_max_position = 2048;
  s.softmax_scale = 0.0;
  s.weights_hash = "3f2a9c";
  return s;
}

void expect_same_shape(const ModelShape& a, const ModelShape& b) {
  EXPECT_EQ(a.name, b.name);
  EXPECT_EQ(a.num_layers, b.num_layers);
  EXPECT_EQ(a.num_q_heads, b.num_q_heads);
  EXPECT_EQ(a.num_kv_heads, b.num_kv_heads);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.max_position, b.max_position);
  EXPECT_EQ(a.rope.theta, b.rope.theta);
  EXPECT_EQ(a.rope.type, b.rope.type);
  EXPECT_EQ(a.rope.factor, b.rope.factor);
  EXPECT_EQ(a.rope.low_freq_factor, b.rope.low_freq_factor);
  EXPECT_EQ(a.rope.high_freq_factor, b.rope.high_freq_factor);
  EXPECT_EQ(a.rope.original_max_position, b.rope.original_max_position);
  EXPECT_EQ(a.softmax_scale, b.softmax_scale);
  EXPECT_EQ(a.weights_hash, b.weights_hash);
}

// Rewrites a root attribute of a committed file in place, as a tool other than ours might.
void poke_root_attr(const std::string& path, const std::string& name, int64_t value) {
  const hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  ASSERT_GE(f, 0);
  const hid_t a = H5Aopen_by_name(f, "/", name.c_str(), H5P_DEFAULT, H5P_DEFAULT);
  ASSERT_GE(a, 0);
  ASSERT_GE(H5Awrite(a, H5T_NATIVE_INT64, &value), 0);
  H5Aclose(a);
  H5Fclose(f);
}

void delete_root_attrs(const std::string& path, const std::vector<std::string>& names) {
  const hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  ASSERT_GE(f, 0);
  for (const auto& n : names) ASSERT_GE(H5Adelete(f, n.c_str()), 0) << n;
  H5Fclose(f);
}

// ---------------------------------------------------------------------------------------
// ModelShape attributes

TEST(ModelIo, EveryFieldRoundTrips) {
  TempDir tmp;
  const std::string path = tmp.path("shape.h5");
  ModelShape linear = tiny_shape();
  linear.rope.type = RopeType::Linear;  // fields unused by this type are still kept
  linear.softmax_scale = 0.07;
  {
    h5::AtomicWriter w(path);
    write_model_shape(w.root(), tiny_shape());
    write_model_shape(w.root().create_group("other"), linear);
    w.commit();
  }
  h5::File f = h5::File::open_read(path);
  expect_same_shape(read_model_shape(f.root()), tiny_shape());
  expect_same_shape(read_model_shape(f.root().open_group("other")), linear);
  EXPECT_EQ(read_model_shape(f.root()).fingerprint(), tiny_shape().fingerprint());
}

TEST(ModelIo, MissingAttributesAreAllNamed) {
  TempDir tmp;
  const std::string path = tmp.path("shape.h5");
  {
    h5::AtomicWriter w(path);
    write_model_shape(w.root(), tiny_shape());
    w.commit();
  }
  delete_root_attrs(path, {"rope_theta", "num_kv_heads"});
  h5::File f = h5::File::open_read(path);
  EXPECT_EQ(error_of([&] { read_model_shape(f.root()); }),
            path + ": /: missing model shape attributes: num_kv_heads, rope_theta");
}

TEST(ModelIo, InvalidShapesRefusedOnWriteAndRead) {
  TempDir tmp;
  const std::string path = tmp.path("shape.h5");
  ModelShape bad = tiny_shape();
  bad.num_kv_heads = 3;
  {
    h5::AtomicWriter w(path);
    const std::string msg = error_of([&] { write_model_shape(w.root(), bad); });
    EXPECT_NE(msg.find("num_q_heads (8) must be a multiple of num_kv_heads (3)"), std::string::npos)
        << msg;
    write_model_shape(w.root(), tiny_shape());
    w.commit();
  }
  poke_root_attr(path, "head_dim", 7);
  h5::File f = h5::File::open_read(path);
  const std::string msg = error_of([&] { read_model_shape(f.root()); });
  EXPECT_NE(msg.find(path + ": /: invalid model shape: head_dim must be even"), std::string::npos)
      << msg;
}

// ---------------------------------------------------------------------------------------
// Bundle

void write_bundle(const std::string& path, const ModelShape& shape) {
  BundleWriter w(path, shape);
  h5::Group saap = w.method_group("saap");
  std::vector<float> centroids(4 * 2 * 16 * 128);
  for (size_t i = 0; i < centroids.size(); ++i) centroids[i] = float(i % 101) * 0.25f;
  h5::write_dataset(saap, "centroids", centroids, {4, 2, 16, 128});
  saap.set_attr_int("num_clusters", 16);
  saap.set_attr_int("probe_clusters", 3);
  EXPECT_EQ(w.method_group("saap").path(), "/saap");  // the same group again
  w.method_group("dense").set_attr_int("num_splits", 8);
  w.commit();
}

TEST(Bundle, RoundTrip) {
  TempDir tmp;
  const std::string path = tmp.path("bundle.h5");
  write_bundle(path, tiny_shape());

  const Bundle b = Bundle::open(path);
  EXPECT_EQ(b.path(), path);
  EXPECT_EQ(b.format_version(), kBundleFormatVersion);
  expect_same_shape(b.shape(), tiny_shape());
  EXPECT_EQ(b.fingerprint(), tiny_shape().fingerprint());
  EXPECT_EQ(b.created_by(), kvsparse_created_by());
  EXPECT_EQ(b.created_by().rfind("kvsparse ", 0), 0u);
  b.check_model(tiny_shape());
  ModelShape renamed = tiny_shape();
  renamed.name = "a copy of the same weights";  // the name is not part of the fingerprint
  b.check_model(renamed);

  EXPECT_EQ(b.methods(), (std::vector<std::string>{"dense", "saap"}));
  EXPECT_TRUE(b.has_method("saap"));
  EXPECT_FALSE(b.has_method("mac"));
  EXPECT_FALSE(b.has_method("no_such_method"));
  const h5::Group saap = b.method_group("saap");
  EXPECT_EQ(saap.attr_int("num_clusters"), 16);
  EXPECT_EQ(saap.attr_int("probe_clusters"), 3);
  const std::vector<float> c =
      h5::open_dataset(saap, "centroids", h5::DType::F32, {4, 2, 16, 128}).read<float>();
  ASSERT_EQ(c.size(), 4u * 2 * 16 * 128);
  for (size_t i = 0; i < c.size(); ++i) ASSERT_EQ(c[i], float(i % 101) * 0.25f);
  EXPECT_EQ(b.method_group("dense").attr_int("num_splits"), 8);

  EXPECT_EQ(error_of([&] { b.method_group("mac"); }),
            path + ": bundle has no 'mac' group (methods present: dense, saap)");
  EXPECT_EQ(
      error_of([&] { b.method_group("sap"); }),
      path + ": unknown method 'sap' (methods: dense, mac, tactic, magicpig, saap, attnpred)");
}

TEST(Bundle, WriterIsAtomicAndRefusesUnknownMethods) {
  TempDir tmp;
  const std::string path = tmp.path("bundle.h5");
  {
    BundleWriter w(path, tiny_shape());
    w.method_group("tactic").set_attr_double("target_mass", 0.9);
    EXPECT_EQ(error_of([&] { w.method_group("Tactic"); }),
              path +
                  ": unknown method 'Tactic' (methods: dense, mac, tactic, magicpig, saap, "
                  "attnpred)");
    EXPECT_FALSE(std::filesystem::exists(path));
  }  // not committed
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_TRUE(std::filesystem::is_empty(std::filesystem::path(path).parent_path()));
}

TEST(Bundle, AnotherModelIsRefusedNamingTheField) {
  TempDir tmp;
  const std::string path = tmp.path("bundle.h5");
  write_bundle(path, tiny_shape());
  const Bundle b = Bundle::open(path);
  ModelShape other = tiny_shape();
  other.num_kv_heads = 4;
  const std::string msg = error_of([&] { b.check_model(other); });
  EXPECT_NE(msg.find(path + ": bundle is for another model: its fingerprint " +
                     tiny_shape().fingerprint() + ", expected " + other.fingerprint()),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("kv_heads=2 vs kv_heads=4"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("head_dim"), std::string::npos) << "only differing fields: " << msg;

  other = tiny_shape();
  other.weights_hash = "different weights";
  const std::string msg2 = error_of([&] { b.check_model(other); });
  EXPECT_NE(msg2.find("weights=3f2a9c vs weights=different weights"), std::string::npos) << msg2;
}

TEST(Bundle, OtherFormatVersionIsRefusedNamingBoth) {
  TempDir tmp;
  const std::string path = tmp.path("bundle.h5");
  write_bundle(path, tiny_shape());
  poke_root_attr(path, "format_version", kBundleFormatVersion + 1);
  EXPECT_EQ(error_of([&] { Bundle::open(path); }),
            path + ": bundle format_version " + std::to_string(kBundleFormatVersion + 1) +
                ", this kvsparse reads format_version " + std::to_string(kBundleFormatVersion));
}

TEST(Bundle, TamperedFileIsRefused) {
  TempDir tmp;
  const std::string path = tmp.path("bundle.h5");
  write_bundle(path, tiny_shape());
  poke_root_attr(path, "num_layers", 32);  // the model attributes no longer match the fingerprint
  ModelShape edited = tiny_shape();
  edited.num_layers = 32;
  EXPECT_EQ(error_of([&] { Bundle::open(path); }),
            path + ": stored fingerprint " + tiny_shape().fingerprint() +
                " does not match its model attributes (fingerprint " + edited.fingerprint() +
                "): the file was modified or damaged");
}

TEST(Bundle, PlainHdf5FileIsNotABundle) {
  TempDir tmp;
  const std::string path = tmp.path("capture.h5");
  {
    h5::AtomicWriter w(path);
    write_model_shape(w.root(), tiny_shape());
    w.commit();
  }
  EXPECT_EQ(error_of([&] { Bundle::open(path); }),
            path + ": not a kvsparse bundle (no format_version attribute)");
  const std::string missing = tmp.path("nothing.h5");
  EXPECT_NE(error_of([&] { Bundle::open(missing); }).find(missing + ": cannot open"),
            std::string::npos);
}

// ---------------------------------------------------------------------------------------
// The file tests/python/check_h5py.py reads: a real bundle whose "dense" group holds the
// same bf16-representable values as bf16 and as float32 (1-D and a chunked, compressed 2-D
// copy), and a grown appendable bf16 dataset. Skipped unless KVS_H5PY_FIXTURE names a path.

TEST(H5pyFixture, Write) {
  const char* out = std::getenv("KVS_H5PY_FIXTURE");
  if (!out || !*out) GTEST_SKIP() << "KVS_H5PY_FIXTURE not set";
  const std::vector<float> named = {
      0.f,      -0.f,      1.f,     -1.f, 0.5f,           -2.75f,        3.0e38f,  -3.0e38f,
      1.0e-30f, -1.0e-30f, 65504.f, 1e5f, 1.1754944e-38f, 3.3895314e38f, 123.456f, -7.0e-20f};
  std::vector<bf16> words;
  std::vector<float> exact;
  for (float x : named) words.push_back(float_to_bf16(x));
  for (uint32_t e = 1; e < 255; e += 3)  // a sweep of exponents, both signs
    for (uint32_t sign : {0u, 1u})
      words.push_back(bf16{uint16_t((sign << 15) | (e << 7) | (e % 128))});
  while (words.size() % 8 != 0) words.push_back(float_to_bf16(float(words.size())));
  for (bf16 w : words) exact.push_back(bf16_to_float(w));
  const int64_t n = int64_t(words.size());

  BundleWriter w(out, tiny_shape());
  const h5::Group dense = w.method_group("dense");
  dense.set_attr_int("num_splits", 8);
  dense.set_attr_doubles("knob_list", {0.25, 0.5});
  h5::write_dataset(dense, "values_bf16", words, {n});
  h5::write_dataset(dense, "values_f32", exact, {n});
  h5::DatasetOptions opt;
  opt.chunk = {n / 8, 2};
  h5::write_dataset(dense, "values_bf16_2d", words, {n / 4, 4}, opt);
  const h5::Dataset grown = h5::create_appendable<bf16>(dense, "appended_bf16", {4});
  for (int64_t r = 0; r < n / 4; r += 5)
    grown.append(words.data() + r * 4, std::min<int64_t>(5, n / 4 - r));
  w.method_group("saap").set_attr_int("num_clusters", 16);
  w.commit();
  std::printf("wrote %s with %lld bf16 values\n", out, static_cast<long long>(n));
}

}  // namespace
}  // namespace kvs
