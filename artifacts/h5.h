// A small, explicit RAII layer over the HDF5 C API (1.10). Every file kvsparse reads or
// writes goes through it, so that errors always name the file, the object and what was
// expected, and so that a file at its final path is always complete.
//
//   h5::AtomicWriter w("capture.h5");            // writes capture.h5.tmp.<pid>
//   h5::Group seq = w.root().create_group("seq0");
//   h5::write_dataset(seq, "tokens", tokens.data(), {T});
//   w.commit();                                    // closes, fsyncs, renames over capture.h5
//
//   h5::File f = h5::File::open_read("capture.h5");
//   h5::Dataset q = h5::open_dataset(f.root(), "seq0/layer2/q_pre", h5::DType::BF16, {-1, 8, 128});
//   std::vector<float> rows = q.read_rows<float>(0, 16);   // bf16 widened to fp32
//
// HDF5's own error stack printing is switched off (on the thread that opens or creates a
// file); failures become h5::Error carrying HDF5's reason. The library is the serial
// build: do not call into it from several threads at once.
#pragma once

#include <hdf5.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/common/bf16.h"

namespace kvs {
namespace h5 {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Element types of datasets. BF16 is stored as an HDF5 user-defined 16-bit float (1 sign,
// 8 exponent, 7 mantissa bits, bias 127) so that HDF5 tools and h5py convert it on read.
enum class DType { F32, F64, I32, I64, U8, BF16 };
const char* to_string(DType dtype);  // "float32", "float64", "int32", "int64", "uint8", "bf16"
size_t size_of(DType dtype);

template <class T>
constexpr DType dtype_of() {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double> ||
                    std::is_same_v<T, int32_t> || std::is_same_v<T, int64_t> ||
                    std::is_same_v<T, uint8_t> || std::is_same_v<T, bf16>,
                "h5: element type must be float, double, int32_t, int64_t, uint8_t or bf16");
  if constexpr (std::is_same_v<T, float>) return DType::F32;
  if constexpr (std::is_same_v<T, double>) return DType::F64;
  if constexpr (std::is_same_v<T, int32_t>) return DType::I32;
  if constexpr (std::is_same_v<T, int64_t>) return DType::I64;
  if constexpr (std::is_same_v<T, uint8_t>) return DType::U8;
  return DType::BF16;
}

// Whether stored `from` can be read as `to` without loss (same type, or a widening such as
// bf16 -> float32, int32 -> int64). Reads refuse anything else rather than round or clamp.
bool reads_losslessly(DType from, DType to);

// Dimensions; in expected shapes -1 matches any extent.
using Shape = std::vector<int64_t>;
std::string to_string(const Shape& shape);  // "[512,8,128]"; -1 is printed as "*"
int64_t num_elements(const Shape& shape);

// Owning reference to an HDF5 identifier. Copies share it through HDF5's own reference
// count. Identifiers that HDF5 already closed (a writer's file closed with all its objects
// at commit) are skipped on release.
class Handle {
 public:
  Handle() = default;
  explicit Handle(hid_t id) : id_(id) {}  // takes ownership of one reference
  Handle(const Handle& other);
  Handle(Handle&& other) noexcept : id_(other.id_) { other.id_ = H5I_INVALID_HID; }
  Handle& operator=(Handle other) noexcept {
    std::swap(id_, other.id_);
    return *this;
  }
  ~Handle();
  hid_t id() const { return id_; }
  bool valid() const;
  hid_t release() {  // gives up ownership without closing
    return std::exchange(id_, H5I_INVALID_HID);
  }

 private:
  hid_t id_ = H5I_INVALID_HID;
};

class Group;

// What groups and datasets share: an identity for messages (file and path) and attributes.
// Attributes are scalars or 1-D arrays; setting one replaces any previous value and type.
class Object {
 public:
  hid_t id() const { return handle_.id(); }  // for calls this wrapper does not cover
  const std::string& file_name() const { return file_; }
  std::string path() const;      // HDF5 path inside the file, e.g. "/seq0/layer2/q_pre"
  std::string describe() const;  // "capture.h5: /seq0/layer2/q_pre"

  bool has_attr(const std::string& name) const;
  std::vector<std::string> attr_names() const;
  void set_attr_string(const std::string& name, const std::string& value) const;
  void set_attr_int(const std::string& name, int64_t value) const;
  void set_attr_double(const std::string& name, double value) const;
  void set_attr_ints(const std::string& name, const std::vector<int64_t>& values) const;
  void set_attr_doubles(const std::string& name, const std::vector<double>& values) const;

