// The HDF5 layer: round trips of every dtype and rank, bf16 as an HDF5 float type that
// converts exactly, hyperslab reads, appendable datasets, chunking and compression as
// asked, atomic writes, and error messages that name the file, object and expectation.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "artifacts/h5.h"
#include "tests/cpu/h5_test_support.h"

namespace kvs {
namespace {

namespace fs = std::filesystem;

using testing_h5::error_of;
using testing_h5::TempDir;

template <class T>
T value_at(size_t i) {
  if constexpr (std::is_same_v<T, bf16>) {
    return float_to_bf16(float(int(i % 97) - 48) * 0.375f);
  } else if constexpr (std::is_floating_point_v<T>) {
    return T(int(i % 1013) - 500) * T(0.1);
  } else if constexpr (std::is_same_v<T, uint8_t>) {
    return uint8_t(i * 7 + 3);
  } else if constexpr (std::is_same_v<T, int64_t>) {
    return int64_t(i) * 3000000007LL - 5;  // beyond int32
  } else {
    return T(int(i) * 37 - 1000);
  }
}

template <class T>
uint64_t bits_of(T x) {
  uint64_t b = 0;
  std::memcpy(&b, &x, sizeof x);
  return b;
}

template <class T>
std::vector<T> values(size_t n, size_t offset = 0) {
  std::vector<T> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = value_at<T>(i + offset);
  return v;
}

template <class T>
void expect_same(const std::vector<T>& a, const std::vector<T>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(bits_of(a[i]), bits_of(b[i])) << "element " << i;
}

// ---------------------------------------------------------------------------------------
// Round trips

template <class T>
class H5Typed : public testing::Test {};
using AllTypes = testing::Types<float, double, int32_t, int64_t, uint8_t, bf16>;
TYPED_TEST_SUITE(H5Typed, AllTypes);

TYPED_TEST(H5Typed, RoundTripEveryRankChunkedAndContiguous) {
  using T = TypeParam;
  TempDir tmp;
  const std::string path = tmp.path("rt.h5");
  const std::vector<h5::Shape> shapes = {{}, {7}, {5, 3}, {4, 3, 2}, {3, 2, 2, 5}, {0, 4}};
  {
    h5::AtomicWriter w(path);
    for (size_t i = 0; i < shapes.size(); ++i) {
      const auto v = values<T>(size_t(h5::num_elements(shapes[i])), i);
      h5::write_dataset(w.root(), "chunked/r" + std::to_string(i), v, shapes[i]);
      h5::DatasetOptions contiguous;
      contiguous.chunked = false;
      h5::write_dataset(w.root(), "contiguous/r" + std::to_string(i), v, shapes[i], contiguous);
    }
    w.commit();
  }
  h5::File f = h5::File::open_read(path);
  for (const char* layout : {"chunked", "contiguous"}) {
    for (size_t i = 0; i < shapes.size(); ++i) {
      SCOPED_TRACE(std::string(layout) + " shape " + h5::to_string(shapes[i]));
      const h5::Dataset ds = f.root().open_dataset(std::string(layout) + "/r" + std::to_string(i));
      EXPECT_EQ(ds.dtype(), h5::dtype_of<T>());
      EXPECT_EQ(ds.shape(), shapes[i]);
      expect_same(ds.read<T>(), values<T>(size_t(h5::num_elements(shapes[i])), i));
    }
  }
}

TEST(H5, WriteChecksValueCount) {
  TempDir tmp;
  h5::AtomicWriter w(tmp.path("count.h5"));
  const std::string msg = error_of([&] {
    h5::write_dataset(w.root(), "x", std::vector<float>(5), h5::Shape{2, 3});
  });
  EXPECT_NE(msg.find("'x'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("needs 6 values, got 5"), std::string::npos) << msg;
}

TEST(H5, LosslessWideningReadsOthersRefused) {
  TempDir tmp;
  const std::string path = tmp.path("widen.h5");
  {
    h5::AtomicWriter w(path);
    h5::write_dataset(w.root(), "i32", std::vector<int32_t>{-7, 1 << 30, 3}, {3});
    h5::write_dataset(w.root(), "u8", std::vector<uint8_t>{0, 200, 255}, {3});
    h5::write_dataset(w.root(), "f64", std::vector<double>{0.1, 0.2}, {2});
    w.commit();
  }
  h5::File f = h5::File::open_read(path);
  EXPECT_EQ(f.root().open_dataset("i32").read<int64_t>(), (std::vector<int64_t>{-7, 1 << 30, 3}));
  EXPECT_EQ(f.root().open_dataset("u8").read<int32_t>(), (std::vector<int32_t>{0, 200, 255}));
  const std::string msg = error_of([&] { f.root().open_dataset("f64").read<float>(); });
  EXPECT_NE(msg.find(path + ": /f64 is float64 and cannot be read as float32"), std::string::npos)
      << msg;
  EXPECT_THROW(f.root().open_dataset("i32").read<uint8_t>(), h5::Error);
}

// ---------------------------------------------------------------------------------------
// bf16

// Every bf16 word that is not NaN: both zeros, subnormals, normals from 2^-126 to ~3.39e38,
// both infinities, both signs.
std::vector<bf16> all_non_nan_bf16() {
  std::vector<bf16> out;
  for (uint32_t w = 0; w < 0x10000u; ++w)
    if ((w & 0x7fffu) <= 0x7f80u) out.push_back(bf16{uint16_t(w)});
  return out;
}

TEST(H5Bf16, StoredAsHdf5FloatTypeWithBf16Layout) {
  TempDir tmp;
  const std::string path = tmp.path("type.h5");
  {
    h5::AtomicWriter w(path);
    h5::write_dataset(w.root(), "x", std::vector<bf16>{float_to_bf16(1.5f)}, {1});
    w.commit();
  }
  h5::File f = h5::File::open_read(path);
  const h5::Dataset ds = f.root().open_dataset("x");
  const hid_t t = H5Dget_type(ds.id());
  ASSERT_GE(t, 0);
  EXPECT_EQ(H5Tget_class(t), H5T_FLOAT);
  EXPECT_EQ(H5Tget_size(t), 2u);
  EXPECT_EQ(H5Tget_precision(t), 16u);
  EXPECT_EQ(H5Tget_offset(t), 0);
  size_t spos, epos, esize, mpos, msize;
  ASSERT_GE(H5Tget_fields(t, &spos, &epos, &esize, &mpos, &msize), 0);
  EXPECT_EQ(spos, 15u);
  EXPECT_EQ(epos, 7u);
  EXPECT_EQ(esize, 8u);
  EXPECT_EQ(mpos, 0u);
  EXPECT_EQ(msize, 7u);
  EXPECT_EQ(H5Tget_ebias(t), 127u);
  EXPECT_EQ(H5Tget_norm(t), H5T_NORM_IMPLIED);
  EXPECT_EQ(H5Tget_order(t), H5T_ORDER_LE);
  H5Tclose(t);
}

// HDF5's own conversion of the stored type (what h5py and h5dump do), by H5Dread with a
// native memory type.
template <class T>
std::vector<T> read_converted_by_hdf5(const h5::Dataset& ds, hid_t mem_type) {
  std::vector<T> out(size_t(h5::num_elements(ds.shape())));
  EXPECT_GE(H5Dread(ds.id(), mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data()), 0);
  return out;
}

TEST(H5Bf16, RawAndConvertedReadsAreExactForAllNonNanValues) {
  TempDir tmp;
  const std::string path = tmp.path("bf16.h5");
  const std::vector<bf16> words = all_non_nan_bf16();
  ASSERT_EQ(words.size(), 65536u - 2 * 127);
  const std::vector<bf16> nans = {bf16{0x7fc0}, bf16{0xffc1}, bf16{0x7f81}};
  {
    h5::AtomicWriter w(path);
    h5::write_dataset(w.root(), "all", words, {int64_t(words.size())});
    h5::write_dataset(w.root(), "nan", nans, {3});
    w.commit();
  }
  h5::File f = h5::File::open_read(path);
  const h5::Dataset ds = f.root().open_dataset("all");
  ASSERT_EQ(ds.dtype(), h5::DType::BF16);

  expect_same(ds.read<bf16>(), words);  // raw: the same 16-bit words back

  std::vector<float> want_f(words.size());
  std::vector<double> want_d(words.size());
  for (size_t i = 0; i < words.size(); ++i) {
    want_f[i] = bf16_to_float(words[i]);
    want_d[i] = double(want_f[i]);
  }
  expect_same(read_converted_by_hdf5<float>(ds, H5T_NATIVE_FLOAT), want_f);
  expect_same(read_converted_by_hdf5<double>(ds, H5T_NATIVE_DOUBLE), want_d);
  expect_same(ds.read<float>(), want_f);  // our reader widens the words itself
  expect_same(ds.read<double>(), want_d);

  // NaN stays NaN (HDF5 does not keep the payload bits; nothing relies on them).
  const h5::Dataset nan = f.root().open_dataset("nan");
  for (const auto& got : {read_converted_by_hdf5<float>(nan, H5T_NATIVE_FLOAT), nan.read<float>()})
    for (float x : got) EXPECT_TRUE(std::isnan(x)) << x;
}

TEST(H5Bf16, ConvertedReadOfNamedExtremes) {
  // The values h5py must also get right: large and small exponents, negatives.
  const std::vector<float> want = {0.f,    -0.f,    1.f,           -1.f,          0.5f,
                                   -2.75f, 3.0e38f, -3.0e38f,      1.0e-30f,      -1.0e-30f,
                                   1e-38f, 65504.f, 3.3895314e38f, 1.1754944e-38f};
  std::vector<bf16> words;
  for (float x : want) words.push_back(float_to_bf16(x));
  TempDir tmp;
  const std::string path = tmp.path("ext.h5");
  {
    h5::AtomicWriter w(path);
    h5::write_dataset(w.root(), "x", words, {2, 7});
    w.commit();
  }
  h5::File f = h5::File::open_read(path);
  const std::vector<float> got =
      read_converted_by_hdf5<float>(f.root().open_dataset("x"), H5T_NATIVE_FLOAT);
  expect_same(f.root().open_dataset("x").read<float>(), got);
  for (size_t i = 0; i < words.size(); ++i) {
    const float exact = bf16_to_float(words[i]);
    EXPECT_EQ(bits_of(got[i]), bits_of(exact)) << want[i];
    EXPECT_NEAR(got[i], want[i], std::abs(want[i]) / 128) << "bf16 keeps 8 significant bits";
  }
}

// ---------------------------------------------------------------------------------------
// Hyperslabs and appendable datasets

TEST(H5, ReadRowsAlongAxis0) {
  TempDir tmp;
  const std::string path = tmp.path("rows.h5");
  const auto f32 = values<float>(10 * 3 * 4);
  const auto b16 = values<bf16>(10 * 3 * 4);
  {
    h5::AtomicWriter w(path);
    h5::DatasetOptions small_chunks;
    small_chunks.chunk = {3, 3, 2};  // rows cross chunk borders
    h5::write_dataset(w.root(), "f32", f32, {10, 3, 4}, small_chunks);
    h5::write_dataset(w.root(), "b16", b16, {10, 3, 4});
    w.commit();
  }
  h5::File f = h5::File::open_read(path);
  const h5::Dataset ds = f.root().open_dataset("f32");
  for (auto [r0, r1] : std::vector<std::pair<int, int>>{{2, 5}, {0, 10}, {9, 10}, {4, 4}}) {
    SCOPED_TRACE(std::to_string(r0) + ".." + std::to_string(r1));
    const std::vector<float> got = ds.read_rows<float>(r0, r1);
    expect_same(got, std::vector<float>(f32.begin() + r0 * 12, f32.begin() + r1 * 12));
  }
  const std::vector<float> conv = f.root().open_dataset("b16").read_rows<float>(3, 6);
  for (size_t i = 0; i < conv.size(); ++i)
    ASSERT_EQ(bits_of(conv[i]), bits_of(bf16_to_float(b16[36 + i])));

  std::string msg = error_of([&] { ds.read_rows<float>(5, 11); });
  EXPECT_NE(msg.find(path + ": /f32: rows [5, 11) out of range for shape [10,3,4]"),
            std::string::npos)
      << msg;
  EXPECT_THROW(ds.read_rows<float>(-1, 2), h5::Error);
  EXPECT_THROW(ds.read_rows<float>(-1, -1), h5::Error);
  EXPECT_THROW(ds.read_rows<float>(0, int64_t(1) << 40), h5::Error);  // checked before allocating
  EXPECT_THROW(ds.read_rows<float>(3, 2), h5::Error);
  std::vector<float> small(5);
  msg = error_of([&] { ds.read_rows_into<float>(0, 1, small.data(), small.size()); });
  EXPECT_NE(msg.find("needs room for 12 values, got 5"), std::string::npos) << msg;
}

TEST(H5, AppendableGrowsOverSeveralAppends) {
  TempDir tmp;
  const std::string path = tmp.path("append.h5");
  const std::vector<int64_t> sizes = {1, 4, 0, 7, 2};
  std::vector<bf16> all;
  {
    h5::AtomicWriter w(path);
    h5::DatasetOptions opt;
    opt.chunk = {3, 2, 5};  // appends straddle chunks
    const h5::Dataset ds = h5::create_appendable<bf16>(w.root(), "cap/k", {2, 5}, opt);
    EXPECT_TRUE(ds.appendable());
    EXPECT_EQ(ds.shape(), (h5::Shape{0, 2, 5}));
    int64_t rows = 0;
    for (int64_t n : sizes) {
      const auto v = values<bf16>(size_t(n * 10), all.size());
      ds.append(v);
      all.insert(all.end(), v.begin(), v.end());
      rows += n;
      EXPECT_EQ(ds.shape(), (h5::Shape{rows, 2, 5}));
    }
    expect_same(ds.read<bf16>(), all);  // readable while still being written

    std::string msg = error_of([&] { ds.append(std::vector<bf16>(7)); });
    EXPECT_NE(msg.find("not a whole number of rows of [2,5]"), std::string::npos) << msg;
    msg = error_of([&] { ds.append(std::vector<float>(10)); });
    EXPECT_NE(msg.find("/cap/k is bf16, cannot append float32 rows"), std::string::npos) << msg;
    const h5::Dataset fixed =
        h5::write_dataset(w.root(), "fixed", std::vector<bf16>(10), {1, 2, 5});
    msg = error_of([&] { fixed.append(std::vector<bf16>(10)); });
    EXPECT_NE(msg.find("/fixed has a fixed shape"), std::string::npos) << msg;
    w.commit();
  }
  h5::File f = h5::File::open_read(path);
  const h5::Dataset ds = h5::open_dataset(f.root(), "cap/k", h5::DType::BF16, {14, 2, 5});
  EXPECT_TRUE(ds.appendable());
  expect_same(ds.read<bf16>(), all);
  expect_same(ds.read_rows<bf16>(4, 9), std::vector<bf16>(all.begin() + 40, all.begin() + 90));
}

// ---------------------------------------------------------------------------------------
// Layout: chunks and filters as asked, checked in the dataset creation property list

struct Layout {
  H5D_layout_t layout;
  std::vector<hsize_t> chunk;
  std::vector<H5Z_filter_t> filters;
  unsigned deflate_level = 0;
};

Layout layout_of(const h5::Dataset& ds) {
  Layout out;
  const hid_t dcpl = H5Dget_create_plist(ds.id());
  EXPECT_GE(dcpl, 0);
  out.layout = H5Pget_layout(dcpl);
  if (out.layout == H5D_CHUNKED) {
    out.chunk.resize(size_t(ds.rank()));
    EXPECT_EQ(H5Pget_chunk(dcpl, ds.rank(), out.chunk.data()), ds.rank());
  }
  const int n = H5Pget_nfilters(dcpl);
  for (int i = 0; i < n; ++i) {
    unsigned flags = 0, cd[8] = {};
    size_t ncd = 8;
    const H5Z_filter_t id =
        H5Pget_filter2(dcpl, unsigned(i), &flags, &ncd, cd, 0, nullptr, nullptr);
    out.filters.push_back(id);
    if (id == H5Z_FILTER_DEFLATE && ncd >= 1) out.deflate_level = cd[0];
  }
  H5Pclose(dcpl);
  return out;
}

TEST(H5Layout, DefaultsAreChunkedShuffledDeflated) {
  TempDir tmp;
  const std::string path = tmp.path("layout.h5");
  std::vector<float> smooth(1000 * 64);
  for (size_t i = 0; i < smooth.size(); ++i) smooth[i] = float(i % 64);  // compresses well
  {
    h5::AtomicWriter w(path);
    h5::write_dataset(w.root(), "default", smooth, {1000, 64});
    h5::DatasetOptions custom;
    custom.chunk = {100, 16};
    custom.deflate_level = 9;
    custom.shuffle = false;
    h5::write_dataset(w.root(), "custom", smooth, {1000, 64}, custom);
    h5::DatasetOptions plain;
    plain.chunked = false;
    h5::write_dataset(w.root(), "plain", smooth, {1000, 64}, plain);
    h5::DatasetOptions raw_chunks;
    raw_chunks.deflate_level = 0;
    h5::write_dataset(w.root(), "raw_chunks", smooth, {1000, 64}, raw_chunks);
    // Rows of 4 MiB: the default chunk halves axis 1 until a chunk fits 1 MiB.
    h5::create_appendable<float>(w.root(), "big_rows", {1024, 1024});
    w.commit();
  }
  h5::File f = h5::File::open_read(path);
  const h5::Dataset def = f.root().open_dataset("default");
  Layout l = layout_of(def);
  EXPECT_EQ(l.layout, H5D_CHUNKED);
  EXPECT_EQ(l.chunk, (std::vector<hsize_t>{1000, 64}));  // 4096 rows fit, capped at the extent
  EXPECT_EQ(l.filters, (std::vector<H5Z_filter_t>{H5Z_FILTER_SHUFFLE, H5Z_FILTER_DEFLATE}));
  EXPECT_EQ(l.deflate_level, 4u);
  EXPECT_LT(H5Dget_storage_size(def.id()), smooth.size() * sizeof(float) / 4);
  expect_same(def.read<float>(), smooth);

  l = layout_of(f.root().open_dataset("custom"));
  EXPECT_EQ(l.layout, H5D_CHUNKED);
  EXPECT_EQ(l.chunk, (std::vector<hsize_t>{100, 16}));
  EXPECT_EQ(l.filters, (std::vector<H5Z_filter_t>{H5Z_FILTER_DEFLATE}));
  EXPECT_EQ(l.deflate_level, 9u);
  expect_same(f.root().open_dataset("custom").read<float>(), smooth);

  l = layout_of(f.root().open_dataset("plain"));
  EXPECT_EQ(l.layout, H5D_CONTIGUOUS);
  EXPECT_TRUE(l.filters.empty());

  l = layout_of(f.root().open_dataset("raw_chunks"));
  EXPECT_EQ(l.layout, H5D_CHUNKED);
  EXPECT_TRUE(l.filters.empty());

  l = layout_of(f.root().open_dataset("big_rows"));
  EXPECT_EQ(l.chunk, (std::vector<hsize_t>{1, 256, 1024}));
}

TEST(H5Layout, BadOptionsNameTheKnob) {
  TempDir tmp;
  h5::AtomicWriter w(tmp.path("bad.h5"));
  h5::DatasetOptions opt;
  opt.deflate_level = 10;
  std::string msg =
      error_of([&] { h5::write_dataset(w.root(), "x", std::vector<float>(4), {4}, opt); });
  EXPECT_NE(msg.find("/x: DatasetOptions::deflate_level must be 0..9, got 10"), std::string::npos)
      << msg;
  opt = {};
  opt.chunk = {2, 2};
  msg = error_of([&] { h5::write_dataset(w.root(), "y", std::vector<float>(4), {4}, opt); });
  EXPECT_NE(msg.find("/y: DatasetOptions::chunk [2,2]"), std::string::npos) << msg;
  opt.chunk = {8};
  EXPECT_THROW(h5::write_dataset(w.root(), "z", std::vector<float>(4), {4}, opt), h5::Error);
}

// ---------------------------------------------------------------------------------------
// Atomic writes

TEST(H5Atomic, NothingAtFinalPathBeforeCommit) {
  TempDir tmp;
  const std::string path = tmp.path("a.h5");
  h5::AtomicWriter w(path);
  EXPECT_EQ(w.temp_path(), path + ".tmp." + std::to_string(::getpid()));
  // Objects still open at commit are closed with the file.
  const h5::Group g = w.root().create_group("g");
  const h5::Dataset ds = h5::write_dataset(g, "x", values<double>(100), {10, 10});
  g.set_attr_int("n", 10);
  EXPECT_FALSE(fs::exists(path));
  EXPECT_TRUE(fs::exists(w.temp_path()));
  w.commit();
  EXPECT_TRUE(fs::exists(path));
  EXPECT_FALSE(fs::exists(w.temp_path()));
  EXPECT_THROW(w.commit(), h5::Error);
  EXPECT_THROW(w.file(), h5::Error);

  h5::File f = h5::File::open_read(path);
  expect_same(f.root().open_dataset("g/x").read<double>(), values<double>(100));
  EXPECT_EQ(f.root().open_group("g").attr_int("n"), 10);
}

TEST(H5Atomic, ExceptionMidWriteLeavesNoFile) {
  TempDir tmp;
  const std::string path = tmp.path("b.h5");
  std::string temp;
  EXPECT_THROW(
      {
        h5::AtomicWriter w(path);
        temp = w.temp_path();
        h5::write_dataset(w.root(), "x", values<float>(1000), {1000});
        ASSERT_TRUE(fs::exists(temp));
        throw std::runtime_error("tokenizer failed");
      },
      std::runtime_error);
  EXPECT_FALSE(fs::exists(path));
  EXPECT_FALSE(fs::exists(temp));
}

TEST(H5Atomic, UncommittedRewriteKeepsOldFileCommittedOneReplacesIt) {
  TempDir tmp;
  const std::string path = tmp.path("c.h5");
  auto write_version = [&](int64_t v, bool commit) {
    h5::AtomicWriter w(path);
    w.root().set_attr_int("version", v);
    if (commit) w.commit();
  };
  write_version(1, true);
  write_version(2, false);
  EXPECT_EQ(h5::File::open_read(path).root().attr_int("version"), 1);
  write_version(3, true);
  EXPECT_EQ(h5::File::open_read(path).root().attr_int("version"), 3);
  for (const auto& e : fs::directory_iterator(fs::path(path).parent_path()))
    EXPECT_EQ(e.path().filename(), "c.h5") << "left behind: " << e.path();
}

TEST(H5Atomic, MissingFolderNamed) {
  TempDir tmp;
  const std::string path = tmp.path("no/such/dir/x.h5");
  const std::string msg = error_of([&] { h5::AtomicWriter w(path); });
  EXPECT_NE(msg.find(path + ": cannot create temporary file"), std::string::npos) << msg;
}

// ---------------------------------------------------------------------------------------
// Opening bad files

TEST(H5Open, MissingNotHdf5AndTruncatedFilesNameThePath) {
  TempDir tmp;
  testing::internal::CaptureStderr();

  const std::string missing = tmp.path("missing.h5");
  std::string msg = error_of([&] { h5::File::open_read(missing); });
  EXPECT_EQ(msg.rfind(missing + ": cannot open (No such file or directory)", 0), 0u) << msg;

  const std::string text = tmp.path("text.h5");
  std::ofstream(text) << "not hdf5 at all, just some text that is long enough\n";
  msg = error_of([&] { h5::File::open_read(text); });
  EXPECT_EQ(msg, text + ": not an HDF5 file (no HDF5 signature)");

  const std::string good = tmp.path("good.h5"), half = tmp.path("half.h5");
  {
    h5::AtomicWriter w(good);
    h5::DatasetOptions opt;
    opt.deflate_level = 0;  // so that the file is large and its end matters
    h5::write_dataset(w.root(), "x", values<double>(20000), {20000}, opt);
    w.root().set_attr_string("note", "written last");
    w.commit();
  }
  {
    std::ifstream in(good, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    ASSERT_GT(bytes.size(), 100000u);
    std::ofstream(half, std::ios::binary).write(bytes.data(), std::streamsize(bytes.size() / 2));
  }
  msg = error_of([&] { h5::File::open_read(half); });
  EXPECT_EQ(msg.rfind(half + ": damaged or truncated HDF5 file (", 0), 0u) << msg;
  EXPECT_NE(msg.find("(truncated file: eof = "), std::string::npos) << "HDF5's reason: " << msg;

  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(err, "") << "HDF5 printed its own error stack";
  // The intact original still reads.
  expect_same(h5::File::open_read(good).root().open_dataset("x").read<double>(),
              values<double>(20000));
}

// ---------------------------------------------------------------------------------------
// Validation

TEST(H5Validate, ShapeAndDtypeMismatchNameDatasetAndBoth) {
  TempDir tmp;
  const std::string path = tmp.path("capture.h5");
  {
    h5::AtomicWriter w(path);
    h5::write_dataset(w.root(), "seq0/layer2/q_pre", std::vector<bf16>(512 * 8 * 64), {512, 8, 64});
    w.commit();
  }
  h5::File f = h5::File::open_read(path);
  const h5::Group root = f.root();
  EXPECT_EQ(error_of([&] {
              h5::open_dataset(root, "seq0/layer2/q_pre", h5::DType::BF16, {512, 8, 128});
            }),
            path + ": /seq0/layer2/q_pre has shape [512,8,64], expected [512,8,128]");
  EXPECT_EQ(error_of([&] {
              h5::open_dataset(root, "seq0/layer2/q_pre", h5::DType::F32, {-1, 8, 64});
            }),
            path + ": /seq0/layer2/q_pre has dtype bf16, expected float32");
  EXPECT_EQ(error_of([&] {
              h5::open_dataset(root.open_group("seq0"), "layer2/q_pre", h5::DType::I32, {-1, 64});
            }),
            path +
                ": /seq0/layer2/q_pre has dtype bf16, expected int32, and shape [512,8,64], "
                "expected [*,64]");
  EXPECT_EQ(error_of([&] { h5::open_dataset(root, "seq0/layer3/q_pre", h5::DType::BF16, {-1}); }),
            path + ": no dataset /seq0/layer3/q_pre");
  EXPECT_EQ(error_of([&] { h5::open_dataset(root, "seq0/layer2", h5::DType::BF16, {-1}); }),
            path + ": /seq0/layer2 is not a dataset");
  const h5::Dataset ok = h5::open_dataset(root, "/seq0/layer2/q_pre", h5::DType::BF16, {-1, 8, 64});
  EXPECT_EQ(ok.path(), "/seq0/layer2/q_pre");
  EXPECT_EQ(ok.describe(), path + ": /seq0/layer2/q_pre");
}

TEST(H5Validate, UnsupportedStoredTypeIsNamed) {
  TempDir tmp;
  const std::string path = tmp.path("half.h5");
  {
    h5::AtomicWriter w(path);
    // An IEEE half dataset as another tool would write it.
    const hid_t half = H5Tcopy(H5T_IEEE_F32LE);
    H5Tset_fields(half, 15, 10, 5, 0, 10);
    H5Tset_precision(half, 16);
    H5Tset_size(half, 2);
    H5Tset_ebias(half, 15);
    const hsize_t n = 4;
    const hid_t space = H5Screate_simple(1, &n, nullptr);
    const hid_t ds =
        H5Dcreate2(w.root().id(), "h", half, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    ASSERT_GE(ds, 0);
    H5Dclose(ds);
    H5Sclose(space);
    H5Tclose(half);
    w.commit();
  }
  h5::File f = h5::File::open_read(path);
  std::string msg = error_of([&] { f.root().open_dataset("h").dtype(); });
  EXPECT_NE(msg.find(path + ": /h has element type float16 (IEEE half)"), std::string::npos) << msg;
  msg = error_of([&] { h5::open_dataset(f.root(), "h", h5::DType::BF16, {4}); });
  EXPECT_EQ(msg, path + ": /h has dtype float16 (IEEE half), expected bf16");
}

// ---------------------------------------------------------------------------------------
// Groups and attributes

TEST(H5Group, CreateOpenExistsChildren) {
  TempDir tmp;
  const std::string path = tmp.path("g.h5");
  {
    h5::AtomicWriter w(path);
    const h5::Group root = w.root();
    const h5::Group deep = root.create_group("a/b/c");  // intermediates created
    EXPECT_EQ(deep.path(), "/a/b/c");
    root.create_group("z");
    h5::write_dataset(root, "m", std::vector<int32_t>{1}, {1});
    EXPECT_EQ(error_of([&] { root.create_group("a/b"); }), path + ": /a/b already exists");
    EXPECT_EQ(error_of([&] { h5::write_dataset(root, "m", std::vector<int32_t>{1}, {1}); }),
              path + ": /m already exists");
    w.commit();
  }
  h5::File f = h5::File::open_read(path);
  const h5::Group root = f.root();
  EXPECT_EQ(root.children(), (std::vector<std::string>{"a", "m", "z"}));
  EXPECT_TRUE(root.exists("a/b/c"));
  EXPECT_TRUE(root.exists("/a/b"));
  EXPECT_FALSE(root.exists("a/x/c"));  // a missing intermediate is an answer, not an error
  EXPECT_FALSE(root.exists("m/under_a_dataset"));
  EXPECT_TRUE(root.is_group("a/b"));
  EXPECT_FALSE(root.is_group("m"));
  EXPECT_TRUE(root.is_dataset("m"));
  EXPECT_FALSE(root.is_dataset("nothing"));
  EXPECT_EQ(root.open_group("a").open_group("b").children(), (std::vector<std::string>{"c"}));
  EXPECT_EQ(error_of([&] { root.open_group("a/q"); }), path + ": no group /a/q");
  EXPECT_EQ(error_of([&] { root.open_group("m"); }), path + ": /m is not a group");
  EXPECT_TRUE(root.open_group("z").children().empty());
}

TEST(H5Attr, RoundTripOverwriteAndErrors) {
  TempDir tmp;
  const std::string path = tmp.path("attr.h5");
  {
    h5::AtomicWriter w(path);
    const h5::Group g = w.root().create_group("saap");
    g.set_attr_string("name", "k-means on de-RoPE keys, \xc3\xa9t\xc3\xa9");
    g.set_attr_string("empty", "");
    g.set_attr_int("clusters", 1LL << 40);
    g.set_attr_double("tau", -0.125);
    g.set_attr_ints("ids", {3, -4, 1LL << 50});
    g.set_attr_doubles("w", {0.5, 1e-300, -2.0});
    g.set_attr_ints("none", {});
    g.set_attr_int("replaced", 1);
    g.set_attr_string("replaced", "now a string");  // replacing changes the type too
    const h5::Dataset ds = h5::write_dataset(g, "c", std::vector<float>{1, 2}, {2});
    ds.set_attr_string("unit", "logit");
    w.commit();
  }
  h5::File f = h5::File::open_read(path);
  const h5::Group g = f.root().open_group("saap");
  EXPECT_EQ(g.attr_string("name"), "k-means on de-RoPE keys, \xc3\xa9t\xc3\xa9");
  EXPECT_EQ(g.attr_string("empty"), "");
  EXPECT_EQ(g.attr_int("clusters"), 1LL << 40);
  EXPECT_EQ(g.attr_double("tau"), -0.125);
  EXPECT_EQ(g.attr_ints("ids"), (std::vector<int64_t>{3, -4, 1LL << 50}));
  EXPECT_EQ(g.attr_doubles("w"), (std::vector<double>{0.5, 1e-300, -2.0}));
  EXPECT_TRUE(g.attr_ints("none").empty());
  EXPECT_EQ(g.attr_string("replaced"), "now a string");
  EXPECT_EQ(g.attr_ints("clusters"), (std::vector<int64_t>{1LL << 40}));  // scalar as 1 value
  EXPECT_EQ(f.root().open_dataset("saap/c").attr_string("unit"), "logit");
  EXPECT_EQ(g.attr_names(), (std::vector<std::string>{"clusters", "empty", "ids", "name", "none",
                                                      "replaced", "tau", "w"}));

  EXPECT_EQ(error_of([&] { g.attr_int("missing"); }),
            path + ": /saap: missing attribute 'missing'");
  EXPECT_EQ(error_of([&] { g.attr_int("name"); }),
            path + ": /saap: attribute 'name' is a string, expected an integer");
  EXPECT_EQ(error_of([&] { g.attr_string("tau"); }),
            path + ": /saap: attribute 'tau' is a float, expected a string");
  EXPECT_EQ(error_of([&] { g.attr_double("clusters"); }),
            path + ": /saap: attribute 'clusters' is an integer, expected a float");
  EXPECT_EQ(error_of([&] { g.attr_int("ids"); }),
            path + ": /saap: attribute 'ids' has 3 values, expected one");
  EXPECT_EQ(error_of([&] { f.root().open_dataset("saap/c").attr_double("unit"); }),
            path + ": /saap/c: attribute 'unit' is a string, expected a float");
}

}  // namespace
}  // namespace kvs
