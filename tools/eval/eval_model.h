// kvs-eval's model-level subcommands (libtorch builds only): `kvs-eval ppl` and
// `kvs-eval needle` run the methods inside the model's decode loop (capture/model_eval.h).
#pragma once

namespace kvs::tools {

// argv[0] is the subcommand name. Return the process exit code.
int run_ppl(int argc, char** argv);
int run_needle(int argc, char** argv);

}  // namespace kvs::tools