  // Throw naming file, object and attribute when it is missing or of another type. Integer
  // attributes of any width that fits int64 are accepted, float32 ones read as double.
  std::string attr_string(const std::string& name) const;
  int64_t attr_int(const std::string& name) const;
  double attr_double(const std::string& name) const;
  std::vector<int64_t> attr_ints(const std::string& name) const;
  std::vector<double> attr_doubles(const std::string& name) const;

 protected:
  Object() = default;
  Object(Handle handle, std::string file) : handle_(std::move(handle)), file_(std::move(file)) {}
  Handle handle_;
  std::string file_;  // the name messages use (a writer's final path, not its temp path)

  friend class Group;
};

class Dataset : public Object {
 public:
  Dataset() = default;
  DType dtype() const;  // throws, naming the type, when it is none of DType
  Shape shape() const;
  int rank() const { return int(shape().size()); }
  bool appendable() const;  // axis 0 unlimited

  // Whole dataset, converted to T when reads_losslessly(dtype(), T). bf16 is read as its
  // 16-bit words and widened here, which gives exactly what HDF5's own (much slower)
  // conversion gives; the other widenings are HDF5's.
  template <class T>
  std::vector<T> read() const {
    std::vector<T> out(size_t(num_elements(shape())));
    read_into(out.data(), out.size());
    return out;
  }
  template <class T>
  void read_into(T* dst, size_t count) const {
    read_raw(dtype_of<T>(), dst, count, false, 0, 0);
  }

  // Rows [r0, r1) along axis 0, everything along the other axes.
  template <class T>
  std::vector<T> read_rows(int64_t r0, int64_t r1) const {
    std::vector<T> out(size_t(rows_elements(r0, r1)));
    read_rows_into(r0, r1, out.data(), out.size());
    return out;
  }
  template <class T>
  void read_rows_into(int64_t r0, int64_t r1, T* dst, size_t count) const {
    read_raw(dtype_of<T>(), dst, count, true, r0, r1);
  }

  // Appends `rows` rows (rows * row size elements) to an appendable dataset of type T.
  template <class T>
  void append(const T* data, int64_t rows) const {
    append_raw(dtype_of<T>(), data, rows);
  }
  template <class T>
  void append(const std::vector<T>& data) const {
    append_raw_checked(dtype_of<T>(), data.data(), data.size());
  }

 private:
  Dataset(Handle handle, std::string file) : Object(std::move(handle), std::move(file)) {}
  // Number of elements in rows [r0, r1); throws when the range is outside axis 0.
  int64_t rows_elements(int64_t r0, int64_t r1) const;
  void read_raw(DType mem, void* dst, size_t count, bool rows, int64_t r0, int64_t r1) const;
  void append_raw(DType mem, const void* data, int64_t rows) const;
  void append_raw_checked(DType mem, const void* data, size_t count) const;

  friend class Group;
};

// How a dataset is laid out on disk. Defaults suit the project's arrays (KV vectors,
// attention maps, centroids): chunked, shuffled, deflated at a moderate level.
struct DatasetOptions {
  bool chunked = true;    ///< chunked layout; compression needs it. Empty datasets are contiguous.
  Shape chunk;            ///< chunk shape, same rank as the data; empty: whole trailing axes and
                          ///< as many axis-0 rows as fit kDefaultChunkBytes (at least one row)
  int deflate_level = 4;  ///< zlib level 1..9, 0 = no compression
  bool shuffle = true;    ///< byte shuffle before deflate (helps bf16/float a lot)
};
constexpr size_t kDefaultChunkBytes = size_t(1) << 20;  ///< target size of a default chunk

class Group : public Object {
 public:
  Group() = default;

  // `name` may be a relative path ("seq0/layer2"); missing intermediate groups are created.
  Group create_group(const std::string& name) const;
  Group open_group(const std::string& name) const;  // throws naming the path when absent
  // Whether a link `name` (a relative path) exists; intermediate groups need not exist.
  bool exists(const std::string& name) const;
  bool is_group(const std::string& name) const;
  bool is_dataset(const std::string& name) const;
  std::vector<std::string> children() const;  // names of groups and datasets, sorted

  // Without checks; h5::open_dataset below also checks type and shape.
  Dataset open_dataset(const std::string& name) const;
  std::string child_path(const std::string& name) const;  // "/seq0" + "q_pre" -> "/seq0/q_pre"

