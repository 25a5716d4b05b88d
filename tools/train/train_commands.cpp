// The kvs-train subcommands this build has: one line per trainable method.
#include "tools/train/train_commands.h"

namespace kvs::tools {

#ifdef KVS_TRAIN_SAAP
int train_saap_main(int argc, char** argv);  // tools/train/train_saap.cpp
#endif
int train_attnpred_main(int argc, char** argv);  // tools/train/train_attnpred.cpp

const std::vector<TrainCommand>& train_commands() {
  static const std::vector<TrainCommand> commands = {
#ifdef KVS_TRAIN_SAAP
      {"saap", "SAAP: Faiss k-means of pre-RoPE keys + per-query-head MLP router (libtorch)",
       train_saap_main},
#endif
      {"attnpred", "AttentionPredictor: the CNN that forecasts block attention (libtorch)",
       train_attnpred_main},
  };
  return commands;
}

}  // namespace kvs::tools
