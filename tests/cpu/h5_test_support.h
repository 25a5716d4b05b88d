// Helpers shared by the HDF5 layer's tests: a scratch folder per test and error capture.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "artifacts/h5.h"

namespace kvs {
namespace testing_h5 {

// A fresh folder per test (unique per process and test name), removed afterwards.
class TempDir {
 public:
  TempDir() {
    const auto* info = testing::UnitTest::GetInstance()->current_test_info();
    std::string name =
        "kvs_h5_" + std::to_string(::getpid()) + "_" + info->test_suite_name() + "_" + info->name();
    for (char& c : name)
      if (c == '/') c = '_';  // typed tests are named "Suite/0"
    dir_ = std::filesystem::temp_directory_path() / name;
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  ~TempDir() { std::filesystem::remove_all(dir_); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

 private:
  std::filesystem::path dir_;
};

// Runs `f`, expecting h5::Error; returns its message ("" and a test failure otherwise).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const h5::Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no h5::Error thrown";
  return "";
}

}  // namespace testing_h5
}  // namespace kvs
