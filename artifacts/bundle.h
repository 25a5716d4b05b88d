// The per-model artifact bundle: one HDF5 file with everything the runtime needs for the
// sparse methods of one model.
//
//   /                 format_version (int), fingerprint, created_by, ModelShape attributes
//   /<method>/        one group per method (dense, mac, tactic, magicpig, saap, attnpred):
//                     its arrays as datasets, its knobs as attributes
//
//   BundleWriter w("bundle.h5", shape);
//   h5::Group g = w.method_group("saap");
//   h5::write_dataset(g, "centroids", c.data(), {L, Hkv, C, d});
//   g.set_attr_int("num_clusters", C);
//   w.commit();                                     // atomic: nothing at bundle.h5 before
//
//   Bundle b = Bundle::open("bundle.h5");           // checks version and fingerprint
//   b.check_model(shape);                           // refuses a bundle of another model
//   h5::Group saap = b.method_group("saap");
#pragma once

#include <string>
#include <vector>

#include "artifacts/h5.h"
#include "artifacts/model_shape.h"

namespace kvs {

// Bumped whenever a reader of the old layout would misread the new one.
constexpr int kBundleFormatVersion = 1;

// The method group names a bundle may hold, in a fixed order.
const std::vector<std::string>& bundle_method_names();

// "kvsparse <version>", the created_by of bundles written by this build.
std::string kvsparse_created_by();

class BundleWriter {
 public:
  // Validates `shape`; writes to a temporary file until commit().
  BundleWriter(const std::string& path, const ModelShape& shape);

  // Creates the group on first use and returns the same group afterwards. Throws, listing
  // the valid names, for a name not in bundle_method_names().
  h5::Group method_group(const std::string& method);

  // Copies a method group made elsewhere (a trainer's output, artifacts/trained_file.h) into
  // the bundle as /<method>, arrays, knobs and all. Same name checks as method_group.
  void copy_method_group(const std::string& method, const h5::Group& source);

  void commit();
  const std::string& path() const { return writer_.final_path(); }

 private:
  h5::AtomicWriter writer_;
};

class Bundle {
 public:
  // Throws naming the path on a missing or damaged file, a format_version other than
  // kBundleFormatVersion (saying both), missing model attributes, or a stored fingerprint
  // that does not match the stored model attributes (a modified file).
  static Bundle open(const std::string& path);

  // Throws unless `expected` has this bundle's fingerprint; the message has both
  // fingerprints and the fields that differ.
  void check_model(const ModelShape& expected) const;

  bool has_method(const std::string& method) const;
  std::vector<std::string> methods() const;  // present ones, in bundle_method_names() order
  h5::Group method_group(const std::string& method) const;  // throws naming those present

  const std::string& path() const { return file_.path(); }
  int format_version() const { return format_version_; }
  const ModelShape& shape() const { return shape_; }
  const std::string& fingerprint() const { return fingerprint_; }
  const std::string& created_by() const { return created_by_; }
  h5::Group root() const { return file_.root(); }

 private:
  Bundle() = default;
  h5::File file_;
  int format_version_ = 0;
  ModelShape shape_;
  std::string fingerprint_, created_by_;
};

}  // namespace kvs
