#include "artifacts/bundle.h"

#include <algorithm>
#include <stdexcept>

#include "artifacts/model_io.h"

namespace kvs {
namespace {

std::string join(const std::vector<std::string>& names) {
  std::string s;
  for (const auto& n : names) s += (s.empty() ? "" : ", ") + n;
  return s.empty() ? "(none)" : s;
}

void check_method_name(const std::string& where, const std::string& method) {
  const auto& names = bundle_method_names();
  if (std::find(names.begin(), names.end(), method) == names.end())
    throw h5::Error(where + ": unknown method '" + method + "' (methods: " + join(names) + ")");
}

}  // namespace

const std::vector<std::string>& bundle_method_names() {
  static const std::vector<std::string> names{"dense",    "mac",  "tactic",
                                              "magicpig", "saap", "attnpred"};
  return names;
}

std::string kvsparse_created_by() { return std::string("kvsparse ") + KVS_VERSION_STRING; }

BundleWriter::BundleWriter(const std::string& path, const ModelShape& shape) : writer_(path) {
  const h5::Group root = writer_.root();
  root.set_attr_int("format_version", kBundleFormatVersion);
  write_model_shape(root, shape);
  root.set_attr_string("fingerprint", shape.fingerprint());
  root.set_attr_string("created_by", kvsparse_created_by());
}

void BundleWriter::copy_method_group(const std::string& method, const h5::Group& source) {
  check_method_name(writer_.final_path(), method);
  h5::copy_object(source, writer_.root(), method);
}

h5::Group BundleWriter::method_group(const std::string& method) {
  check_method_name(writer_.final_path(), method);
  const h5::Group root = writer_.root();
  return root.exists(method) ? root.open_group(method) : root.create_group(method);
}

void BundleWriter::commit() { writer_.commit(); }

Bundle Bundle::open(const std::string& path) {
  Bundle b;
  b.file_ = h5::File::open_read(path);
  const h5::Group root = b.file_.root();
  if (!root.has_attr("format_version"))
    throw h5::Error(path + ": not a kvsparse bundle (no format_version attribute)");
  const int64_t version = root.attr_int("format_version");
  if (version != kBundleFormatVersion)
    throw h5::Error(path + ": bundle format_version " + std::to_string(version) +
                    ", this kvsparse reads format_version " + std::to_string(kBundleFormatVersion));
  b.format_version_ = int(version);
  b.shape_ = read_model_shape(root);
  b.fingerprint_ = root.attr_string("fingerprint");
  b.created_by_ = root.attr_string("created_by");
  const std::string computed = b.shape_.fingerprint();
  if (b.fingerprint_ != computed)
    throw h5::Error(path + ": stored fingerprint " + b.fingerprint_ +
                    " does not match its model attributes (fingerprint " + computed +
                    "): the file was modified or damaged");
  return b;
}

void Bundle::check_model(const ModelShape& expected) const {
  const std::string want = expected.fingerprint();
  if (want == fingerprint_) return;
  throw h5::Error(path() + ": bundle is for another model: its fingerprint " + fingerprint_ +
                  ", expected " + want + "; differing fields (bundle vs expected):\n" +
                  shape_.diff(expected));
}

bool Bundle::has_method(const std::string& method) const {
  const auto& names = bundle_method_names();
  if (std::find(names.begin(), names.end(), method) == names.end()) return false;
  return file_.root().is_group(method);
}

std::vector<std::string> Bundle::methods() const {
  std::vector<std::string> present;
  for (const auto& m : bundle_method_names())
    if (has_method(m)) present.push_back(m);
  return present;
}

h5::Group Bundle::method_group(const std::string& method) const {
  check_method_name(path(), method);
  if (!has_method(method))
    throw h5::Error(path() + ": bundle has no '" + method +
                    "' group (methods present: " + join(methods()) + ")");
  return file_.root().open_group(method);
}

}  // namespace kvs
