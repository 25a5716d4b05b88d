// kvs-train <method> [options]: trains a method's stored parts from capture files and writes
// them as a trained file (artifacts/trained_file.h) for kvs-indexbuild.
#include <cstdio>
#include <cstring>
#include <string>

#include "tools/train/train_commands.h"

int main(int argc, char** argv) {
  const char* usage =
      "usage: kvs-train <method> [options]   (kvs-train <method> --help for its options)\n"
      "methods:\n";
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0) {
    std::fputs(usage, argc < 2 ? stderr : stdout);
    for (const auto& c : kvs::tools::train_commands())
      std::fprintf(argc < 2 ? stderr : stdout, "  %-10s %s\n", c.name, c.summary);
    return argc < 2 ? 2 : 0;
  }
  for (const auto& c : kvs::tools::train_commands())
    if (argv[1] == std::string(c.name)) return c.main(argc - 1, argv + 1);
  std::fprintf(stderr, "kvs-train: unknown method '%s'\n", argv[1]);
  for (const auto& c : kvs::tools::train_commands()) std::fprintf(stderr, "  %s\n", c.name);
  return 2;
}
