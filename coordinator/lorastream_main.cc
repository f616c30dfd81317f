// `lorastream`: the coordinator daemon and its client verbs (coordinator/cli.h).
#include "coordinator/cli.h"

int main(int argc, char** argv) { return lorastream::cli::RunLorastreamCli(argc, argv); }
