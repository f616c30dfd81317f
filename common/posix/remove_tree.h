// Removing a directory tree without std::filesystem::remove_all.
//
// Why: the CUDA builds of LibTorch (the PyTorch wheels) export their own copies of many
// std::filesystem functions (libtorch.so, libtorch_cpu.so: built with a toolchain that links
// libstdc++fs statically). In a binary linked against them, those copies win symbol resolution
// over libstdc++'s, and libtorch.so's remove_all jumps to a null pointer as soon as the
// directory is not empty (measured on torch 2.11: SIGSEGV, rip = 0). Every torch-linked
// program (lorastream-worker, the benchmarks, the worker and GPU tests) removes trees with
// this instead. Torch-free, plain POSIX.
#pragma once

#include <string>

namespace lorastream {

// Removes `path` and, when it is a directory, everything below it. Symbolic links are removed,
// never followed. A path that does not exist is not an error. Returns false and sets *error
// (naming the entry) when something could not be removed; the rest is still attempted.
bool RemoveTree(const std::string& path, std::string* error = nullptr);

}  // namespace lorastream
