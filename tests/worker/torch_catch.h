// LibTorch's headers pull in glog, whose CHECK macro collides with Catch's. Include torch
// first, drop glog's CHECK, then Catch: every test file that uses ATen includes this instead.
#pragma once

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#undef CHECK
#include <catch2/catch.hpp>
