// The kvs-train subcommands: one per trainable method, each a thin main of its own
// (tools/train/train_<method>.cpp) over the trainer in train/.
#pragma once

#include <vector>

namespace kvs::tools {

struct TrainCommand {
  const char* name;     ///< the method, e.g. "saap"
  const char* summary;  ///< one line for kvs-train --help
  int (*main)(int argc, char** argv);  ///< argv[0] is the method name
};

// Every subcommand this build has (train_commands.cpp lists them).
const std::vector<TrainCommand>& train_commands();

}  // namespace kvs::tools
