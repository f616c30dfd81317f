// `lorastream`: the coordinator daemon and its client verbs (coordinator/cli/cli.h).
#include "coordinator/cli/cli.h"

int main(int argc, char** argv) { return lorastream::cli::RunLorastreamCli(argc, argv); }