 private:
  Group(Handle handle, std::string file) : Object(std::move(handle), std::move(file)) {}
  Dataset make_dataset(const std::string& name, DType dtype, const Shape& dims, bool appendable,
                       const DatasetOptions& options) const;
  friend class File;
  friend Dataset write_dataset(const Group&, const std::string&, DType, const void*, const Shape&,
                               const DatasetOptions&);
  friend Dataset create_appendable(const Group&, const std::string&, DType, const Shape&,
                                   const DatasetOptions&);
};

// An open file. Move-only: the file closes when the last File and the last object opened
// from it are gone.
class File {
 public:
  // Read-only. Throws naming the path when it does not exist, is not HDF5, or is damaged
  // (e.g. truncated), with HDF5's own reason.
  static File open_read(const std::string& path);

  File() = default;
  File(File&&) = default;
  File& operator=(File&&) = default;
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  Group root() const;
  const std::string& path() const { return name_; }
  hid_t id() const { return handle_.id(); }

 private:
  File(Handle handle, std::string name) : handle_(std::move(handle)), name_(std::move(name)) {}
  Handle handle_;
  std::string name_;
  friend class AtomicWriter;
};

// Creates `<final_path>.tmp.<pid>`; commit() closes it (and every object opened from it),
// fsyncs and renames it over final_path. Destroyed without commit, it deletes the temp
// file, so an exception or a crash never leaves a complete-looking file at final_path.
class AtomicWriter {
 public:
  explicit AtomicWriter(std::string final_path);
  ~AtomicWriter();
  AtomicWriter(const AtomicWriter&) = delete;
  AtomicWriter& operator=(const AtomicWriter&) = delete;

  const File& file() const;
  Group root() const { return file().root(); }
  void commit();  // throws if already committed or if closing/renaming fails
  bool committed() const { return committed_; }
  const std::string& final_path() const { return final_path_; }
  const std::string& temp_path() const { return temp_path_; }

 private:
  bool close_file();  // false when HDF5 failed to flush or close
  std::string final_path_, temp_path_;
  File file_;
  bool committed_ = false;
};

// Opens `name` under `group` and checks its type and shape (-1 in `expected_shape` matches
// any extent). The error names the file, the dataset path and expected vs actual, e.g.
// "capture.h5: /seq0/layer2/q_pre has shape [512,8,64], expected [512,8,128]".
Dataset open_dataset(const Group& group, const std::string& name, DType expected_dtype,
                     const Shape& expected_shape);

// Creates `name` with `shape` and writes all num_elements(shape) values of `data`.
Dataset write_dataset(const Group& group, const std::string& name, DType dtype, const void* data,
                      const Shape& shape, const DatasetOptions& options = {});
template <class T>
Dataset write_dataset(const Group& group, const std::string& name, const T* data,
                      const Shape& shape, const DatasetOptions& options = {}) {
  return write_dataset(group, name, dtype_of<T>(), data, shape, options);
}
// Checks data.size() == num_elements(shape).
template <class T>
Dataset write_dataset(const Group& group, const std::string& name, const std::vector<T>& data,
                      const Shape& shape, const DatasetOptions& options = {}) {
  if (int64_t(data.size()) != num_elements(shape))
    throw Error(group.describe() + ": dataset '" + name + "' of shape " + to_string(shape) +
                " needs " + std::to_string(num_elements(shape)) + " values, got " +
                std::to_string(data.size()));
  return write_dataset(group, name, dtype_of<T>(), data.data(), shape, options);
}

// Copies `src` (a group or dataset, with everything under it and its attributes) to
// `dst_parent`/`name`, which must not exist; the files may differ.
void copy_object(const Object& src, const Group& dst_parent, const std::string& name);

// An empty dataset of shape [0, row_shape...] whose axis 0 grows with Dataset::append.
// Always chunked (HDF5 needs it for an unlimited axis); options.chunked is ignored.
Dataset create_appendable(const Group& group, const std::string& name, DType dtype,
                          const Shape& row_shape, const DatasetOptions& options = {});
template <class T>
Dataset create_appendable(const Group& group, const std::string& name, const Shape& row_shape,
                          const DatasetOptions& options = {}) {
  return create_appendable(group, name, dtype_of<T>(), row_shape, options);
}

}  // namespace h5
}  // namespace kvs
