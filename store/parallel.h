// Running n independent pieces of work on a few threads (the store's loading and packing).
#pragma once

#include <cstddef>
#include <functional>

namespace lorastream::store {

// Runs fn(0..n-1) on `threads` threads (the caller's among them); rethrows the first
// exception after every thread has joined.
void RunParallel(size_t n, int threads, const std::function<void(size_t)>& fn);

}  // namespace lorastream::store
