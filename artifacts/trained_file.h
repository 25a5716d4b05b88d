// What a trainer writes (kvs-train): one method's trained parts for one model, in the same
// layout as that method's bundle group, so kvs-indexbuild copies the group as it is.
//
//   /          attrs: kind = "kvsparse-trained", format_version, method, the model
//              attributes (artifacts/model_io.h) and fingerprint
//   /<method>/ the method's arrays (datasets) and knobs (attributes)
#pragma once

#include <string>

#include "artifacts/h5.h"
#include "artifacts/model_shape.h"

namespace kvs {

constexpr int kTrainedFormatVersion = 1;

class TrainedFileWriter {
 public:
  TrainedFileWriter(const std::string& path, const std::string& method, const ModelShape& shape);
  h5::Group group() const { return group_; }  ///< /<method>: write arrays and knobs here
  h5::Group root() const { return writer_.root(); }
  void commit();  ///< atomic: nothing at `path` before

 private:
  h5::AtomicWriter writer_;
  h5::Group group_;
};

class TrainedFile {
 public:
  // Throws naming the path when it is not a trained file, has another format_version, or
  // its stored fingerprint does not match its stored model attributes.
  static TrainedFile open(const std::string& path);

  const std::string& path() const { return file_.path(); }
  const std::string& method() const { return method_; }
  const ModelShape& shape() const { return shape_; }
  h5::Group group() const { return file_.root().open_group(method_); }
  h5::Group root() const { return file_.root(); }

 private:
  h5::File file_;
  std::string method_;
  ModelShape shape_;
};

}  // namespace kvs
