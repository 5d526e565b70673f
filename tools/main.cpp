// The epx binary: everything but main() is in cli.cpp and the command files, which the fuzz target
// tests/fuzz/cli_fuzz.cpp links too.
#include "command.h"

int main(int argc, char** argv) { return epx::cli::run(argc, argv); }
