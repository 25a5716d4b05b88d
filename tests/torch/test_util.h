// Where the torch tests find the embedded model and the corpus, and small file helpers.
#pragma once

#include <dirent.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <stdexcept>
#include <string>

namespace kvs::testing {

inline bool path_exists(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0;
}

// The project carries kvs-tiny-a in models/ and the corpus in data/corpus; a checkout
// beside shared/ has them there too.
inline std::string find_in_tree(const std::string& in_project, const std::string& in_shared) {
  const std::string a = std::string(KVS_SOURCE_DIR) + "/" + in_project;
  const std::string b = std::string(KVS_SOURCE_DIR) + "/../shared/" + in_shared;
  if (path_exists(a)) return a;
  if (path_exists(b)) return b;
  throw std::runtime_error("test data not found: neither '" + a + "' nor '" + b + "' exists");
}

inline std::string tiny_model_dir() {
  return find_in_tree("models/kvs-tiny-a", "models/kvs-tiny-a");
}

// The first `bytes` bytes of the held-out validation text (gunzipped on the fly).
inline std::string validation_text(size_t bytes) {
  const std::string gz = find_in_tree("data/corpus/docs.val.txt.gz", "corpus/docs.val.txt.gz");
  FILE* p = ::popen(("gzip -dc '" + gz + "'").c_str(), "r");
  if (!p) throw std::runtime_error("cannot run gzip on '" + gz + "'");
  std::string text(bytes, '\0');
  const size_t got = std::fread(&text[0], 1, bytes, p);
  ::pclose(p);  // gzip may die of SIGPIPE once we stop reading; that is expected
  if (got != bytes)
    throw std::runtime_error("'" + gz + "' gave " + std::to_string(got) + " bytes, wanted " +
                             std::to_string(bytes));
  return text;
}

// A fresh temporary folder, removed (with its files) by the destructor.
class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/kvs_test_XXXXXX";
    if (!::mkdtemp(tmpl)) throw std::runtime_error("mkdtemp failed");
    path_ = tmpl;
  }
  // The folder is flat (tests write files, not subfolders). POSIX calls rather than
  // std::filesystem: with PyTorch's libtorch on the GPU machine std::filesystem::remove_all
  // crashed. Best effort: a leftover temp folder is harmless.
  ~TempDir() {
    if (DIR* d = ::opendir(path_.c_str())) {
      while (const dirent* e = ::readdir(d)) {
        const std::string name = e->d_name;
        if (name != "." && name != "..") ::unlink(file(name).c_str());
      }
      ::closedir(d);
    }
    ::rmdir(path_.c_str());
  }
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

inline void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), std::streamsize(bytes.size()));
  if (!out) throw std::runtime_error("cannot write '" + path + "'");
}

}  // namespace kvs::testing
