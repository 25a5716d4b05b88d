#include "artifacts/trained_file.h"

#include "artifacts/model_io.h"

namespace kvs {
namespace {
const char* kKind = "kvsparse-trained";
}

TrainedFileWriter::TrainedFileWriter(const std::string& path, const std::string& method,
                                     const ModelShape& shape)
    : writer_(path) {
  const h5::Group root = writer_.root();
  root.set_attr_string("kind", kKind);
  root.set_attr_int("format_version", kTrainedFormatVersion);
  root.set_attr_string("method", method);
  write_model_shape(root, shape);
  root.set_attr_string("fingerprint", shape.fingerprint());
  group_ = root.create_group(method);
}

void TrainedFileWriter::commit() {
  group_ = h5::Group();
  writer_.commit();
}

TrainedFile TrainedFile::open(const std::string& path) {
  TrainedFile t;
  t.file_ = h5::File::open_read(path);
  const h5::Group root = t.file_.root();
  if (!root.has_attr("kind") || root.attr_string("kind") != kKind)
    throw h5::Error(path + ": not a kvsparse trained file (root attribute kind != '" +
                    std::string(kKind) + "')");
  const int64_t version = root.attr_int("format_version");
  if (version != kTrainedFormatVersion)
    throw h5::Error(path + ": trained-file format_version " + std::to_string(version) +
                    ", this build reads version " + std::to_string(kTrainedFormatVersion));
  t.method_ = root.attr_string("method");
  t.shape_ = read_model_shape(root);
  const std::string stored = root.attr_string("fingerprint");
  if (stored != t.shape_.fingerprint())
    throw h5::Error(path + ": stored fingerprint " + stored +
                    " does not match its model attributes (" + t.shape_.fingerprint() +
                    "): the file was modified");
  if (!root.is_group(t.method_))
    throw h5::Error(path + ": no /" + t.method_ + " group for its method '" + t.method_ + "'");
  return t;
}

}  // namespace kvs
