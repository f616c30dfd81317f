// Finds NaN or infinite values in raw tensor bytes (base weights are refused when they hold
// any: training on them would only end in a NaN loss that blames the learning rate).
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/base/dtype.h"

namespace lorastream {

// Index of the first element of `count` elements of `dtype` at `data` that is NaN or +-inf;
// -1 when every one is finite (and for integer dtypes, which cannot hold either).
int64_t FirstNonFinite(const uint8_t* data, size_t count, DType dtype);

}  // namespace lorastream
