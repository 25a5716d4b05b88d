#include "indexbuild/indexbuild.h"

#include <set>
#include <stdexcept>

#include "artifacts/bundle.h"
#include "artifacts/trained_file.h"
#include "runtime/engine.h"
#include "runtime/magicpig_engine.h"

namespace kvs {

void build_bundle(const std::string& out, const IndexbuildInputs& in) {
  in.shape.validate();
  std::vector<TrainedFile> parts;
  std::set<std::string> methods;
  for (const std::string& path : in.trained_files) {
    TrainedFile t = TrainedFile::open(path);
    if (t.shape().fingerprint() != in.shape.fingerprint())
      throw std::invalid_argument(path + ": trained for model fingerprint " +
                                  t.shape().fingerprint() + ", the bundle is for " +
                                  in.shape.fingerprint() + "; differing fields:\n" +
                                  t.shape().diff(in.shape));
    if (!methods.insert(t.method()).second)
      throw std::invalid_argument(path + ": a second trained file for method '" + t.method() + "'");
    validate_stored_parts(method_from_string(t.method()), t.group(), in.shape);
    parts.push_back(std::move(t));
  }
  BundleWriter w(out, in.shape);
  for (const TrainedFile& t : parts) w.copy_method_group(t.method(), t.group());
  if (in.magicpig.include) {
    if (methods.count("magicpig"))
      throw std::invalid_argument("magicpig given both as a trained file and to generate");
    const h5::Group g = w.method_group("magicpig");
    save_magicpig_projection(g, kernels::magicpig::make_projection(
                                    in.shape.head_dim, in.magicpig.bits, in.magicpig.tables,
                                    in.magicpig.seed));
    validate_stored_parts(Method::MagicPig, g, in.shape);
  }
  w.commit();
}

}  // namespace kvs
