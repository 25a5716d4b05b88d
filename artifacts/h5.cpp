#include "artifacts/h5.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

namespace kvs {
namespace h5 {

// ---------------------------------------------------------------------------------------
// Errors

namespace {

herr_t innermost_error(unsigned n, const H5E_error2_t* err, void* out) {
  // Walking upward, entry 0 is where HDF5 detected the problem: the most specific text.
  if (n == 0 && err->desc) *static_cast<std::string*>(out) = err->desc;
  return 0;
}

// HDF5's reason for the last failed call on this thread, recorded when the call fails:
// any later API call (building our message calls H5Iget_name) clears HDF5's error stack.
thread_local std::string t_last_reason;

herr_t record_error(hid_t stack, void*) {
  std::string reason;
  H5Ewalk2(stack, H5E_WALK_UPWARD, innermost_error, &reason);
  t_last_reason = reason;
  return 0;
}

// Replaces HDF5's default handler, which prints the error stack to stderr: our exceptions
// say what went wrong. Per thread, as thread-safe HDF5 builds keep one stack per thread.
void quiet() {
  thread_local bool done = false;
  if (!done) {
    H5Eset_auto2(H5E_DEFAULT, record_error, nullptr);
    done = true;
  }
}

std::string hdf5_reason() {
  std::string reason = std::move(t_last_reason);
  t_last_reason.clear();
  return reason.empty() ? "HDF5 gave no reason" : reason;
}

// For failures that are answers, not errors (a missing intermediate group).
void forget_error() {
  t_last_reason.clear();
  H5Eclear2(H5E_DEFAULT);
}

[[noreturn]] void fail(const std::string& what) { throw Error(what + " (" + hdf5_reason() + ")"); }

template <class Id>
Id check(Id id, const std::string& what) {
  if (id < 0) fail(what);
  return id;
}

std::string quote(const std::string& s) { return "'" + s + "'"; }

std::vector<hsize_t> to_hsize(const Shape& s) { return std::vector<hsize_t>(s.begin(), s.end()); }

// ---------------------------------------------------------------------------------------
// Types

Handle make_bf16(hid_t f32_base) {
  // Shrink an IEEE single to its top 16 bits: fields first, so that they always fit the
  // precision, then precision, offset and size.
  Handle t(check(H5Tcopy(f32_base), "H5Tcopy"));
  check(H5Tset_fields(t.id(), 15, 7, 8, 0, 7), "bf16 type: set fields");
  check(H5Tset_precision(t.id(), 16), "bf16 type: set precision");
  check(H5Tset_offset(t.id(), 0), "bf16 type: set offset");
  check(H5Tset_size(t.id(), 2), "bf16 type: set size");
  check(H5Tset_ebias(t.id(), 127), "bf16 type: set exponent bias");
  check(H5Tset_norm(t.id(), H5T_NORM_IMPLIED), "bf16 type: set normalization");
  return t;
}

Handle file_type(DType d) {
  switch (d) {
    case DType::F32:
      return Handle(H5Tcopy(H5T_IEEE_F32LE));
    case DType::F64:
      return Handle(H5Tcopy(H5T_IEEE_F64LE));
    case DType::I32:
      return Handle(H5Tcopy(H5T_STD_I32LE));
    case DType::I64:
      return Handle(H5Tcopy(H5T_STD_I64LE));
    case DType::U8:
      return Handle(H5Tcopy(H5T_STD_U8LE));
    case DType::BF16:
      return make_bf16(H5T_IEEE_F32LE);
  }
  throw Error("h5: unknown DType");
}

Handle mem_type(DType d) {
  switch (d) {
    case DType::F32:
      return Handle(H5Tcopy(H5T_NATIVE_FLOAT));
    case DType::F64:
      return Handle(H5Tcopy(H5T_NATIVE_DOUBLE));
    case DType::I32:
      return Handle(H5Tcopy(H5T_NATIVE_INT32));
    case DType::I64:
      return Handle(H5Tcopy(H5T_NATIVE_INT64));
    case DType::U8:
      return Handle(H5Tcopy(H5T_NATIVE_UINT8));
    case DType::BF16:
      return make_bf16(H5T_NATIVE_FLOAT);
  }
  throw Error("h5: unknown DType");
}

struct FloatLayout {
  size_t spos, epos, esize, mpos, msize, ebias;
};

FloatLayout float_layout(hid_t t) {
  FloatLayout f{};
  H5Tget_fields(t, &f.spos, &f.epos, &f.esize, &f.mpos, &f.msize);
  f.ebias = H5Tget_ebias(t);
  return f;
}

bool same(const FloatLayout& f, size_t spos, size_t epos, size_t esize, size_t msize,
          size_t ebias) {
  return f.spos == spos && f.epos == epos && f.esize == esize && f.mpos == 0 && f.msize == msize &&
         f.ebias == ebias;
}

// The DType of a stored type, or false with a description of what it is instead.
bool classify(hid_t t, DType* out, std::string* what) {
  const H5T_class_t cls = H5Tget_class(t);
  const size_t size = H5Tget_size(t);
  if (cls == H5T_FLOAT) {
    const FloatLayout f = float_layout(t);
    if (size == 4 && same(f, 31, 23, 8, 23, 127)) return *out = DType::F32, true;
    if (size == 8 && same(f, 63, 52, 11, 52, 1023)) return *out = DType::F64, true;
    if (size == 2 && same(f, 15, 7, 8, 7, 127)) return *out = DType::BF16, true;
    if (size == 2 && same(f, 15, 10, 5, 10, 15)) return *what = "float16 (IEEE half)", false;
    *what = "a " + std::to_string(8 * size) + "-bit float with " + std::to_string(f.esize) +
            " exponent and " + std::to_string(f.msize) + " mantissa bits";
    return false;
  }
  if (cls == H5T_INTEGER) {
    const bool is_signed = H5Tget_sign(t) == H5T_SGN_2;
    if (is_signed && size == 4) return *out = DType::I32, true;
    if (is_signed && size == 8) return *out = DType::I64, true;
    if (!is_signed && size == 1) return *out = DType::U8, true;
    *what = std::string(is_signed ? "int" : "uint") + std::to_string(8 * size);
    return false;
  }
  switch (cls) {
    case H5T_STRING:
      *what = "string";
      break;
    case H5T_COMPOUND:
      *what = "compound";
      break;
    case H5T_ENUM:
      *what = "enum";
      break;
    case H5T_ARRAY:
      *what = "array";
      break;
    default:
      *what = "HDF5 type class " + std::to_string(int(cls));
      break;
  }
  return false;
}

const char* class_name(H5T_class_t cls) {
  switch (cls) {
    case H5T_INTEGER:
      return "an integer";
    case H5T_FLOAT:
      return "a float";
    case H5T_STRING:
      return "a string";
    default:
      return "of another type";
  }
}

Shape space_shape(hid_t space) {
  const int rank = H5Sget_simple_extent_ndims(space);
  if (rank < 0) fail("H5Sget_simple_extent_ndims");
  std::vector<hsize_t> dims(static_cast<size_t>(rank));
  if (rank > 0) H5Sget_simple_extent_dims(space, dims.data(), nullptr);
  return Shape(dims.begin(), dims.end());
}

// ---------------------------------------------------------------------------------------
// Paths

std::vector<std::string> split_path(const std::string& path) {
  std::vector<std::string> parts;
  size_t i = 0;
  while (i <= path.size()) {
    const size_t j = std::min(path.find('/', i), path.size());
    if (j > i) parts.push_back(path.substr(i, j - i));
    i = j + 1;
  }
  return parts;
}

Handle link_create_plist() {
  Handle lcpl(check(H5Pcreate(H5P_LINK_CREATE), "H5Pcreate(link)"));
  check(H5Pset_create_intermediate_group(lcpl.id(), 1), "H5Pset_create_intermediate_group");
  return lcpl;
}

Handle file_access_plist(bool strong_close) {
  Handle fapl(check(H5Pcreate(H5P_FILE_ACCESS), "H5Pcreate(file access)"));
  if (strong_close)
    check(H5Pset_fclose_degree(fapl.id(), H5F_CLOSE_STRONG), "H5Pset_fclose_degree");
#if H5_VERSION_GE(1, 10, 7)
  // Lock where the file system can, but do not fail where it cannot (some network and
  // container file systems have no flock).
  check(H5Pset_file_locking(fapl.id(), 1, 1), "H5Pset_file_locking");
#endif
  return fapl;
}

}  // namespace

// ---------------------------------------------------------------------------------------
// DType, Shape

const char* to_string(DType d) {
  switch (d) {
    case DType::F32:
      return "float32";
    case DType::F64:
      return "float64";
    case DType::I32:
      return "int32";
    case DType::I64:
      return "int64";
    case DType::U8:
      return "uint8";
    case DType::BF16:
      return "bf16";
  }
  return "?";
}

size_t size_of(DType d) {
  switch (d) {
    case DType::F64:
    case DType::I64:
      return 8;
    case DType::F32:
    case DType::I32:
      return 4;
    case DType::BF16:
      return 2;
    case DType::U8:
      return 1;
  }
  return 0;
}

bool reads_losslessly(DType from, DType to) {
  if (from == to) return true;
  switch (from) {
    case DType::BF16:
      return to == DType::F32 || to == DType::F64;
    case DType::F32:
      return to == DType::F64;
    case DType::U8:
      return to == DType::I32 || to == DType::I64;
    case DType::I32:
      return to == DType::I64;
    default:
      return false;
  }
}

std::string to_string(const Shape& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ",";
    s += shape[i] < 0 ? std::string("*") : std::to_string(shape[i]);
  }
  return s + "]";
}

int64_t num_elements(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// ---------------------------------------------------------------------------------------
// Handle

Handle::Handle(const Handle& other) : id_(other.id_) {
  if (valid()) H5Iinc_ref(id_);
}

Handle::~Handle() {
  if (valid()) H5Idec_ref(id_);
}

bool Handle::valid() const { return id_ >= 0 && H5Iis_valid(id_) > 0; }

// ---------------------------------------------------------------------------------------
// Object and attributes

std::string Object::path() const {
  const ssize_t n = H5Iget_name(id(), nullptr, 0);
  if (n < 0) fail(file_ + ": cannot get an object's name");
  std::string name(size_t(n) + 1, '\0');
  H5Iget_name(id(), name.data(), name.size());
  name.resize(static_cast<size_t>(n));
  return name;
}

std::string Object::describe() const { return file_ + ": " + path(); }

bool Object::has_attr(const std::string& name) const {
  const htri_t r = H5Aexists(id(), name.c_str());
  if (r < 0) fail(describe() + ": cannot look up attribute " + quote(name));
  return r > 0;
}

namespace {
herr_t collect_attr(hid_t, const char* name, const H5A_info_t*, void* out) {
  static_cast<std::vector<std::string>*>(out)->push_back(name);
  return 0;
}

// The open attribute `name` of `obj`, or an error naming it when missing.
Handle open_attr(const Object& obj, const std::string& name) {
  if (!obj.has_attr(name)) throw Error(obj.describe() + ": missing attribute " + quote(name));
  return Handle(check(H5Aopen(obj.id(), name.c_str(), H5P_DEFAULT),
                      obj.describe() + ": cannot open attribute " + quote(name)));
}

void write_attr(const Object& obj, const std::string& name, hid_t ftype, hid_t mtype, hid_t space,
                const void* data, size_t count = 1) {
  if (obj.has_attr(name))
    check(H5Adelete(obj.id(), name.c_str()),
          obj.describe() + ": cannot replace attribute " + quote(name));
  Handle a(check(H5Acreate2(obj.id(), name.c_str(), ftype, space, H5P_DEFAULT, H5P_DEFAULT),
                 obj.describe() + ": cannot create attribute " + quote(name)));
  if (count > 0)  // HDF5 refuses a null buffer even for zero values
    check(H5Awrite(a.id(), mtype, data),
          obj.describe() + ": cannot write attribute " + quote(name));
}

Handle vector_space(size_t n) {
  const hsize_t dim = n;
  return Handle(check(H5Screate_simple(1, &dim, nullptr), "H5Screate_simple"));
}

// Attribute `name` as `count` values of `mtype`, after checking its class. `scalar`
// demands exactly one value; otherwise a scalar or 1-D attribute is read whole.
template <class T>
std::vector<T> read_attr_values(const Object& obj, const std::string& name, H5T_class_t want,
                                hid_t mtype, bool scalar) {
  Handle a = open_attr(obj, name);
  Handle t(check(H5Aget_type(a.id()), "H5Aget_type"));
  const H5T_class_t cls = H5Tget_class(t.id());
  const std::string where = obj.describe() + ": attribute " + quote(name);
  if (cls != want) throw Error(where + " is " + class_name(cls) + ", expected " + class_name(want));
  if (cls == H5T_INTEGER && H5Tget_size(t.id()) >= 8 && H5Tget_sign(t.id()) == H5T_SGN_NONE)
    throw Error(where + " is uint64, expected an integer that fits int64");
  Handle space(check(H5Aget_space(a.id()), "H5Aget_space"));
  const Shape s = space_shape(space.id());
  if (s.size() > 1) throw Error(where + " has shape " + to_string(s) + ", expected 1-D");
  const int64_t n = num_elements(s);
  if (scalar && n != 1) throw Error(where + " has " + std::to_string(n) + " values, expected one");
  std::vector<T> values(static_cast<size_t>(n));
  if (n > 0) check(H5Aread(a.id(), mtype, values.data()), "cannot read " + where);
  return values;
}
}  // namespace

std::vector<std::string> Object::attr_names() const {
  std::vector<std::string> names;
  hsize_t idx = 0;
  check(H5Aiterate2(id(), H5_INDEX_NAME, H5_ITER_INC, &idx, collect_attr, &names),
        describe() + ": cannot list attributes");
  return names;
}

void Object::set_attr_string(const std::string& name, const std::string& value) const {
  // Variable-length UTF-8, which h5py reads as str.
  Handle t(check(H5Tcopy(H5T_C_S1), "H5Tcopy"));
  check(H5Tset_size(t.id(), H5T_VARIABLE), "H5Tset_size");
  check(H5Tset_cset(t.id(), H5T_CSET_UTF8), "H5Tset_cset");
  Handle space(check(H5Screate(H5S_SCALAR), "H5Screate"));
  const char* p = value.c_str();
  write_attr(*this, name, t.id(), t.id(), space.id(), &p);
}

void Object::set_attr_int(const std::string& name, int64_t value) const {
  Handle space(check(H5Screate(H5S_SCALAR), "H5Screate"));
  write_attr(*this, name, H5T_STD_I64LE, H5T_NATIVE_INT64, space.id(), &value);
}

void Object::set_attr_double(const std::string& name, double value) const {
  Handle space(check(H5Screate(H5S_SCALAR), "H5Screate"));
  write_attr(*this, name, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, space.id(), &value);
}

void Object::set_attr_ints(const std::string& name, const std::vector<int64_t>& values) const {
  write_attr(*this, name, H5T_STD_I64LE, H5T_NATIVE_INT64, vector_space(values.size()).id(),
             values.data(), values.size());
}

void Object::set_attr_doubles(const std::string& name, const std::vector<double>& values) const {
  write_attr(*this, name, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, vector_space(values.size()).id(),
             values.data(), values.size());
}

std::string Object::attr_string(const std::string& name) const {
  Handle a = open_attr(*this, name);
  Handle t(check(H5Aget_type(a.id()), "H5Aget_type"));
  const std::string where = describe() + ": attribute " + quote(name);
  const H5T_class_t cls = H5Tget_class(t.id());
  if (cls != H5T_STRING) throw Error(where + " is " + class_name(cls) + ", expected a string");
  Handle space(check(H5Aget_space(a.id()), "H5Aget_space"));
  const int64_t n = num_elements(space_shape(space.id()));
  if (n != 1) throw Error(where + " has " + std::to_string(n) + " strings, expected one");
  if (H5Tis_variable_str(t.id()) > 0) {
    Handle m(check(H5Tcopy(H5T_C_S1), "H5Tcopy"));
    H5Tset_size(m.id(), H5T_VARIABLE);
    H5Tset_cset(m.id(), H5Tget_cset(t.id()));
    char* p = nullptr;
    check(H5Aread(a.id(), m.id(), &p), "cannot read " + where);
    std::string s = p ? p : "";
    H5free_memory(p);
    return s;
  }
  // Fixed-length (h5py writes numpy bytes this way): padded with NULs or spaces.
  std::string s(H5Tget_size(t.id()), '\0');
  check(H5Aread(a.id(), t.id(), s.data()), "cannot read " + where);
  s.resize(std::min(s.size(), s.find('\0')));
  if (H5Tget_strpad(t.id()) == H5T_STR_SPACEPAD) s.erase(s.find_last_not_of(' ') + 1);
  return s;
}

int64_t Object::attr_int(const std::string& name) const {
  return read_attr_values<int64_t>(*this, name, H5T_INTEGER, H5T_NATIVE_INT64, true)[0];
}

double Object::attr_double(const std::string& name) const {
  return read_attr_values<double>(*this, name, H5T_FLOAT, H5T_NATIVE_DOUBLE, true)[0];
}

std::vector<int64_t> Object::attr_ints(const std::string& name) const {
  return read_attr_values<int64_t>(*this, name, H5T_INTEGER, H5T_NATIVE_INT64, false);
}

std::vector<double> Object::attr_doubles(const std::string& name) const {
  return read_attr_values<double>(*this, name, H5T_FLOAT, H5T_NATIVE_DOUBLE, false);
}

// ---------------------------------------------------------------------------------------
// Dataset

DType Dataset::dtype() const {
  Handle t(check(H5Dget_type(id()), describe() + ": cannot get type"));
  DType d;
  std::string what;
  if (!classify(t.id(), &d, &what))
    throw Error(describe() + " has element type " + what +
                ", expected one of float32, float64, int32, int64, uint8, bf16");
  return d;
}

Shape Dataset::shape() const {
  Handle space(check(H5Dget_space(id()), describe() + ": cannot get dataspace"));
  return space_shape(space.id());
}

bool Dataset::appendable() const {
  Handle space(check(H5Dget_space(id()), describe() + ": cannot get dataspace"));
  const int rank = H5Sget_simple_extent_ndims(space.id());
  if (rank < 1) return false;
  std::vector<hsize_t> dims(static_cast<size_t>(rank)), max_dims(static_cast<size_t>(rank));
  H5Sget_simple_extent_dims(space.id(), dims.data(), max_dims.data());
  return max_dims[0] == H5S_UNLIMITED;
}

int64_t Dataset::rows_elements(int64_t r0, int64_t r1) const {
  const Shape s = shape();
  if (s.empty() || r0 < 0 || r1 < r0 || r1 > s[0])
    throw Error(describe() + ": rows [" + std::to_string(r0) + ", " + std::to_string(r1) +
                ") out of range for shape " + to_string(s));
  return (r1 - r0) * num_elements(Shape(s.begin() + 1, s.end()));
}

void Dataset::read_raw(DType mem, void* dst, size_t count, bool rows, int64_t r0,
                       int64_t r1) const {
  const DType stored = dtype();
  if (!reads_losslessly(stored, mem))
    throw Error(describe() + " is " + to_string(stored) + " and cannot be read as " +
                to_string(mem) + " without loss");
  const Shape s = shape();
  Shape sel = s;
  if (rows) {
    rows_elements(r0, r1);  // range check
    sel[0] = r1 - r0;
  }
  const int64_t n = num_elements(sel);
  if (int64_t(count) != n)
    throw Error(describe() + ": reading " + to_string(sel) + " needs room for " +
                std::to_string(n) + " values, got " + std::to_string(count));
  if (n == 0) return;
  // HDF5's soft conversion of bf16 is ~20x slower than reading the words and widening them
  // here (its result is the same: tests check both against bf16_to_float for every value).
  // The words go to the front of dst and are widened from the back, so nothing unread is
  // overwritten.
  const bool widen_bf16 = stored == DType::BF16 && mem != DType::BF16;
  Handle mtype = mem_type(widen_bf16 ? DType::BF16 : mem);
  if (!rows) {
    check(H5Dread(id(), mtype.id(), H5S_ALL, H5S_ALL, H5P_DEFAULT, dst),
          "cannot read " + describe());
  } else {
    Handle fspace(check(H5Dget_space(id()), "H5Dget_space"));
    std::vector<hsize_t> start(s.size(), 0), cnt = to_hsize(sel);
    start[0] = hsize_t(r0);
    check(H5Sselect_hyperslab(fspace.id(), H5S_SELECT_SET, start.data(), nullptr, cnt.data(),
                              nullptr),
          describe() + ": cannot select rows");
    Handle mspace(check(H5Screate_simple(int(cnt.size()), cnt.data(), nullptr), "H5Screate"));
    check(H5Dread(id(), mtype.id(), mspace.id(), fspace.id(), H5P_DEFAULT, dst),
          "cannot read rows [" + std::to_string(r0) + ", " + std::to_string(r1) + ") of " +
              describe());
  }
  if (widen_bf16) {
    // Byte copies: the words and the results share storage, so no typed aliasing.
    unsigned char* bytes = static_cast<unsigned char*>(dst);
    for (int64_t i = n - 1; i >= 0; --i) {
      bf16 w;
      std::memcpy(&w, bytes + 2 * i, sizeof w);
      const float f = bf16_to_float(w);
      if (mem == DType::F32) {
        std::memcpy(bytes + 4 * i, &f, sizeof f);
      } else {
        const double d = f;
        std::memcpy(bytes + 8 * i, &d, sizeof d);
      }
    }
  }
}

void Dataset::append_raw(DType mem, const void* data, int64_t rows) const {
  const DType stored = dtype();
  if (stored != mem)
    throw Error(describe() + " is " + to_string(stored) + ", cannot append " + to_string(mem) +
                " rows");
  if (!appendable())
    throw Error(describe() + " has a fixed shape; only datasets made by create_appendable grow");
  if (rows < 0) throw Error(describe() + ": cannot append " + std::to_string(rows) + " rows");
  if (rows == 0) return;
  const Shape s = shape();
  std::vector<hsize_t> dims = to_hsize(s), start(s.size(), 0), cnt = to_hsize(s);
  start[0] = dims[0];
  cnt[0] = hsize_t(rows);
  dims[0] += hsize_t(rows);
  check(H5Dset_extent(id(), dims.data()),
        describe() + ": cannot grow to " + to_string(Shape(dims.begin(), dims.end())));
  Handle fspace(check(H5Dget_space(id()), "H5Dget_space"));
  check(
      H5Sselect_hyperslab(fspace.id(), H5S_SELECT_SET, start.data(), nullptr, cnt.data(), nullptr),
      describe() + ": cannot select the appended rows");
  Handle mspace(check(H5Screate_simple(int(cnt.size()), cnt.data(), nullptr), "H5Screate"));
  Handle mtype = mem_type(mem);
  check(H5Dwrite(id(), mtype.id(), mspace.id(), fspace.id(), H5P_DEFAULT, data),
        "cannot append " + std::to_string(rows) + " rows to " + describe());
}

void Dataset::append_raw_checked(DType mem, const void* data, size_t count) const {
  const Shape s = shape();
  if (s.empty()) throw Error(describe() + " is a scalar and cannot grow");
  const int64_t per_row = num_elements(Shape(s.begin() + 1, s.end()));
  if (per_row <= 0 || int64_t(count) % per_row != 0)
    throw Error(describe() + ": appending " + std::to_string(count) +
                " values, not a whole number of rows of " +
                to_string(Shape(s.begin() + 1, s.end())));
  append_raw(mem, data, int64_t(count) / per_row);
}

// ---------------------------------------------------------------------------------------
// Group

std::string Group::child_path(const std::string& name) const {
  if (!name.empty() && name[0] == '/') return name;
  const std::string p = path();
  return (p == "/" ? p : p + "/") + name;
}

bool Group::exists(const std::string& name) const {
  // H5Lexists fails, rather than answering false, when an intermediate group is missing.
  const std::vector<std::string> parts = split_path(name);
  if (parts.empty()) throw Error(describe() + ": empty object name");
  std::string prefix = name[0] == '/' ? "/" : "";
  for (size_t i = 0; i < parts.size(); ++i) {
    prefix += (i ? "/" : "") + parts[i];
    const htri_t r = H5Lexists(id(), prefix.c_str(), H5P_DEFAULT);
    if (r < 0) {
      forget_error();
      return false;  // a prefix names a dataset, so nothing lies below it
    }
    if (r == 0) return false;
  }
  return true;
}

namespace {
H5I_type_t object_kind(const Group& g, const std::string& name) {
  if (!g.exists(name)) return H5I_BADID;
  Handle o(check(H5Oopen(g.id(), name.c_str(), H5P_DEFAULT),
                 g.file_name() + ": cannot open " + g.child_path(name)));
  return H5Iget_type(o.id());
}
}  // namespace

bool Group::is_group(const std::string& name) const {
  return object_kind(*this, name) == H5I_GROUP;
}

bool Group::is_dataset(const std::string& name) const {
  return object_kind(*this, name) == H5I_DATASET;
}

std::vector<std::string> Group::children() const {
  H5G_info_t info;
  check(H5Gget_info(id(), &info), describe() + ": cannot list members");
  std::vector<std::string> names;
  for (hsize_t i = 0; i < info.nlinks; ++i) {
    const ssize_t n =
        H5Lget_name_by_idx(id(), ".", H5_INDEX_NAME, H5_ITER_INC, i, nullptr, 0, H5P_DEFAULT);
    if (n < 0) fail(describe() + ": cannot list members");
    std::string name(size_t(n) + 1, '\0');
    H5Lget_name_by_idx(id(), ".", H5_INDEX_NAME, H5_ITER_INC, i, name.data(), name.size(),
                       H5P_DEFAULT);
    name.resize(static_cast<size_t>(n));
    names.push_back(name);
  }
  return names;
}

Group Group::create_group(const std::string& name) const {
  if (exists(name)) throw Error(file_ + ": " + child_path(name) + " already exists");
  Handle lcpl = link_create_plist();
  Handle gcpl(check(H5Pcreate(H5P_GROUP_CREATE), "H5Pcreate(group)"));
  // No timestamps: the same content gives the same bytes.
  check(H5Pset_obj_track_times(gcpl.id(), 0), "H5Pset_obj_track_times");
  Handle g(check(H5Gcreate2(id(), name.c_str(), lcpl.id(), gcpl.id(), H5P_DEFAULT),
                 file_ + ": cannot create group " + child_path(name)));
  return Group(std::move(g), file_);
}

void copy_object(const Object& src, const Group& dst_parent, const std::string& name) {
  if (dst_parent.exists(name))
    throw Error(dst_parent.file_name() + ": " + dst_parent.child_path(name) + " already exists");
  if (H5Ocopy(src.id(), ".", dst_parent.id(), name.c_str(), H5P_DEFAULT, H5P_DEFAULT) < 0)
    throw Error("cannot copy " + src.describe() + " to " + dst_parent.file_name() + ": " +
                dst_parent.child_path(name));
}

Group Group::open_group(const std::string& name) const {
  const H5I_type_t kind = object_kind(*this, name);
  if (kind == H5I_BADID) throw Error(file_ + ": no group " + child_path(name));
  if (kind != H5I_GROUP) throw Error(file_ + ": " + child_path(name) + " is not a group");
  return Group(Handle(check(H5Gopen2(id(), name.c_str(), H5P_DEFAULT),
                            file_ + ": cannot open group " + child_path(name))),
               file_);
}

Dataset Group::open_dataset(const std::string& name) const {
  const H5I_type_t kind = object_kind(*this, name);
  if (kind == H5I_BADID) throw Error(file_ + ": no dataset " + child_path(name));
  if (kind != H5I_DATASET) throw Error(file_ + ": " + child_path(name) + " is not a dataset");
  return Dataset(Handle(check(H5Dopen2(id(), name.c_str(), H5P_DEFAULT),
                              file_ + ": cannot open dataset " + child_path(name))),
                 file_);
}

namespace {
// Whole trailing axes and as many rows as fit kDefaultChunkBytes; rows too large on their
// own are halved along axis 1, then 2, ... until the chunk fits.
std::vector<hsize_t> default_chunk(const Shape& dims, bool appendable, size_t elem_size) {
  std::vector<hsize_t> c = to_hsize(dims);
  c[0] = 1;
  auto bytes = [&] {
    size_t b = elem_size;
    for (hsize_t x : c) b *= size_t(x);
    return b;
  };
  for (size_t i = 1; i < c.size(); ++i)
    while (bytes() > kDefaultChunkBytes && c[i] > 1) c[i] = (c[i] + 1) / 2;
  const hsize_t rows = std::max<hsize_t>(1, kDefaultChunkBytes / bytes());
  c[0] = appendable ? rows : std::min<hsize_t>(rows, hsize_t(dims[0]));
  return c;
}
}  // namespace

Dataset Group::make_dataset(const std::string& name, DType dtype, const Shape& dims,
                            bool appendable, const DatasetOptions& opt) const {
  const std::string where = file_ + ": " + child_path(name);
  for (int64_t d : dims)
    if (d < 0) throw Error(where + ": negative extent in shape " + to_string(dims));
  if (opt.deflate_level < 0 || opt.deflate_level > 9)
    throw Error(where + ": DatasetOptions::deflate_level must be 0..9, got " +
                std::to_string(opt.deflate_level));
  if (exists(name)) throw Error(where + " already exists");

  const int rank = int(dims.size());
  std::vector<hsize_t> cur = to_hsize(dims), max_dims = cur;
  if (appendable) max_dims[0] = H5S_UNLIMITED;
  Handle space(rank == 0 ? check(H5Screate(H5S_SCALAR), "H5Screate")
                         : check(H5Screate_simple(rank, cur.data(), max_dims.data()),
                                 where + ": cannot make dataspace " + to_string(dims)));

  Handle dcpl(check(H5Pcreate(H5P_DATASET_CREATE), "H5Pcreate(dataset)"));
  check(H5Pset_obj_track_times(dcpl.id(), 0), "H5Pset_obj_track_times");
  // HDF5 needs chunks for an unlimited axis, and cannot chunk an empty fixed extent.
  const bool chunked = appendable || (opt.chunked && rank > 0 && num_elements(dims) > 0);
  if (chunked) {
    std::vector<hsize_t> chunk;
    if (opt.chunk.empty()) {
      chunk = default_chunk(dims, appendable, size_of(dtype));
    } else {
      bool ok = int(opt.chunk.size()) == rank;
      for (int i = 0; ok && i < rank; ++i)
        ok = opt.chunk[i] > 0 && ((appendable && i == 0) || opt.chunk[i] <= dims[i]);
      if (!ok)
        throw Error(where + ": DatasetOptions::chunk " + to_string(opt.chunk) +
                    " must have one positive extent per axis, at most the shape " +
                    to_string(dims));
      chunk = to_hsize(opt.chunk);
    }
    check(H5Pset_chunk(dcpl.id(), rank, chunk.data()), where + ": cannot set chunk shape");
    if (opt.deflate_level > 0) {
      if (H5Zfilter_avail(H5Z_FILTER_DEFLATE) <= 0)
        throw Error(where + ": this HDF5 library has no deflate filter; set deflate_level = 0");
      if (opt.shuffle) check(H5Pset_shuffle(dcpl.id()), where + ": cannot set shuffle");
      check(H5Pset_deflate(dcpl.id(), unsigned(opt.deflate_level)), where + ": cannot set deflate");
    }
  }
  Handle ftype = file_type(dtype);
  Handle lcpl = link_create_plist();
  Handle ds(check(
      H5Dcreate2(id(), name.c_str(), ftype.id(), space.id(), lcpl.id(), dcpl.id(), H5P_DEFAULT),
      "cannot create dataset " + where));
  return Dataset(std::move(ds), file_);
}

// ---------------------------------------------------------------------------------------
// Free functions

Dataset write_dataset(const Group& group, const std::string& name, DType dtype, const void* data,
                      const Shape& shape, const DatasetOptions& options) {
  Dataset ds = group.make_dataset(name, dtype, shape, false, options);
  if (num_elements(shape) > 0) {
    if (!data) throw Error(ds.describe() + ": no data to write");
    Handle mtype = mem_type(dtype);
    check(H5Dwrite(ds.id(), mtype.id(), H5S_ALL, H5S_ALL, H5P_DEFAULT, data),
          "cannot write " + ds.describe());
  }
  return ds;
}

Dataset create_appendable(const Group& group, const std::string& name, DType dtype,
                          const Shape& row_shape, const DatasetOptions& options) {
  for (int64_t d : row_shape)
    if (d <= 0)
      throw Error(group.file_name() + ": " + group.child_path(name) + ": row shape " +
                  to_string(row_shape) + " must have positive extents");
  Shape dims{0};
  dims.insert(dims.end(), row_shape.begin(), row_shape.end());
  return group.make_dataset(name, dtype, dims, true, options);
}

Dataset open_dataset(const Group& group, const std::string& name, DType expected_dtype,
                     const Shape& expected_shape) {
  Dataset ds = group.open_dataset(name);
  const Shape s = ds.shape();
  bool shape_ok = s.size() == expected_shape.size();
  for (size_t i = 0; shape_ok && i < s.size(); ++i)
    shape_ok = expected_shape[i] < 0 || expected_shape[i] == s[i];
  std::string problems;
  Handle t(check(H5Dget_type(ds.id()), ds.describe() + ": cannot get type"));
  DType d;
  std::string what;
  if (!classify(t.id(), &d, &what)) {
    problems = "dtype " + what + ", expected " + to_string(expected_dtype);
  } else if (d != expected_dtype) {
    problems = std::string("dtype ") + to_string(d) + ", expected " + to_string(expected_dtype);
  }
  if (!shape_ok) {
    if (!problems.empty()) problems += ", and ";
    problems += "shape " + to_string(s) + ", expected " + to_string(expected_shape);
  }
  if (!problems.empty()) throw Error(ds.describe() + " has " + problems);
  return ds;
}

// ---------------------------------------------------------------------------------------
// File, AtomicWriter

File File::open_read(const std::string& path) {
  quiet();
  struct stat st;
  if (::stat(path.c_str(), &st) != 0)
    throw Error(path + ": cannot open (" + std::strerror(errno) + ")");
  if (S_ISDIR(st.st_mode)) throw Error(path + ": is a directory, expected an HDF5 file");
  const htri_t is_h5 = H5Fis_hdf5(path.c_str());
  if (is_h5 <= 0) {
    forget_error();
    throw Error(path + ": not an HDF5 file (no HDF5 signature)");
  }
  const Handle fapl = file_access_plist(false);
  const hid_t id = H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl.id());
  if (id < 0) fail(path + ": damaged or truncated HDF5 file");
  return File(Handle(id), path);
}

Group File::root() const {
  return Group(Handle(check(H5Gopen2(id(), "/", H5P_DEFAULT), name_ + ": cannot open /")), name_);
}

AtomicWriter::AtomicWriter(std::string final_path) : final_path_(std::move(final_path)) {
  quiet();
  if (final_path_.empty()) throw Error("h5::AtomicWriter: empty output path");
  temp_path_ = final_path_ + ".tmp." + std::to_string(::getpid());
  // Strong close: commit closes every group and dataset still open, so that nothing is
  // left unflushed when the file is renamed into place.
  const Handle fapl = file_access_plist(true);
  const hid_t id = H5Fcreate(temp_path_.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl.id());
  if (id < 0) fail(final_path_ + ": cannot create temporary file " + temp_path_);
  file_ = File(Handle(id), final_path_);
}

AtomicWriter::~AtomicWriter() {
  if (committed_) return;
  close_file();
  std::remove(temp_path_.c_str());
  forget_error();
}

const File& AtomicWriter::file() const {
  if (committed_) throw Error(final_path_ + ": already committed, the file is closed");
  return file_;
}

bool AtomicWriter::close_file() {
  const hid_t id = file_.handle_.release();
  return !(id >= 0 && H5Iis_valid(id) > 0 && H5Fclose(id) < 0);
}

void AtomicWriter::commit() {
  if (committed_) throw Error(final_path_ + ": already committed");
  committed_ = true;  // from here on, commit itself cleans up on failure
  if (!close_file()) {
    const std::string reason = hdf5_reason();
    std::remove(temp_path_.c_str());
    throw Error(final_path_ + ": cannot close " + temp_path_ + " (" + reason + ")");
  }
  auto give_up = [&](const std::string& what) {
    const std::string err = std::strerror(errno);
    std::remove(temp_path_.c_str());
    throw Error(final_path_ + ": " + what + " " + temp_path_ + " (" + err + ")");
  };
  // fsync before rename: otherwise a crash can leave the new name pointing at empty blocks.
  const int fd = ::open(temp_path_.c_str(), O_RDONLY);
  if (fd < 0) give_up("cannot reopen");
  const int synced = ::fsync(fd);
  ::close(fd);
  if (synced != 0) give_up("cannot fsync");
  if (std::rename(temp_path_.c_str(), final_path_.c_str()) != 0) give_up("cannot rename");
  const size_t slash = final_path_.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : final_path_.substr(0, slash + 1);
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (dfd >= 0) {  // best effort: some file systems cannot fsync a directory
    ::fsync(dfd);
    ::close(dfd);
  }
}

}  // namespace h5
}  // namespace kvs
